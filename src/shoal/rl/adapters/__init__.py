"""What the trainer integrations share (`_common`): one shoal client per event loop, task lookup by id, and
turning an LLM's action text into a shoal action. The integrations themselves, each subclassing its
framework's real base class, live in `shoal.integrations` (harbor, verl, openrlhf, skyrl, trl).
"""
