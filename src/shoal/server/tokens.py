"""API tokens and projects, stored hashed under $SHOAL_HOME/api/tokens.json.

A token reads `shoal_<id>_<secret>`: the id finds the entry, the secret is checked against its sha256
(the secret has 256 random bits, so a fast hash is enough — there is nothing to brute-force). The
plain token is shown once, at creation. Quotas belong to the project; every token of a project shares
them. The file is rewritten atomically under a lock, so `shoal token create/rm` works while a server
runs; the server sees the change at its next request.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import InvalidRequest, ShoalError
from shoal.fsutil import atomic_write, flocked

PROJECT_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
TOKEN_RE = re.compile(r"^shoal_([a-z2-7]{10})_([A-Za-z0-9_-]{43})$")
DEFAULT_PROJECT = "default"
_B32 = "abcdefghijklmnopqrstuvwxyz234567"


class TokenNotFound(ShoalError, LookupError):
    """No token with this id."""

    http_status = 404
    code = "token_not_found"


def check_project(project: str) -> str:
    """Project names are short lowercase DNS-like labels (they prefix the project's image names)."""
    if not isinstance(project, str) or not PROJECT_RE.match(project):
        raise InvalidRequest(f"bad project name {project!r}: use 1-63 lowercase letters, digits and '-', "
                             "starting and ending with a letter or digit")
    return project


@dataclass
class Quota:
    """Limits of one project; None means unlimited."""

    max_sandboxes: int | None = None
    max_cpus: float | None = None
    max_memory_mb: int | None = None
    #: bytes the project's images may take in the layer store (MiB; layers shared with images outside
    #: any project, like `base`, are not counted)
    max_store_mb: int | None = None

    def check(self) -> Quota:
        """Reject negative or absurd limits."""
        for name in ("max_sandboxes", "max_cpus", "max_memory_mb", "max_store_mb"):
            v = getattr(self, name)
            if v is not None and not (0 <= v <= 1 << 40):
                raise InvalidRequest(f"{name}={v!r} must be a non-negative number")
        return self

    def is_unlimited(self) -> bool:
        """True when no limit is set."""
        return self.max_sandboxes is None and self.max_cpus is None and self.max_memory_mb is None \
            and self.max_store_mb is None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Quota:
        """Build from JSON, ignoring unknown keys."""
        d = d or {}
        return cls(max_sandboxes=d.get("max_sandboxes"), max_cpus=d.get("max_cpus"),
                   max_memory_mb=d.get("max_memory_mb"), max_store_mb=d.get("max_store_mb"))


@dataclass
class ProjectPolicy:
    """What the operator lets one project's sandboxes ask for beyond the defaults (issue 23)."""

    #: protected destinations its sandboxes may reach (shoal.egress grants: private, metadata, reserved,
    #: cluster, CIDR[:port]); the node's egress_allow setting adds to it
    egress_allow: list[str] = field(default_factory=list)
    #: priority classes (label shoal.priority) it may use; None: the default class and those below it
    priorities: list[str] | None = None

    def check(self) -> ProjectPolicy:
        """Reject grants or class names that cannot be right."""
        from shoal.config import settings
        from shoal.egress import parse_grants

        parse_grants(self.egress_allow)
        if self.priorities is not None:
            known = settings().priorities
            bad = [p for p in self.priorities if p not in known]
            if bad:
                raise InvalidRequest(f"unknown priority class(es) {', '.join(bad)}: the classes are "
                                     f"{', '.join(known)} (SHOAL_PRIORITIES)")
        return self

    def is_default(self) -> bool:
        """True when nothing beyond the defaults is granted."""
        return not self.egress_allow and self.priorities is None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ProjectPolicy:
        """Build from JSON, ignoring unknown keys."""
        d = d or {}
        pr = d.get("priorities")
        return cls(egress_allow=[str(x) for x in d.get("egress_allow") or []],
                   priorities=None if pr is None else [str(x) for x in pr])


@dataclass
class TokenEntry:
    """One stored token (never the secret itself)."""

    id: str
    project: str
    sha256: str
    admin: bool = False
    name: str = ""
    created: float = field(default_factory=time.time)

    def public(self) -> dict[str, Any]:
        """What `shoal token ls` shows."""
        d = asdict(self)
        d.pop("sha256")
        return d


@dataclass(frozen=True)
class Principal:
    """Who is calling: a project (and whether it may act on every project)."""

    project: str
    admin: bool = False
    token_id: str = "-"
    quota: Quota = field(default_factory=Quota)


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class TokenStore:
    """The token file of one SHOAL_HOME."""

    def __init__(self, home: str | Path) -> None:
        self.dir = Path(home) / "api"
        self.path = self.dir / "tokens.json"
        self._cache: tuple[tuple[int, int, int], dict[str, Any]] | None = None

    # ---- reading ------------------------------------------------------------------------------
    def _read(self) -> dict[str, Any]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._cache = None
            return {"tokens": {}, "projects": {}, "policies": {}}
        key = (st.st_mtime_ns, st.st_ino, st.st_size)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        with open(self.path, "rb") as f:
            data = json.loads(f.read() or b"{}")
        data.setdefault("tokens", {})
        data.setdefault("projects", {})
        data.setdefault("policies", {})
        self._cache = (key, data)
        return data

    def _data(self) -> dict[str, Any]:
        # one stat per request (~1 µs): a revoked token stops working at once
        return self._read()

    def has_tokens(self) -> bool:
        """True when at least one token exists (then the server requires one)."""
        return bool(self._data()["tokens"])

    def tokens(self) -> list[TokenEntry]:
        """Every stored token, oldest first."""
        data = self._read()
        out = [TokenEntry(**{k: v for k, v in t.items() if k in TokenEntry.__dataclass_fields__})
               for t in data["tokens"].values()]
        return sorted(out, key=lambda t: t.created)

    def quota(self, project: str) -> Quota:
        """The quota of a project (unlimited when none was set)."""
        return Quota.from_dict(self._data()["projects"].get(project))

    def policy(self, project: str) -> ProjectPolicy:
        """What the operator grants a project beyond the defaults (egress, priority classes)."""
        return ProjectPolicy.from_dict(self._data()["policies"].get(project))

    def policies(self) -> dict[str, ProjectPolicy]:
        """Every project with a policy entry."""
        return {p: ProjectPolicy.from_dict(d) for p, d in self._read()["policies"].items()}

    def projects(self) -> dict[str, Quota]:
        """Every project with a quota entry."""
        return {p: Quota.from_dict(q) for p, q in self._read()["projects"].items()}

    def entry(self, token_id: str) -> TokenEntry | None:
        """The stored token with this id, None when it does not exist (or was revoked)."""
        t = self._data()["tokens"].get(token_id)
        if t is None:
            return None
        return TokenEntry(**{k: v for k, v in t.items() if k in TokenEntry.__dataclass_fields__})

    def authenticate(self, token: str) -> Principal | None:
        """The principal of a presented token, or None when it is unknown or wrong."""
        m = TOKEN_RE.match(token or "")
        if not m:
            return None
        data = self._data()
        entry = data["tokens"].get(m.group(1))
        if entry is None or not hmac.compare_digest(entry.get("sha256", ""), _hash(m.group(2))):
            return None
        project = entry["project"]
        return Principal(project=project, admin=bool(entry.get("admin")), token_id=m.group(1),
                         quota=Quota.from_dict(data["projects"].get(project)))

    # ---- writing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        with flocked(self.dir / "tokens.lock"):
            self._cache = None
            data = self._read()
            yield data
            atomic_write(self.path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode(), mode=0o600)
            self._cache = None

    def create(self, project: str, *, admin: bool = False, name: str = "", quota: Quota | None = None) -> str:
        """Make a token for `project` (setting the project's quota when given); returns the plain token."""
        check_project(project)
        if quota is not None:
            quota.check()
        if len(name) > 200:
            raise InvalidRequest("token name longer than 200 characters")
        tid = "".join(secrets.choice(_B32) for _ in range(10))
        secret = secrets.token_urlsafe(32)
        with self._locked() as data:
            while tid in data["tokens"]:
                tid = "".join(secrets.choice(_B32) for _ in range(10))
            data["tokens"][tid] = asdict(TokenEntry(id=tid, project=project, sha256=_hash(secret),
                                                    admin=admin, name=name))
            if quota is not None and not quota.is_unlimited():
                merged = Quota.from_dict(data["projects"].get(project))
                for k, v in asdict(quota).items():
                    if v is not None:
                        setattr(merged, k, v)
                data["projects"][project] = asdict(merged)
        return f"shoal_{tid}_{secret}"

    def set_quota(self, project: str, quota: Quota) -> None:
        """Replace a project's quota (all fields; None = unlimited)."""
        check_project(project)
        quota.check()
        with self._locked() as data:
            if quota.is_unlimited():
                data["projects"].pop(project, None)
            else:
                data["projects"][project] = asdict(quota)

    def set_policy(self, project: str, policy: ProjectPolicy) -> None:
        """Replace a project's policy (a default policy removes the entry)."""
        check_project(project)
        policy.check()
        with self._locked() as data:
            if policy.is_default():
                data["policies"].pop(project, None)
            else:
                data["policies"][project] = asdict(policy)

    def remove(self, token_id: str) -> TokenEntry:
        """Delete a token by id (or by the full token); it stops working at the next request."""
        m = TOKEN_RE.match(token_id)
        if m:
            token_id = m.group(1)
        with self._locked() as data:
            entry = data["tokens"].pop(token_id, None)
            if entry is None:
                raise TokenNotFound(f"no token with id {token_id!r}; see `shoal token ls`")
        return TokenEntry(**entry)
