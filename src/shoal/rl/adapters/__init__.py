"""Thin adapters giving shoal environments the call shapes of verl, OpenRLHF, SkyRL-gym and TRL.

None of those frameworks is imported: each adapter mirrors the methods and return shapes the framework
calls, so it can be dropped into that framework's config as is, and tested here with a scripted policy.
"""
