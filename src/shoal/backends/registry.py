"""Which backends, container runtimes and VM monitors exist: name → factory, imported on first use.

A backend's module is imported only when a node first needs that backend, so an uninstalled extra (or a
host without QEMU) costs nothing until someone asks for it — and then its import errors are loud.
Adding a backend, a runtime or a VMM is one module plus one entry here (docs/architecture.md shows the steps).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shoal.errors import BackendUnavailable, InvalidRequest

if TYPE_CHECKING:
    from shoal.backends.base import Backend
    from shoal.backends.container.runtime import OciRuntime
    from shoal.backends.context import NodeContext
    from shoal.config import Settings


@dataclass(frozen=True)
class BackendEntry:
    """One backend: `factory` is "module:callable", called as `factory(ctx, name)` → Backend."""

    name: str
    factory: str
    summary: str
    #: gives no isolation (tests only): a node refuses it unless its config enables it
    test_only: bool = False
    #: the factory builds the class of the VM monitor `pick_vmm` chooses (one of VMMS), not one class of its own
    on_vmm: bool = False
    #: keeps host-wide machinery beside its sandboxes: the node builds it at start and calls its host hooks
    #: (Backend.host_start, host_reconcile, host_runtimes, host_teardown)
    host: bool = False


@dataclass(frozen=True)
class RuntimeEntry:
    """One OCI runtime for container sandboxes: `factory` is "module:class" of an `OciRuntime`."""

    name: str
    binary: str
    factory: str
    #: how to install the binary (shown when it is missing)
    install: str
    #: order in which runtime="auto" tries it (None: only when asked for by name)
    auto_rank: int | None = None


@dataclass(frozen=True)
class VmmEntry:
    """One virtual machine monitor the microvm backend can run on: `factory` is "module:callable", called as
    `factory(ctx, name)` → Backend; `usable` is "module:callable" → (usable, why), what `vmm="auto"` asks."""

    name: str
    factory: str
    usable: str
    #: how to install it (shown when it is asked for by name and cannot run)
    install: str
    #: order in which vmm="auto" tries it; the last one is taken even when it says it cannot run (its
    #: create then says what is missing)
    auto_rank: int


BACKENDS: dict[str, BackendEntry] = {e.name: e for e in (
    BackendEntry("container", "shoal.backends.container.backend:ContainerBackend",
                 "OCI containers (crun, runc or gVisor) over EROFS layers and an overlayfs upper", host=True),
    BackendEntry("microvm", "shoal.backends.microvm:make_microvm_backend",
                 "QEMU microvm (Firecracker when usable) booting shoal's guest kernel", on_vmm=True),
    BackendEntry("vm", "shoal.backends.vm:QemuVmBackend", "a full QEMU q35 VM booting the image's own kernel"),
    BackendEntry("fncall", "shoal.backends.fncall:FncallBackend",
                 "short code runs on warm pools of containers (run_code; no sandboxes of its own)"),
    BackendEntry("fake", "shoal.backends.fake:FakeBackend",
                 "NO isolation: each sandbox is a directory and plain processes, for unit tests", test_only=True),
)}

RUNTIMES: dict[str, RuntimeEntry] = {e.name: e for e in (
    RuntimeEntry("crun", "crun", "shoal.backends.container.runtime:CrunRuntime", "apt-get install crun", auto_rank=0),
    RuntimeEntry("runc", "runc", "shoal.backends.container.runtime:RuncRuntime", "apt-get install runc", auto_rank=1),
    RuntimeEntry("gvisor", "runsc", "shoal.backends.container.runtime:GvisorRuntime",
                 "apt-get install runsc (Debian 12), or the binary from gvisor.dev"),
)}

VMMS: dict[str, VmmEntry] = {e.name: e for e in (
    VmmEntry("firecracker", "shoal.backends.firecracker:FirecrackerBackend",
             "shoal.backends.firecracker:firecracker_usable",
             "the firecracker binary on PATH or in SHOAL_FIRECRACKER (not packaged by Debian); needs KVM", auto_rank=0),
    VmmEntry("qemu", "shoal.backends.vm:QemuVmBackend", "shoal.backends.qemu:qemu_usable",
             "apt-get install qemu-system-x86 qemu-utils", auto_rank=1),
)}

_loaded: dict[str, Callable[..., Any]] = {}


def _load(target: str) -> Callable[..., Any]:
    fn = _loaded.get(target)
    if fn is None:
        module, _, attr = target.partition(":")
        # no ImportError guard: a broken shoal module must fail loudly, not look like a missing feature
        fn = _loaded[target] = getattr(importlib.import_module(module), attr)
    return fn


def backend_names(*, include_test_only: bool = False) -> list[str]:
    """Registered backend names (the test-only ones only when asked)."""
    return [n for n, e in BACKENDS.items() if include_test_only or not e.test_only]


def host_backend_names() -> list[str]:
    """The backends whose host hooks a node calls (registered with `host=True`)."""
    return [n for n, e in BACKENDS.items() if e.host]


def check_backend_name(name: object) -> str:
    """`name` when it is a registered backend; InvalidRequest listing the choices otherwise."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise InvalidRequest(f"unknown backend {name!r}: choose {', '.join(backend_names())}")
    return name


def create_backend(name: str, ctx: NodeContext) -> Backend:
    """Build the backend `name` for a node (imports its module on first use)."""
    entry = BACKENDS.get(check_backend_name(name))
    assert entry is not None
    if entry.test_only and not ctx.config.fake_backend:
        raise BackendUnavailable(
            f"the {name} backend gives NO isolation (sandboxes are plain processes of this user) and is for "
            "unit tests only; it is disabled here. Tests enable it with NodeConfig(fake_backend=True) or "
            "SHOAL_FAKE_BACKEND=1; never enable it on a host that runs untrusted code")
    backend: Backend = _load(entry.factory)(ctx, name)
    return backend


def runtime_names() -> list[str]:
    """Registered container runtime names."""
    return list(RUNTIMES)


def auto_runtimes() -> list[str]:
    """The runtimes runtime="auto" tries, in order."""
    ranked = [e for e in RUNTIMES.values() if e.auto_rank is not None]
    return [e.name for e in sorted(ranked, key=lambda e: e.auto_rank or 0)]


def check_runtime_name(name: object) -> str:
    """`name` when it is "auto" or a registered runtime; InvalidRequest listing the choices otherwise."""
    if name == "auto" or (isinstance(name, str) and name in RUNTIMES):
        return name
    raise InvalidRequest(f"unknown runtime {name!r}: choose auto, {', '.join(RUNTIMES)}")


def make_runtime(name: str, binary: str) -> OciRuntime:
    """The OciRuntime object driving `binary` as runtime `name`."""
    entry = RUNTIMES.get(name)
    if entry is None:
        raise BackendUnavailable(f"unknown runtime {name!r}: choose {', '.join(RUNTIMES)}")
    runtime: OciRuntime = _load(entry.factory)(name, binary)
    return runtime


def vmm_names() -> list[str]:
    """Registered VM monitors, in the order vmm="auto" tries them."""
    return [e.name for e in sorted(VMMS.values(), key=lambda e: e.auto_rank)]


def pick_vmm(preference: str, s: Settings) -> tuple[VmmEntry, str]:
    """The VM monitor microVMs run on, with why: the one named by `preference`, or ("auto") the first in
    `auto_rank` order that says it can run here, else the last one (whose create says what is missing).
    BackendUnavailable when the one asked for by name cannot run."""
    if preference != "auto":
        entry = VMMS.get(preference)
        if entry is None:
            raise InvalidRequest(f"unknown VMM {preference!r}: choose auto, {', '.join(vmm_names())}")
        ok, why = _load(entry.usable)(s)
        if not ok:
            raise BackendUnavailable(f"SHOAL_VMM={preference}, but it cannot run here: {why} ({entry.install})")
        return entry, f"SHOAL_VMM={preference}: {why}"
    ranked = [VMMS[n] for n in vmm_names()]
    whys = []
    for entry in ranked[:-1]:
        ok, why = _load(entry.usable)(s)
        if ok:
            return entry, why
        whys.append(why)
    return ranked[-1], "; ".join(whys) or "the only VMM"


def make_vmm_backend(ctx: NodeContext, name: str) -> Backend:
    """The backend object for `name` (a microVM kind) on the VMM the node's `vmm` setting picks (pick_vmm)."""
    entry, _ = pick_vmm(ctx.settings.vmm, ctx.settings)
    backend: Backend = _load(entry.factory)(ctx, name)
    return backend
