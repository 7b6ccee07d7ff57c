"""The container backend and the host machinery only it uses: OCI runtimes (crun, runc, gVisor), the OCI
config and seccomp profile, the upper pool and its disk guard, sandbox directories on a tmpfs, pause's
memory reclaim and the swap it relies on, CPU classes and the swap watch.

The package itself imports nothing: `shoal.backends.container.backend` is the backend (the registry loads it
on first use), and spec/CLI/bench code can import a helper module here without loading the backend.
"""
