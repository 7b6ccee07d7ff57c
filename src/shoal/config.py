"""shoal's settings: every `SHOAL_*` variable declared once, with its type, default, group and meaning.

Settings are loaded when a node, a server or a CLI command starts (`Settings.load()`, or the cached
`settings()` accessor), never when a module is imported. Each value comes from, lowest first:

    built-in default  <  config file  <  environment (SHOAL_*)  <  explicit argument

and remembers where it came from (`Settings.source(name)`; `shoal config` prints them). The config file
is `$SHOAL_CONFIG` when set (it must exist; `/dev/null` reads none), else `/etc/shoal/config.toml` when it
exists: a flat TOML table whose keys are the variable names without `SHOAL_`, in lower case
(`memory_overcommit = 8.0`). It is not under `$SHOAL_HOME` because it may set `home` itself.

A bad value fails at load with `InvalidSetting` naming the variable, the value, its source and what is
allowed. A `SHOAL_*` variable in the environment that is not declared here gets an
`UnknownSettingWarning` with the closest declared name ("did you mean ...").

How to add a setting: add one field to `Settings` below, `name: T = setting(default, "group", "one-line
doc", CONVERTER)`; its variable is `SHOAL_` + the field name in upper case and its config-file key is the
field name. Read it from the settings object your code was given, else from `settings().name` (never from
`os.environ`: tests/unit/test_config.py fails on a stray read). Then refresh the docs table with
`shoal config --markdown --update docs/configuration.md`.
"""

# No `from __future__ import annotations` here: Settings' field types are read at runtime (dataclasses).

import dataclasses
import difflib
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shoal.backends.registry import RUNTIMES, VMMS
from shoal.errors import InvalidRequest
from shoal.limits import MAX_HTTP_BATCH

PREFIX = "SHOAL_"
#: read when SHOAL_CONFIG is not set (and only if it exists)
DEFAULT_CONFIG_FILE = Path("/etc/shoal/config.toml")
#: groups in the order `shoal config` and the docs list them
GROUPS: dict[str, str] = {
    "paths": "where shoal keeps its state and finds its parts",
    "node": "the node agent: runtime, warm pool, memory reclaim, disk",
    "admission": "when a node refuses new sandboxes",
    "network": "sandbox networking",
    "vm": "microVM and full-VM backends (QEMU, Firecracker)",
    "fncall": "the function-call backend's worker pools",
    "api": "`shoal serve`: where it listens and the limits that keep one client from pinning it",
    "images": "image store, EROFS mounts, base image builds",
    "rl": "RL tasks and trainer adapters",
    "sched": "scheduling: priority classes, preemption by pausing, compute tides, event traces for `shoal sim`",
    "client": "the CLI talking to a remote `shoal serve`",
    "bench": "`shoal bench` and benchmark comparisons",
    "dev": "development and tests",
}
#: SHOAL_* variables shoal *sets* for processes it starts (never read by shoal itself): not settings,
#: but known, so their presence in the environment draws no warning
CHILD_VARIABLES: dict[str, str] = {
    "SHOAL_PYTEST_REPORT": "set in a sandbox's test command; shoal's pytest plugin writes its report there",
    "SHOAL_AGENT_NO_MEMFD": "read by the in-sandbox agent: use pipes instead of memfd (tests of the fallback)",
}


class InvalidSetting(InvalidRequest):
    """A setting has a value shoal cannot use (named, with its source and what is allowed)."""

    code = "invalid_setting"


class UnknownSettingWarning(UserWarning):
    """A SHOAL_* variable is set that no setting declares (probably a typo): it does nothing."""


# ---- converters: a value from the environment (str), the config file or an argument → a checked value
@dataclass(frozen=True)
class Conv:
    """How one setting's values are checked: `fn` returns the value or raises ValueError(what is allowed)."""

    kind: str  # shown in the docs' "type" column
    fn: Callable[[object], object]

    def __call__(self, value: object) -> object:
        return self.fn(value)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError("must be 1/true/yes/on or 0/false/no/off")


def _number(kind: type, lo: float | None, hi: float | None, lo_open: bool = False) -> Conv:
    what = "an integer" if kind is int else "a number"
    bounds = []
    if lo is not None:
        bounds.append(f"{'>' if lo_open else '≥'} {lo:g}")
    if hi is not None:
        bounds.append(f"≤ {hi:g}")
    allowed = f"must be {what}" + (f" {' and '.join(bounds)}" if bounds else "")

    def fn(v: object) -> object:
        if isinstance(v, bool):
            raise ValueError(allowed)
        try:
            n: int | float = kind(v.strip() if isinstance(v, str) else v)
        except (TypeError, ValueError):
            raise ValueError(allowed) from None
        if kind is float and n != n:  # NaN passes every comparison
            raise ValueError(allowed)
        if lo is not None and (n <= lo if lo_open else n < lo):
            raise ValueError(allowed)
        if hi is not None and n > hi:
            raise ValueError(allowed)
        return n

    label = ("int" if kind is int else "float") + (f" ({', '.join(bounds)})" if bounds else "")
    return Conv(label, fn)


def integer(lo: float | None = None, hi: float | None = None) -> Conv:
    """An integer setting, optionally bounded."""
    return _number(int, lo, hi)


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Conv:
    """A number setting, optionally bounded."""
    return _number(float, lo, hi, lo_open)


def choice(*choices: str) -> Conv:
    """One of a few words (case-insensitive)."""
    def fn(v: object) -> object:
        s = str(v).strip().lower()
        if s not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return s

    return Conv("|".join(choices), fn)


def text(pattern: str | None = None, what: str = "") -> Conv:
    """Free text, optionally matching `pattern` (then `what` says what it must look like)."""
    rx = re.compile(pattern) if pattern else None

    def fn(v: object) -> object:
        if not isinstance(v, str):
            raise ValueError("must be a string")
        if rx is not None and not rx.fullmatch(v):
            raise ValueError(f"must be {what}")
        return v

    return Conv("text", fn)


def _path(v: object) -> object:
    if not isinstance(v, (str, Path)) or not str(v).strip():
        raise ValueError("must be a path")
    return Path(v)


PATH = Conv("path", _path)
BOOL = Conv("bool", _bool)
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*")


def _size(v: object) -> object:
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return str(v)
    m = _SIZE.fullmatch(str(v))
    if not m or float(m.group(1)) <= 0:
        raise ValueError("must be a positive size: a number with an optional K, M, G or T suffix (e.g. 8G)")
    return str(v).strip()


SIZE = Conv("size (e.g. 8G)", _size)


def _zram_swap(v: object) -> object:
    s = str(v).strip().lower()
    if s in ("", "auto"):
        return "auto"
    if s in ("0", "off", "no", "none"):
        return "off"
    try:
        return _size(v)
    except ValueError:
        raise ValueError("must be auto (half the RAM, at most 8G, when the host has no swap), off "
                         "(leave swap alone) or a size such as 8G") from None


ZRAM_SWAP = Conv("auto|off|size", _zram_swap)


def _swap_policy(v: object) -> object:
    s = str(v).strip().lower()
    if s in ("", "auto"):
        return "auto"
    if s in ("0", "off", "no", "none"):
        return "0"
    try:
        return _size(s)
    except ValueError:
        raise ValueError("must be auto, 0 (no swap) or a size such as 512M") from None


def parse_warm_pool(v: object) -> dict[str, int]:
    """`"base=16,py:3.12=4"` (or a TOML table) → {"base": 16, "py:3.12": 4}."""
    if isinstance(v, Mapping):
        items = [(str(k), n) for k, n in v.items()]
    else:
        items = []
        for item in str(v).split(","):
            item = item.strip()
            if item:
                name, _, n = item.rpartition("=")
                items.append((name, n))
    out: dict[str, int] = {}
    for name, n in items:
        ok = (isinstance(n, int) and not isinstance(n, bool)) or (isinstance(n, str) and n.strip().isdigit())
        if not name or not ok:
            raise ValueError(f"item {name}={n} must look like IMAGE=COUNT (e.g. base=16,py:3.12=4)")
        out[name] = int(n)
    return out


def _template_map(v: object) -> object:
    if isinstance(v, Mapping):
        items = list(v.items())
    elif isinstance(v, str):
        items = []
        for part in v.split(","):
            if not part.strip():
                continue
            name, sep, image = part.partition("=")
            if not sep:
                raise ValueError("must look like TEMPLATE=IMAGE[,TEMPLATE=IMAGE...]")
            items.append((name, image))
    else:
        raise ValueError("must be TEMPLATE=IMAGE pairs")
    out = {str(k).strip(): str(i).strip() for k, i in items}
    if any(not k or not i for k, i in out.items()):
        raise ValueError("must look like TEMPLATE=IMAGE[,TEMPLATE=IMAGE...] (names and images non-empty)")
    return out


TEMPLATE_MAP = Conv("TEMPLATE=IMAGE,...", _template_map)


def _modules(v: object) -> object:
    items = v if isinstance(v, (list, tuple)) else str(v).split(",")
    mods = tuple(str(m).strip() for m in items if str(m).strip())
    bad = [m for m in mods if not re.fullmatch(r"[A-Za-z_][\w.]*", m)]
    if bad:
        raise ValueError(f"must be comma-separated Python module names ({bad[0]!r} is not one)")
    return mods


def _names(v: object) -> object:
    items = v if isinstance(v, (list, tuple)) else str(v).split(",")
    names = tuple(str(m).strip() for m in items if str(m).strip())
    bad = [m for m in names if not re.fullmatch(r"[A-Za-z0-9][\w.-]{0,63}", m)]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError("must be distinct comma-separated names (letters, digits, . _ -), most important first")
    return names


def _egress_sets(v: object) -> object:
    # NAME=rule rule …;NAME=… (a TOML table {name = [rules]} works too); checked like network=[rules]
    from shoal.egress import parse_rules

    items: list[tuple[str, list[str]]] = []
    if isinstance(v, dict):
        items = [(str(k), [str(x) for x in r] if isinstance(r, (list, tuple)) else str(r).split())
                 for k, r in v.items()]
    else:
        for part in str(v).split(";"):
            if part.strip():
                name, sep, text = part.partition("=")
                if not sep:
                    raise ValueError("must be NAME=rule rule …;NAME=… (e.g. corp=git.corp.example:443 10.1.0.0/16)")
                items.append((name.strip(), text.split()))
    out: dict[str, list[str]] = {}
    for name, rules in items:
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", name) or not rules:
            raise ValueError(f"set {name!r}: names are lowercase words, each with at least one rule")
        parse_rules(rules, {})  # InvalidRequest (a ValueError) names a bad rule
        out[name] = [str(r) for r in rules]
    return out


def _egress_grants(v: object) -> object:
    # keywords and CIDR[:ports], comma- or space-separated (a TOML list works too)
    from shoal.egress import parse_grants

    items = [str(x) for x in v] if isinstance(v, (list, tuple)) else str(v).replace(",", " ").split()
    parse_grants(items)  # InvalidRequest (a ValueError) names a bad grant
    return tuple(items)


def _networks(v: object) -> object:
    import ipaddress

    items = [str(x) for x in v] if isinstance(v, (list, tuple)) else str(v).replace(",", " ").split()
    for it in items:
        try:
            ipaddress.IPv4Network(it, strict=False)
        except ValueError:
            raise ValueError(f"must be IPv4 addresses or CIDRs ({it!r} is not one)") from None
    return tuple(items)


def _host_names(v: object) -> object:
    items = [str(x) for x in v] if isinstance(v, (list, tuple)) else str(v).replace(",", " ").split()
    bad = [h for h in items if not re.fullmatch(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]{0,252})", h)]
    if bad:
        raise ValueError(f"must be host names, comma-separated, optionally *.domain ({bad[0]!r} is not one)")
    return tuple(items)


SWAP_POLICY = Conv("auto|0|size", _swap_policy)
NAMES_OR_EMPTY = Conv("host,…", _host_names)
EGRESS_GRANTS = Conv("grant,…", _egress_grants)
NETWORKS = Conv("CIDR,…", _networks)
EGRESS_SETS = Conv("NAME=rule …;…", _egress_sets)
def parse_registry_mirrors(v: object) -> dict[str, list[str]]:
    """`"docker.io=http://127.0.0.1:5000 ghcr.io=https://m.example"` (spaces or commas between pairs; a
    registry named twice gets both mirrors, tried in order), or a TOML table of a URL or a list of URLs."""
    if isinstance(v, Mapping):
        items = [(str(k), u) for k, urls in v.items() for u in (urls if isinstance(urls, (list, tuple)) else [urls])]
    else:
        items = []
        for part in re.split(r"[\s,]+", str(v).strip()):
            if part:
                host, sep, url = part.partition("=")
                if not sep:
                    raise ValueError(f"{part!r} must look like REGISTRY=URL (e.g. docker.io=http://127.0.0.1:5000)")
                items.append((host, url))
    out: dict[str, list[str]] = {}
    for host, url in items:
        host, url = host.strip().lower(), str(url).strip().rstrip("/")
        if host in ("index.docker.io", "registry-1.docker.io"):
            host = "docker.io"
        if not re.fullmatch(r"[a-z0-9.-]+(:[0-9]+)?|\*", host):
            raise ValueError(f"registry {host!r} must be a host[:port] like docker.io or ghcr.io (or *)")
        if not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", url):
            raise ValueError(f"mirror {url!r} of {host} must be an http:// or https:// URL")
        out.setdefault(host, [])
        if url not in out[host]:
            out[host].append(url)
    return out


def _hosts(v: object) -> object:
    items = v if isinstance(v, (list, tuple)) else re.split(r"[\s,]+", str(v).strip())
    hosts = tuple(str(h).strip().lower() for h in items if str(h).strip())
    bad = [h for h in hosts if not re.fullmatch(r"[a-z0-9.-]+(:[0-9]+)?", h)]
    if bad:
        raise ValueError(f"must be host[:port] names separated by commas ({bad[0]!r} is not one)")
    return hosts


NAMES = Conv("name,…", _names)
MIRRORS = Conv("REGISTRY=URL …", parse_registry_mirrors)
HOSTS = Conv("host[:port],…", _hosts)
WARM_POOL = Conv("IMAGE=N,…", parse_warm_pool)
MODULES = Conv("module,…", _modules)


@dataclass(frozen=True)
class Meta:
    """What `setting()` records about one field."""

    group: str
    doc: str
    conv: Conv
    default_doc: str | None = None
    #: never printed in full (tokens)
    secret: bool = False
    #: an empty environment value is a value (e.g. "preload nothing"), not "unset"
    empty_is_value: bool = False
    #: the default is computed from other settings (e.g. store = home/store)
    derived: Callable[[Mapping[str, Any]], object] | None = None
    #: may be set in the config file (SHOAL_CONFIG cannot: it names the file)
    in_file: bool = True


def setting(default: object, group: str, doc: str, conv: Conv, **kw: Any) -> Any:
    """Declare one setting (a field of `Settings`); see the module docstring."""
    if group not in GROUPS:
        raise ValueError(f"unknown settings group {group!r}")
    md = {"shoal": Meta(group, doc, conv, **kw)}
    if isinstance(default, (dict, list)):
        frozen = dict(default) if isinstance(default, dict) else list(default)
        return field(default_factory=lambda: type(frozen)(frozen), metadata=md)
    return field(default=default, metadata=md)


def _optional(conv: Conv) -> Conv:
    return Conv(conv.kind, lambda v: None if v is None else conv(v))


@dataclass(frozen=True)
class Settings:
    """Every shoal setting (one field per SHOAL_* variable) and where each value came from."""

    # ---- paths
    home: Path = setting(Path("/var/lib/shoal"), "paths", "node state: sandboxes, layer mounts, locks, caches "
                         "(host-local disk)", PATH)
    store: Path = setting(Path("/var/lib/shoal/store"), "paths", "the layer store (may be a shared filesystem)",
                          PATH, default_doc="$SHOAL_HOME/store", derived=lambda v: Path(v["home"]) / "store")
    config: Path | None = setting(None, "paths", "the settings file (TOML; /dev/null: none)", _optional(PATH),
                                  default_doc=f"{DEFAULT_CONFIG_FILE} if it exists", in_file=False)
    agent_bin: Path | None = setting(None, "paths", "the in-sandbox agent binary", _optional(PATH),
                                     default_doc="build/shoal-agent, else /usr/local/lib/shoal/shoal-agent")
    # ---- node
    node_id: str = setting("n0", "node", "node name, the prefix of its sandbox IDs",
                           text(r"[a-z0-9][a-z0-9-]{0,31}", "1-32 characters of a-z, 0-9 and -"))
    runtime: str = setting("auto", "node", "preferred container runtime", choice("auto", *RUNTIMES))
    warm_pool: dict[str, int] = setting({}, "node", "sandboxes kept ready per image, handed out by create",
                                        WARM_POOL, default_doc="none")
    reclaim: bool = setting(True, "node", "reclaim a paused sandbox's memory (page cache; anonymous memory "
                            "when swap is on)", BOOL)
    prefetch: bool = setting(True, "node", "record the working set at pause, read it back before the thaw", BOOL)
    zram_swap: str = setting("auto", "node", "compressed swap in RAM (zram) the node sets up when it starts and "
                             "the host has no swap: auto = half the RAM, at most 8G; a size; off = leave swap "
                             "alone (pause then reclaims page cache only; shoal.backends.container.swap)", ZRAM_SWAP)
    sandbox_swap: str = setting("auto", "node", "swap a running container may use: auto = as much as its "
                                "memory, 0 = none, or a size", SWAP_POLICY)
    swap_demote: bool = setting(True, "node", "a sandbox swapping past its memory limit runs as cpu_class batch "
                                "until it is back under it (shoal.backends.container.swapwatch)", BOOL)
    agent_idle_s: float = setting(20.0, "node", "an agent connection unused this long is closed, and reopened by "
                                  "the next request (s; 0 = keep them): idle sandboxes hold no descriptor",
                                  number(0))
    sandbox_tmpfs: bool = setting(True, "node", "container sandbox directories live on a tmpfs", BOOL)
    disk_limits: bool = setting(True, "node", "per-sandbox disk limits (btrfs qgroups on the upper pool)", BOOL)
    upper_pool_gb: int = setting(0, "node", "size of the upper pool (GiB); 0 = half the free disk, 2-1024",
                                 integer(0))
    sealed_runtime: bool = setting(True, "node", "run the OCI runtime from a sealed in-memory copy", BOOL)
    mntns: bool = setting(True, "node", "start containers through the mount-namespace helper (C, built once)",
                          BOOL)
    sh: bool = setting(False, "node", "string commands always run with /bin/sh -c (default: /bin/bash where the image "
                                   "has it, else /bin/sh)", BOOL)
    events: bool = setting(True, "node", "keep the node's event log ($SHOAL_HOME/events: created, paused, resumed, "
                           "oom, timeout, lost, closed; read by `shoal events`, the SDK and the dashboard)", BOOL)
    events_commands: bool = setting(True, "node", "also log every finished command (cut to 300 characters) with "
                                    "its exit code and duration (the dashboard's recent commands)", BOOL)
    events_max_mb: int = setting(64, "node", "an event log file is rotated past this size (MiB; one older file "
                                 "is kept)", integer(1))
    # ---- admission
    memory_overcommit: float = setting(1000.0, "admission", "commitment policy: refuse creates when the memory "
                                       "promised to sandboxes (their memory_mb) passes this multiple of RAM; the "
                                       "default leaves it to measured use, 4 or 1 tighten it",
                                       number(0, lo_open=True))
    min_free_mb: int = setting(512, "admission", "watermark: refuse creates (after pausing idle sandboxes) when "
                               "available memory minus what creates in flight are expected to take would fall "
                               "below this (MiB)", integer(0))
    admission_psi_full: float = setting(20.0, "admission", "refuse creates while all tasks were stalled on memory "
                                        "more than this % of the last 10 s (PSI full avg10) and under half the RAM is "
                                        "available; 0 = ignore PSI",
                                        number(0, 100))
    host_reserve_mb: int = setting(0, "admission", "memory the sandboxes' parent cgroup leaves to the host and the "
                                   "node agent (MiB); 0 = 1/16 of RAM, 1-8 GiB", integer(0))
    node_oom_score_adj: int = setting(-1000, "admission", "OOM score the node agent gives itself (-1000 = never "
                                      "killed; needs CAP_SYS_RESOURCE)", integer(-1000, 1000))
    node_memory_min_mb: int = setting(256, "admission", "cgroup v2: memory.min of the node agent's own cgroup "
                                      "(MiB; 0 = none)", integer(0))
    disk_overcommit: float = setting(0.0, "admission", "refuse creates when the disk_mb promised to a node's "
                                     "sandboxes would exceed this multiple of its upper pool (1.0: every sandbox "
                                     "can always write its whole disk_mb)", number(0), default_doc="0 (not checked)")
    disk_reserve_mb: int = setting(0, "admission", "free space of the upper pool kept for sandboxes that write "
                                   "little: under it creates are refused and the biggest writer is clamped (MiB)",
                                   integer(0), default_doc="5% of the pool, at least 256")
    # ---- network
    net_leases: Path = setting(Path("/run/shoal/net-leases"), "network", "address leases of sandbox networks "
                               "(host-wide: every node on the host shares one bridge)", PATH)
    egress_sets: dict[str, list[str]] = setting({}, "network", "named sets of egress rules for network=[...], "
                                                "added to (or replacing) pypi, npm, debian, github",
                                                EGRESS_SETS, default_doc="the built-in four")
    egress_allow: tuple[str, ...] = setting((), "network", "protected destinations every sandbox of this node may "
                                            "reach: private, metadata, reserved, cluster, or CIDR[:port] "
                                            "(projects get more with `shoal token policy`)", EGRESS_GRANTS,
                                            default_doc="none", empty_is_value=True)
    egress_deny: tuple[str, ...] = setting((), "network", "more addresses no sandbox reaches unless granted, like "
                                           "the cluster's own nodes (the Ray nodes are added by themselves): "
                                           "CIDR,…", NETWORKS, default_doc="none", empty_is_value=True)
    dns_upstream: str | None = setting(None, "network", "resolver the DNS proxy of allowlist sandboxes asks "
                                       "(host[:port])", _optional(text(r"[0-9.]+(:[0-9]{1,5})?", "an IPv4 address "
                                                                        "with an optional :port")),
                                       default_doc="the host's first nameserver")
    # ---- vm
    vm_accel: str = setting("auto", "vm", "auto = KVM when a guest really runs under it, tcg = software "
                            "emulation", choice("auto", "tcg"))
    vm_boot_timeout: float | None = setting(None, "vm", "seconds create waits for a guest's agent",
                                            _optional(number(0, lo_open=True)),
                                            default_doc="microVM 30 (KVM) / 90 (TCG); VM 90 / 300")
    vm_tcg_tb_mb: int = setting(128, "vm", "TCG translation cache per VM (MiB)", integer(1))
    vm_verbose: bool = setting(False, "vm", "full guest kernel log and traced init on the console", BOOL)
    vm_extra_cmdline: str = setting("", "vm", "appended to the guest kernel command line", text())
    vm_kernel_version: str | None = setting(None, "vm", "which installed kernel microVMs boot (e.g. 6.1.0-28-amd64)",
                                            _optional(text()), default_doc="newest with modules")
    vm_pause_balloon_mb: int | None = setting(None, "vm", "balloon target at pause when the guest cannot be asked "
                                              "(MiB)", _optional(integer(1)), default_doc="memory / 8")
    vm_balloon_wait_s: float = setting(2.0, "vm", "longest wait for the balloon at pause (s)", number(0))
    vm_snapshot_timeout: float = setting(600.0, "vm", "longest memory save or restore of a VM snapshot (s)",
                                         number(0, lo_open=True))
    vm_seccomp: bool = setting(True, "vm", "confine QEMU with its seccomp sandbox", BOOL)
    vm_ksm: bool = setting(True, "vm", "guest RAM is private and mergeable and the node turns KSM on: identical "
                           "pages of VMs are stored once (off: guest RAM in a memfd, never merged)", BOOL)
    vmm: str = setting("auto", "vm", "microVM monitor: auto = Firecracker when usable, else QEMU",
                       choice("auto", *VMMS))
    qemu: Path | None = setting(None, "vm", "the qemu-system-x86_64 binary", _optional(PATH),
                                default_doc="on PATH")
    firecracker: Path | None = setting(None, "vm", "the firecracker binary", _optional(PATH), default_doc="on PATH")
    guest_src: Path | None = setting(None, "vm", "the guest/ directory microVM initramfs builds read",
                                     _optional(PATH), default_doc="the repository's guest/")
    busybox: Path | None = setting(None, "vm", "a static busybox for the guest initramfs", _optional(PATH),
                                   default_doc="/bin/busybox")
    kvm_cache: Path = setting(Path("/run/shoal/kvm-status.json"), "vm", "where the KVM probe's verdict is cached "
                              "(per boot)", PATH)
    # ---- fncall
    fncall_min_idle: int = setting(2, "fncall", "ready workers kept per pool while it is in use", integer(0))
    fncall_max_size: int | None = setting(None, "fncall", "most containers per pool", _optional(integer(1)),
                                          default_doc="4 per core, at least 4")
    fncall_preload: tuple[str, ...] | None = setting(None, "fncall", "modules the zygote imports (empty: none)",
                                                     _optional(MODULES), default_doc="a standard-library set",
                                                     empty_is_value=True)
    # ---- api
    api_host: str = setting("127.0.0.1", "api", "address `shoal serve` binds", text())
    api_port: int = setting(8700, "api", "TCP port `shoal serve` listens on", integer(0, 65535))
    api_max_request_bytes: int = setting(8 << 20, "api", "largest JSON request body (exec stdin travels in it)",
                                         integer(1), default_doc="8 MiB")
    api_max_upload_bytes: int = setting(64 << 20, "api", "largest file upload", integer(1), default_doc="64 MiB")
    api_max_uploads: int = setting(4, "api", "SWE-ReX uploads of one token written into sandboxes at once (each "
                                   "holds one 256 KiB chunk in the server; more wait)", integer(1, 1024))
    api_max_import_bytes: int = setting(16 << 30, "api", "largest image tarball upload", integer(1),
                                        default_doc="16 GiB")
    api_header_timeout: float = setting(10.0, "api", "seconds a client may take to send its request headers",
                                        number(0, lo_open=True))
    api_body_idle_timeout: float = setting(15.0, "api", "seconds a request body may pause (then 408)",
                                           number(0, lo_open=True))
    api_body_timeout: float = setting(120.0, "api", "seconds a whole request body may take (image uploads "
                                      "excepted)", number(0, lo_open=True))
    api_send_timeout: float = setting(60.0, "api", "seconds one response write may wait for a client that "
                                      "does not read", number(0, lo_open=True))
    api_max_inflight: int = setting(1024, "api", "requests (and streams) in progress per token", integer(1))
    api_max_queued: int = setting(4096, "api", "requests per token waiting for a slot; beyond: 429", integer(0))
    api_create_concurrency: int = setting(32, "api", "sandboxes the server creates at once (others queue)", integer(1))
    api_max_batch: int = setting(MAX_HTTP_BATCH, "api", "largest n of one batch create or fork",
                                 integer(1, MAX_HTTP_BATCH))
    api_allowed_hosts: tuple[str, ...] = setting((), "api", "host names a server without tokens answers to besides "
                                                 "IP addresses and localhost (`*.example.lan` for every name under "
                                                 "it; guards against DNS rebinding)", NAMES_OR_EMPTY,
                                                 default_doc="none", empty_is_value=True)
    api_log_level: str = setting("warning", "api", "uvicorn log level",
                                 choice("critical", "error", "warning", "info", "debug", "trace"))
    e2b_templates: dict[str, str] = setting({}, "api", "E2B template IDs mapped to shoal images (E2B-compatible "
                                            "API): TEMPLATE=IMAGE[,TEMPLATE=IMAGE...]", TEMPLATE_MAP)
    e2b_default_image: str = setting("base", "api", "the image E2B's stock templates (base, code-interpreter-v1, "
                                     "...) map to", text())
    e2b_network: bool = setting(False, "api", "E2B sandboxes that do not set allow_internet_access get a network",
                                BOOL)
    e2b_public_ports: bool = setting(False, "api", "requests to a sandbox's ports (E2B get_host) need no "
                                     "e2b-traffic-access-token even when the server needs tokens", BOOL)
    # ---- images
    erofs_mount: str = setting("auto", "images", "how EROFS layers mount: file-backed, through a loop device, "
                               "or auto", choice("auto", "file", "loop"))
    erofs_directio: bool = setting(True, "images", "file-backed EROFS mounts use direct I/O (when the kernel "
                                   "has it)", BOOL)
    debian_mirror: str = setting("http://deb.debian.org/debian", "images", "Debian mirror for base image builds",
                                 text(r"(https?|file)://\S+", "an http(s):// or file:// URL"))
    lease_heartbeat_s: float = setting(60.0, "images", "how often a node agent renews its layer leases in the store "
                                       "(seconds)", number(0, lo_open=True))
    lease_ttl_s: float = setting(900.0, "images", "a lease not renewed for this long belongs to a dead node: gc "
                                 "ignores it (seconds)", number(0, lo_open=True))
    chunk_cache_mb: int = setting(8192, "images", "node-local cache of verified layer chunks, in MiB (LRU; kept "
                                  "across restarts of the node)", integer(64))
    chunk_readahead_kb: int = setting(128, "images", "a read that fetches a layer chunk also fetches the next chunks "
                                      "up to this many KiB, in the background", integer(0, 65536))
    store_probe_timeout_s: float = setting(3.0, "images", "creates fail with store_unavailable when the store does "
                                           "not answer a probe within this (seconds)", number(0, lo_open=True))
    pull_policy: str = setting("missing", "images", "when a create or a Dockerfile FROM pulls its image from a "
                               "registry: missing = when not in the store, always = check the registry every time "
                               "(images made in shoal are never replaced), never = only the store",
                               choice("missing", "always", "never"))
    registry_mirrors: dict[str, list[str]] = setting({}, "images", "mirrors asked before a registry, like "
                                                     "containerd's: REGISTRY=URL pairs (`docker.io=http://127.0.0.1:"
                                                     "5000 ghcr.io=https://m.example`); plain HTTP only where the URL "
                                                     "says http://", MIRRORS, default_doc="none")
    registry_fallback: bool = setting(True, "images", "after its mirrors, ask the registry itself (false: only the "
                                      "mirrors, e.g. on a machine without internet)", BOOL)
    registry_insecure: tuple[str, ...] = setting((), "images", "registries reached over plain HTTP when HTTPS fails "
                                                 "(loopback hosts always are, as in Docker)", HOSTS, default_doc="none")
    registry_auth_file: Path | None = setting(None, "images", "Docker's credentials file (`docker login` writes it)",
                                              _optional(PATH), default_doc="$DOCKER_CONFIG/config.json, else "
                                              "~/.docker/config.json")
    pull_concurrency: int = setting(3, "images", "layers one pull downloads at once", integer(1, 32))
    pull_retries: int = setting(5, "images", "attempts per registry request (a broken download resumes where it "
                                "stopped)", integer(1, 50))
    pull_timeout_s: float = setting(3600.0, "images", "longest a whole pull may take (s); waiters for another node's "
                                    "pull wait as long", number(0, lo_open=True))
    # ---- rl
    rl_tasks: str | None = setting(None, "rl", "tasks file or directory the trainer adapters look task ids up in",
                                   _optional(text()), default_doc="none")
    # ---- sched
    priorities: tuple[str, ...] = setting(("train-rollout", "eval", "interactive", "batch"), "sched",
                                          "priority classes, most important first (label shoal.priority)", NAMES,
                                          default_doc="train-rollout,eval,interactive,batch")
    default_priority: str = setting("interactive", "sched", "class of a sandbox whose labels name none", text())
    preempt: bool = setting(True, "sched", "a create that does not fit pauses idle sandboxes of lower classes "
                            "(they resume on their next call)", BOOL)
    preempt_across_projects: bool = setting(False, "sched", "a create may pause idle lower-class sandboxes of "
                                            "other projects too (off: only its own project's); which classes a "
                                            "project may use is its grant (`shoal token policy`)", BOOL)
    preempt_idle_s: float = setting(60.0, "sched", "only sandboxes idle this long are paused for a higher class (s)",
                                    number(0))
    tides: bool = setting(True, "sched", "pause sandboxes idle over tide_idle_s while the host's memory is tight "
                          "(they resume on their next call)", BOOL)
    tide_high: float = setting(0.85, "sched", "memory is tight when this fraction of RAM is in use",
                               number(0, 1, lo_open=True))
    tide_low: float = setting(0.75, "sched", "tides pause idle sandboxes until use is back under this fraction",
                              number(0, 1, lo_open=True))
    tide_idle_s: float = setting(300.0, "sched", "tides only pause sandboxes idle this long (s)", number(0))
    tide_interval_s: float = setting(2.0, "sched", "how often the node checks its memory for tides (s; a pass "
                                     "runs only when memory is tight)", number(0, lo_open=True))
    pressure_idle_s: float = setting(30.0, "sched", "before refusing a create for memory, the node pauses and "
                                     "reclaims sandboxes idle this long (s)", number(0))
    trace_file: Path | None = setting(None, "sched", "append the node's sandbox events (create, close, pause, "
                                      "resume) to this JSONL file, replayable by `shoal sim --trace`",
                                      _optional(PATH), default_doc="none")
    # ---- client
    url: str | None = setting(None, "client", "API server the CLI talks to (else an embedded node)",
                              _optional(text(r"(https?|ray)://\S+", "an http(s):// or ray:// URL")),
                              default_doc="embedded node")
    token: str | None = setting(None, "client", "API token the CLI sends", _optional(text()), secret=True,
                                default_doc="none")
    # ---- bench
    sandboxfusion_dir: Path | None = setting(None, "bench", "a SandboxFusion checkout to compare fncall with",
                                             _optional(PATH), default_doc="not compared")
    sandboxfusion_url: str | None = setting(None, "bench", "a running SandboxFusion server to compare fncall with",
                                            _optional(text(r"https?://\S+", "an http(s):// URL")),
                                            default_doc="not compared")
    # ---- dev
    test_store: Path | None = setting(None, "dev", "the layer store the test suite uses", _optional(PATH),
                                      default_doc="/var/lib/shoal/store")
    fake_backend: bool = setting(False, "dev", "allow backend=\"fake\": NO isolation (plain processes of this "
                                 "user), for unit tests only", BOOL)
    fault: str | None = setting(None, "dev", "crash the node (SIGKILL) at these steps of create and close: "
                                "step[,step…], a glob (close.*) or random:P (shoal.faults; tests, soaks)",
                                _optional(text(r"(random:(0(\.[0-9]+)?|1(\.0+)?)|[a-z.*?,]+)",
                                               "steps like create.mount,close.*, or random:P with 0 <= P <= 1")),
                                default_doc="never")

    #: where each value came from: "default", "file <path>", "env" or "argument" (not a setting)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    #: the config file that was read, if any (not a setting)
    file: Path | None = field(default=None, compare=False, repr=False)

    @classmethod
    def specs(cls) -> dict[str, tuple["dataclasses.Field[Any]", Meta]]:
        """Field name → (field, Meta) of every setting, in declaration order."""
        return _specs()

    @staticmethod
    def env_name(name: str) -> str:
        """The environment variable of a setting: `memory_overcommit` → `SHOAL_MEMORY_OVERCOMMIT`."""
        return PREFIX + name.upper()

    @classmethod
    def load(cls, args: Mapping[str, object] | None = None, *, env: Mapping[str, str] | None = None,
             file: str | Path | None = None, warn: Callable[[str], None] | None = None) -> "Settings":
        """Resolve every setting: defaults < config file < environment < `args` (None values are ignored).

        `env` defaults to os.environ; `file` overrides SHOAL_CONFIG; unknown SHOAL_* variables are passed to
        `warn` (default: an UnknownSettingWarning). Raises InvalidSetting for any bad value.
        """
        environ: Mapping[str, str] = os.environ if env is None else env
        specs = cls.specs()
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        # the file's location comes from the environment (or an argument), never from the file itself
        cfg_raw: object = file if file is not None else environ.get(PREFIX + "CONFIG") or None
        cfg_source = "argument" if file is not None else "env"
        config = cls._convert("config", cfg_raw, cfg_source) if cfg_raw is not None else None
        if config is not None:
            values["config"], sources["config"] = config, cfg_source
        path = config if config is not None else (DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None)
        if path is not None:
            for key, raw in _read_toml(Path(path)).items():
                if key not in specs or not specs[key][1].in_file:
                    raise InvalidSetting(f"{path}: {key!r} is not a setting{_did_you_mean(key, _file_keys())} "
                                         "(keys are setting names in lower case without SHOAL_; "
                                         "`shoal config` lists them)")
                values[key], sources[key] = cls._convert(key, raw, f"file {path}"), f"file {path}"
        unknown = []
        for var, raw in environ.items():
            if not var.startswith(PREFIX) or var == PREFIX + "CONFIG":
                continue
            key = var[len(PREFIX):].lower()
            if key not in specs:
                if var not in CHILD_VARIABLES:
                    unknown.append(var)
                continue
            if raw == "" and not specs[key][1].empty_is_value:
                continue  # an empty variable means "unset", as it always did
            values[key], sources[key] = cls._convert(key, raw, "env"), "env"
        for key, raw in (args or {}).items():
            if key not in specs:
                raise InvalidSetting(f"{key!r} is not a setting{_did_you_mean(key, list(specs))}")
            if raw is not None:
                values[key], sources[key] = cls._convert(key, raw, "argument"), "argument"
        for key, (_f, meta) in specs.items():
            if key not in values:
                sources[key] = "default"
                if meta.derived is not None:
                    values[key] = meta.derived({**_defaults(), **values})
        for var in sorted(unknown):
            msg = (f"{var} is set but is not a shoal setting, so it does nothing"
                   f"{_did_you_mean(var, [cls.env_name(k) for k in specs])} (`shoal config` lists the settings)")
            if warn is not None:
                warn(msg)
            else:
                warnings.warn(msg, UnknownSettingWarning, stacklevel=2)
        return cls(**values, sources=sources, file=Path(path) if path is not None else None)

    @classmethod
    def _convert(cls, key: str, raw: object, source: str) -> Any:
        meta = cls.specs()[key][1]
        try:
            return meta.conv(raw.strip() if isinstance(raw, str) and not meta.empty_is_value else raw)
        except ValueError as e:
            where = "" if source == "argument" else f" (from {source})"
            shown = "****" if meta.secret else repr(raw)
            raise InvalidSetting(f"invalid setting {cls.env_name(key)}={shown}{where}: {e}",
                                 setting=cls.env_name(key), source=source) from None

    def replace(self, **changes: object) -> "Settings":
        """A copy with some settings given explicitly (checked like any value; source "argument")."""
        specs = self.specs()
        new: dict[str, Any] = {}
        for key, raw in changes.items():
            if key not in specs:
                raise InvalidSetting(f"{key!r} is not a setting{_did_you_mean(key, list(specs))}")
            new[key] = self._convert(key, raw, "argument")
        return dataclasses.replace(self, **new, sources={**self.sources, **dict.fromkeys(new, "argument")})

    # ---- reading
    def source(self, name: str) -> str:
        """Where a setting's value came from: "default", "file <path>", "env" or "argument"."""
        return self.sources.get(name, "default")

    def is_set(self, name: str) -> bool:
        """True when a setting was given (file, environment or argument), not defaulted."""
        return self.source(name) != "default"

    def paths(self) -> "Paths":
        """The node's filesystem layout."""
        return Paths(home=self.home, store=self.store)

    def rows(self, group: str | None = None, changed: bool = False) -> list[dict[str, Any]]:
        """One plain-data row per setting (for `shoal config`): name, key, group, value, default, source, doc."""
        out = []
        defaults = _defaults()
        for key, (_f, meta) in self.specs().items():
            if group is not None and meta.group != group:
                continue
            if changed and not self.is_set(key):
                continue
            value = getattr(self, key)
            shown = _plain(value)
            if meta.secret and value is not None:
                shown = "****"
            out.append({"name": self.env_name(key), "key": key, "group": meta.group, "value": shown,
                        "default": meta.default_doc if meta.default_doc is not None else _plain(defaults[key]),
                        "source": self.source(key), "type": meta.conv.kind, "doc": meta.doc})
        return out


_SPECS: dict[str, tuple["dataclasses.Field[Any]", Meta]] = {}


def _specs() -> dict[str, tuple["dataclasses.Field[Any]", Meta]]:
    if not _SPECS:
        _SPECS.update({f.name: (f, f.metadata["shoal"]) for f in fields(Settings) if "shoal" in f.metadata})
    return _SPECS


def _defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, (f, _meta) in _specs().items():
        out[key] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def _file_keys() -> list[str]:
    return [k for k, (_f, m) in _specs().items() if m.in_file]


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def _read_toml(path: Path) -> dict[str, Any]:
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise InvalidSetting(f"config file {path} does not exist (SHOAL_CONFIG names it; unset SHOAL_CONFIG or "
                             "create the file)") from None
    except OSError as e:
        raise InvalidSetting(f"config file {path} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidSetting(f"config file {path} is not valid TOML: {e}") from None
    return data


def _plain(value: object) -> object:
    """A JSON-friendly form of a setting's value."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def show(value: object) -> str:
    """A setting's value as you would write it in the environment (for tables)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, dict):
        return ",".join(f"{k}={n}" for k, n in value.items())
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def markdown() -> str:
    """The docs table of every setting (defaults only, so it is the same on every machine)."""
    lines: list[str] = []
    rows = Settings().rows()
    documented = {k for k, (_f, m) in _specs().items() if m.default_doc is not None}
    for group, what in GROUPS.items():
        mine = [r for r in rows if r["group"] == group]
        if not mine:
            continue
        lines += [f"### {group}", "", what[0].upper() + what[1:] + ".", "",
                  "| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
        for r in mine:
            d = r["default"]
            cell = d if r["key"] in documented else f"`{show(d)}`" if show(d) else ""
            kind = r["type"].replace("|", "\\|")  # a bare | would end the table cell
            lines.append(f"| `{r['name']}` | {kind} | {cell} | {r['doc']} |")
        lines.append("")
    lines += ["### set by shoal for the processes it starts", "",
              "Not settings: shoal never reads them, but their presence draws no warning.", "",
              "| variable | meaning |", "| --- | --- |"]
    lines += [f"| `{k}` | {v} |" for k, v in CHILD_VARIABLES.items()]
    return "\n".join(lines) + "\n"


DOCS_BEGIN = "<!-- BEGIN SETTINGS TABLE: generated by `shoal config --markdown`, do not edit -->"
DOCS_END = "<!-- END SETTINGS TABLE -->"


def update_docs(path: str | Path) -> bool:
    """Rewrite the generated table between the markers of `path`; True when the file changed."""
    p = Path(path)
    text = p.read_text()
    start, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if start < 0 or end < start:
        raise InvalidRequest(f"{p} has no {DOCS_BEGIN!r} ... {DOCS_END!r} markers")
    new = text[: start + len(DOCS_BEGIN)] + "\n\n" + markdown() + "\n" + text[end:]
    if new != text:
        p.write_text(new)
    return new != text


# ---- the process's settings -------------------------------------------------------------------------
_cache: tuple[object, Settings] | None = None
_PREFIX_B = PREFIX.encode()


def _env_key() -> object:
    # called on every settings() (some are per create): os.environ's undecoded bytes dict, where CPython has
    # it, is ~10x cheaper to scan than decoding every variable through os.environ.items()
    raw = getattr(os.environ, "_data", None)
    if isinstance(raw, dict):
        return [(k, v) for k, v in raw.items() if isinstance(k, bytes) and k.startswith(_PREFIX_B)]
    return [(k, v) for k, v in os.environ.items() if k.startswith(PREFIX)]


#: the settings an edge resolved for this whole process (see use()); None: read the environment
_pinned: Settings | None = None


def use(s: Settings | None) -> Settings | None:
    """Make `s` this process's settings: `settings()` returns it from now on, whatever the environment says
    (an edge that resolved the settings from something other than os.environ — a cluster agent's arguments,
    a bench run's store — injects them this way instead of writing os.environ). None goes back to reading
    the environment. Returns the settings pinned before (to restore them)."""
    global _pinned
    prev, _pinned = _pinned, s
    return prev


def pinned() -> Settings | None:
    """The settings an edge pinned with use() (None: settings() reads the environment)."""
    return _pinned


def settings() -> Settings:
    """This process's settings (defaults < file < environment), loaded on first use and again whenever the
    SHOAL_* environment changes (tests set variables), or the ones an edge pinned with use(). Code given a
    Settings object (a node's config, a backend's context) uses that instead."""
    global _cache
    if _pinned is not None:
        return _pinned
    key = _env_key()
    cached = _cache
    if cached is not None and cached[0] == key:
        return cached[1]
    s = Settings.load()
    _cache = (key, s)
    return s


def reset() -> None:
    """Forget the cached settings (the next `settings()` reads the file and the environment again)."""
    global _cache
    _cache = None


# ---- the node's layout and knobs (explicit arguments on top of the settings) --------------------------
@dataclass
class Paths:
    """Filesystem layout of one node. `store` may be a shared filesystem; everything else is local."""

    home: Path
    store: Path

    @classmethod
    def from_env(cls, home: str | Path | None = None, store: str | Path | None = None) -> "Paths":
        """`home`/`store` when given, else SHOAL_HOME (default /var/lib/shoal) and SHOAL_STORE (default
        `<home>/store`) from the settings."""
        if home and store:
            return cls(home=Path(home), store=Path(store))
        s = settings()
        h = Path(home) if home else s.home
        st = Path(store) if store else s.store if s.is_set("store") else h / "store"
        return cls(home=h, store=st)

    @property
    def sandboxes(self) -> Path:
        """One directory per sandbox: record, bundle, upper layer, agent socket."""
        return self.home / "sandboxes"

    @property
    def layer_mounts(self) -> Path:
        """Host-local mountpoints of EROFS layers, one per layer, shared by all sandboxes."""
        return self.home / "layers"

    @property
    def locks(self) -> Path:
        """Host-local lock files (flock)."""
        return self.home / "locks"

    @property
    def run(self) -> Path:
        """Host-local runtime scratch (runtime state root, probes)."""
        return self.home / "run"


#: a NodeConfig field left at this default takes its value from the config's Settings (see NODE_SETTINGS)
FROM_SETTINGS: Any = type("FromSettings", (), {"__repr__": lambda self: "FROM_SETTINGS"})()

#: NodeConfig field -> the setting it is derived from (one table: the only place the two names meet)
NODE_SETTINGS: dict[str, str] = {
    "node_id": "node_id", "runtime": "runtime", "memory_overcommit": "memory_overcommit",
    "min_free_memory_mb": "min_free_mb", "admission_psi_full": "admission_psi_full",
    "host_reserve_mb": "host_reserve_mb", "node_oom_score_adj": "node_oom_score_adj",
    "node_memory_min_mb": "node_memory_min_mb", "reclaim_on_pause": "reclaim", "prefetch_on_resume": "prefetch",
    "zram_swap": "zram_swap", "agent_idle_s": "agent_idle_s", "warm_pool": "warm_pool", "posix_sh": "sh",
    "fake_backend": "fake_backend",
}


@dataclass
class NodeConfig:
    """Tunables of a node agent, derived from one resolved `Settings` (`settings`) plus explicit overrides.

    The edge that makes a node (CLI, server, cluster agent, bench, a test) resolves the settings once and
    passes them here; the node and its backends read `config.settings` and never the environment. Without
    `settings` the process's settings at the time the config is made are used. Fields named in
    NODE_SETTINGS default to their setting; the others are node-internal knobs."""

    #: every setting, resolved once at the edge (node/ and backends/ read this, never `settings()`)
    settings: Settings = field(default_factory=lambda: settings())
    paths: Paths = FROM_SETTINGS
    #: node name encoded in sandbox IDs (short, [a-z0-9-])
    node_id: str = FROM_SETTINGS
    #: preferred container runtime: "auto" | "crun" | "runc" | "gvisor"
    runtime: str = FROM_SETTINGS
    #: max sandboxes created at once by one create_many (bounded parallelism)
    create_concurrency: int = 32
    #: refuse new sandboxes when committed memory exceeds this multiple of host RAM
    memory_overcommit: float = FROM_SETTINGS
    #: refuse new sandboxes when the host's available memory would fall below this (MiB)
    min_free_memory_mb: int = FROM_SETTINGS
    #: refuse new sandboxes while PSI memory full avg10 is above this (percent; 0 = ignore PSI)
    admission_psi_full: float = FROM_SETTINGS
    #: memory kept out of the sandboxes' parent cgroup for the host and the node (MiB; 0 = auto)
    host_reserve_mb: int = FROM_SETTINGS
    #: the node agent's own OOM score (None: leave it); see shoal.node.protect
    node_oom_score_adj: int | None = FROM_SETTINGS
    #: cgroup v2: memory.min of the node agent's own cgroup (MiB)
    node_memory_min_mb: int = FROM_SETTINGS
    #: protect the host at start (sandboxes' parent cgroup limit, OOM scores); off for unit tests' fake nodes
    protect_host: bool = True
    #: how often the reaper looks for expired or dead sandboxes (seconds)
    reap_interval_s: float = 2.0
    #: largest file read_file returns in one call (bytes)
    max_file_bytes: int = 256 << 20
    #: reclaim a sandbox's memory after pausing it (page cache always; anonymous memory when swap is on)
    reclaim_on_pause: bool = FROM_SETTINGS
    #: record the working set at pause and read it back before the thaw (faster first request)
    prefetch_on_resume: bool = FROM_SETTINGS
    #: compressed swap in RAM (zram) set up when the node starts and the host has none: "auto" (half the RAM,
    #: at most 8 GiB), a size such as "8G", or "off"/None (leave swap alone); see shoal.backends.container.swap
    zram_swap: str | None = FROM_SETTINGS
    #: close an agent connection unused this long (s; 0 = never): see shoal.node.connections
    agent_idle_s: float = FROM_SETTINGS
    #: sandboxes kept ready per image from the start ({"base": 16}); Node.pool.configure changes it later
    warm_pool: dict[str, int] = FROM_SETTINGS
    #: string commands run with /bin/sh -c instead of /bin/bash -c (images without bash)
    posix_sh: bool = FROM_SETTINGS
    #: allow the "fake" backend (NO isolation: sandboxes are plain processes of this user; unit tests only)
    fake_backend: bool = FROM_SETTINGS

    def __post_init__(self) -> None:
        if self.paths is FROM_SETTINGS:
            self.paths = self.settings.paths()
        for name, key in NODE_SETTINGS.items():
            if getattr(self, name) is FROM_SETTINGS:
                value = getattr(self.settings, key)
                setattr(self, name, dict(value) if isinstance(value, Mapping) else value)

    @classmethod
    def from_settings(cls, s: Settings, **overrides: Any) -> "NodeConfig":
        """A NodeConfig whose fields come from `s` (keyword arguments win)."""
        return cls(settings=s, **overrides)
