"""A client of the registry HTTP API (OCI distribution spec / Docker registry v2), with mirrors and auth.

    with RegistryClient.from_settings() as rc:
        m = rc.manifest(parse_reference("python:3.12-slim"))        # index -> linux/amd64 manifest
        with rc.blob(m.source, m.config_digest) as f: ...            # a file-like, digest checked by the caller

What it does, and why here rather than through skopeo: a pull must download layers in parallel, resume
a broken download where it stopped (HTTP Range), stream each blob through its digest check into the
unpacker (no temp copy of the compressed blob), and skip layers the store already has by diff id before
any byte is fetched — all of which need the protocol in hand.

Endpoints, like containerd's hosts: a registry's mirrors (setting `registry_mirrors`) are asked first,
in order, then the registry itself (unless `registry_fallback` is off). A mirror URL keeps its scheme:
plain HTTP only where it says http://. A registry named in a reference is reached over HTTPS; loopback
hosts and those in `registry_insecure` fall back to plain HTTP when HTTPS fails (as Docker does).

Auth: the `WWW-Authenticate` challenge of a 401 decides — Bearer (a token from the realm, asked with the
credentials when there are some) or Basic. Credentials come from Docker's config.json (`auths`, and
`credHelpers`/`credsStore` through `docker-credential-*`), found at `registry_auth_file`, else
`$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`.

Errors are typed: ImageNotFound (with the registry's answer), RegistryAuthFailed, RegistryUnavailable.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import ipaddress
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from shoal.errors import ImageNotFound, InvalidRequest, RegistryAuthFailed, RegistryUnavailable
from shoal.images.reference import DOCKER_HUB, DOCKER_HUB_API, Reference

MT_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MT_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MT_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MT_DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
MT_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
MT_OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MT_SCHEMA1 = ("application/vnd.docker.distribution.manifest.v1+json",
              "application/vnd.docker.distribution.manifest.v1+prettyjws")
INDEX_TYPES = (MT_DOCKER_LIST, MT_OCI_INDEX)
MANIFEST_TYPES = (MT_DOCKER_MANIFEST, MT_OCI_MANIFEST)
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))
#: the largest manifest or config read into memory
MAX_DOCUMENT_BYTES = 8 << 20
_CHUNK = 1 << 20
_CHALLENGE = re.compile(r'(\w+)\s*=\s*(?:"([^"]*)"|([^\s,]+))')


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _is_loopback(host: str) -> bool:
    h = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:host.find("]")]
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


# ---- credentials ----------------------------------------------------------------------------------
def _key_host(key: str) -> str:
    """`https://index.docker.io/v1/` -> `index.docker.io`: config.json keys may be URLs."""
    k = key.strip()
    k = re.sub(r"^[a-z]+://", "", k)
    return k.split("/", 1)[0].lower()


class DockerCredentials:
    """Credentials from Docker's config.json: `auths` entries and credential helpers."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._doc: dict[str, Any] = {}
        self._cache: dict[str, tuple[str, str] | None] = {}
        self._lock = threading.Lock()
        if path is not None:
            try:
                doc = json.loads(Path(path).read_text())
            except FileNotFoundError:
                doc = {}
            except (OSError, ValueError) as e:
                raise RegistryAuthFailed(f"cannot read Docker's credentials file {path}: {e}") from None
            self._doc = doc if isinstance(doc, dict) else {}

    @staticmethod
    def default_path(setting: Path | None = None) -> Path:
        """`registry_auth_file`, else `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`."""
        if setting is not None:
            return Path(setting)
        d = os.environ.get("DOCKER_CONFIG")  # Docker's own variable, read as Docker reads it
        return Path(d) / "config.json" if d else Path.home() / ".docker" / "config.json"

    @staticmethod
    def _aliases(host: str) -> list[str]:
        h = host.lower()
        if h in (DOCKER_HUB, DOCKER_HUB_API, "index.docker.io"):
            return ["index.docker.io", DOCKER_HUB, DOCKER_HUB_API]
        return [h]

    def get(self, host: str) -> tuple[str, str] | None:
        """(username, password) for a registry host, or None (anonymous)."""
        with self._lock:
            if host in self._cache:
                return self._cache[host]
            found = self._lookup(host)
            self._cache[host] = found
            return found

    def _lookup(self, host: str) -> tuple[str, str] | None:
        names = self._aliases(host)
        helpers = self._doc.get("credHelpers") or {}
        if isinstance(helpers, dict):
            for key, helper in helpers.items():
                if _key_host(str(key)) in names and isinstance(helper, str):
                    return self._helper(helper, str(key))
        auths = self._doc.get("auths") or {}
        if isinstance(auths, dict):
            for key, entry in auths.items():
                if _key_host(str(key)) not in names or not isinstance(entry, dict):
                    continue
                if isinstance(entry.get("auth"), str) and entry["auth"]:
                    try:
                        user, _, pw = base64.b64decode(entry["auth"]).decode().partition(":")
                    except (ValueError, UnicodeDecodeError):
                        raise RegistryAuthFailed(f"the credentials of {key} in {self.path} are not valid base64 "
                                                 "user:password") from None
                    return user, pw
                if isinstance(entry.get("username"), str):
                    return entry["username"], str(entry.get("password") or "")
        store = self._doc.get("credsStore")
        if isinstance(store, str) and store:
            key = "https://index.docker.io/v1/" if names[0] == "index.docker.io" else host
            with contextlib.suppress(RegistryAuthFailed):
                return self._helper(store, key)
        return None

    def _helper(self, helper: str, server: str) -> tuple[str, str] | None:
        exe = shutil.which(f"docker-credential-{helper}")
        if not exe:
            raise RegistryAuthFailed(f"{self.path} names the credential helper {helper!r}, but "
                                     f"docker-credential-{helper} is not on PATH")
        try:
            r = subprocess.run([exe, "get"], input=server.encode(), capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RegistryAuthFailed(f"docker-credential-{helper} failed: {e}") from None
        if r.returncode != 0:
            if b"credentials not found" in r.stdout + r.stderr:
                return None
            raise RegistryAuthFailed(f"docker-credential-{helper} get {server} failed: "
                                     f"{(r.stderr or r.stdout).decode(errors='replace').strip()[:300]}")
        try:
            doc = json.loads(r.stdout)
            return str(doc["Username"]), str(doc["Secret"])
        except (ValueError, KeyError, TypeError):
            raise RegistryAuthFailed(f"docker-credential-{helper} answered something that is not "
                                     "{Username, Secret}") from None


# ---- endpoints ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    """One place to ask for a registry's content: a mirror or the registry itself."""

    base: str            # scheme://host[:port][/prefix], no trailing slash
    host: str            # host[:port], the credentials key
    mirror: bool = False
    #: HTTPS first, then plain HTTP (loopback and `registry_insecure` hosts only)
    http_fallback: bool = False

    def url(self, repository: str, kind: str, ref: str) -> str:
        """`<base>/v2/<repository>/<kind>/<ref>`."""
        return f"{self.base}/v2/{repository}/{kind}/{ref}"

    def describe(self) -> str:
        """How errors name it."""
        return f"mirror {self.base}" if self.mirror else self.host


@dataclass
class Manifest:
    """An image manifest for this platform, and where it came from."""

    reference: Reference
    digest: str                      # of the platform manifest
    media_type: str
    doc: dict[str, Any]
    source: Endpoint                 # the endpoint that served it (blobs are asked there first)
    index_digest: str | None = None  # of the manifest list / index, when there was one
    raw: bytes = b""

    @property
    def config_digest(self) -> str:
        """The image config blob's digest."""
        return str((self.doc.get("config") or {}).get("digest") or "")

    @property
    def layers(self) -> list[dict[str, Any]]:
        """The layer descriptors, bottom first."""
        return [d for d in self.doc.get("layers") or [] if isinstance(d, dict)]


@dataclass
class _Failure:
    endpoint: Endpoint
    kind: str   # "not_found" | "auth" | "unavailable"
    message: str


class RegistryClient:
    """Talks to registries (and their mirrors). Thread-safe: one client serves a pull's parallel layers."""

    def __init__(self, *, mirrors: dict[str, list[str]] | None = None, fallback: bool = True,
                 insecure: tuple[str, ...] | list[str] = (), credentials: DockerCredentials | None = None,
                 retries: int = 5, timeout_s: float = 60.0, platform: tuple[str, str] | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        from shoal.images.oci import host_arch

        self.mirrors = {k.lower(): list(v) for k, v in (mirrors or {}).items()}
        self.fallback = fallback
        self.insecure = {h.lower() for h in insecure}
        self.credentials = credentials or DockerCredentials(None)
        self.retries = max(1, int(retries))
        self.platform = platform or ("linux", host_arch())
        self._http = httpx.Client(follow_redirects=True, transport=transport,
                                  timeout=httpx.Timeout(timeout_s, connect=10.0),
                                  headers={"User-Agent": "shoal (+https://github.com/shoal)"})
        self._tokens: dict[tuple[str, str], str] = {}
        self._basic: set[str] = set()
        self._lock = threading.Lock()
        #: bytes received from registries (blobs, manifests, configs): what a pull fetched
        self.bytes_received = 0
        self.requests = 0

    @classmethod
    def from_settings(cls, s: Any = None, **kw: Any) -> RegistryClient:
        """A client configured by shoal's settings (mirrors, fallback, insecure hosts, credentials, retries)."""
        if s is None:
            from shoal.config import settings

            s = settings()
        creds = DockerCredentials(DockerCredentials.default_path(s.registry_auth_file))
        return cls(mirrors=s.registry_mirrors, fallback=s.registry_fallback, insecure=s.registry_insecure,
                   credentials=creds, retries=s.pull_retries, **kw)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- endpoints ---------------------------------------------------------------------------
    def endpoints(self, ref: Reference) -> list[Endpoint]:
        """Where to ask for `ref`'s content, in order: its mirrors, then the registry itself."""
        out = []
        for url in self.mirrors.get(ref.registry, []) + self.mirrors.get("*", []):
            host = re.sub(r"^[a-z]+://", "", url).split("/", 1)[0]
            out.append(Endpoint(base=url.rstrip("/"), host=host, mirror=True))
        if self.fallback or not out:
            out.append(self.registry_endpoint(ref))
        return out

    def registry_endpoint(self, ref: Reference) -> Endpoint:
        """The registry itself (never a mirror: where a push goes)."""
        host = DOCKER_HUB_API if ref.registry == DOCKER_HUB else ref.registry
        insecure = _is_loopback(host) or host.lower() in self.insecure
        return Endpoint(base=f"https://{host}", host=host, http_fallback=insecure)

    # ---- requests with auth and retries ------------------------------------------------------
    def _auth_header(self, ep: Endpoint, scope: str) -> dict[str, str]:
        with self._lock:
            tok = self._tokens.get((ep.base, scope))
            basic = ep.base in self._basic
        if tok:
            return {"Authorization": f"Bearer {tok}"}
        if basic:
            cred = self.credentials.get(ep.host)
            if cred:
                return {"Authorization": "Basic " + base64.b64encode(f"{cred[0]}:{cred[1]}".encode()).decode()}
        return {}

    def _authenticate(self, ep: Endpoint, scope: str, challenge: str, what: str) -> None:
        """Answer a 401's challenge (get a bearer token or switch to basic auth); RegistryAuthFailed if not."""
        scheme, _, params_s = challenge.strip().partition(" ")
        params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
                  for m in _CHALLENGE.finditer(params_s)}
        cred = self.credentials.get(ep.host)
        if scheme.lower() == "basic":
            if not cred:
                raise RegistryAuthFailed(f"{ep.describe()} needs a login for {what} (basic auth): run `docker "
                                         f"login {ep.host}`", registry=ep.host)
            with self._lock:
                if ep.base in self._basic:
                    raise RegistryAuthFailed(f"{ep.describe()} refused the credentials for {ep.host} "
                                             f"({self.credentials.path}) for {what}", registry=ep.host)
                self._basic.add(ep.base)
            return
        if scheme.lower() != "bearer" or not params.get("realm"):
            raise RegistryAuthFailed(f"{ep.describe()} asks for an authentication shoal does not speak: "
                                     f"{challenge[:200]!r}", registry=ep.host)
        q = {"service": params.get("service", "")}
        if scope or params.get("scope"):
            q["scope"] = params.get("scope") or scope
        headers = {}
        if cred:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{cred[0]}:{cred[1]}".encode()).decode()
        try:
            r = self._http.get(params["realm"], params={k: v for k, v in q.items() if v}, headers=headers)
        except httpx.HTTPError as e:
            raise RegistryUnavailable(f"the token server {params['realm']} of {ep.describe()} did not answer: "
                                      f"{e}", registry=ep.host) from None
        if r.status_code in (401, 403):
            how = "refused the credentials" if cred else "refused an anonymous token"
            raise RegistryAuthFailed(f"the token server of {ep.describe()} {how} for {what}: "
                                     f"{_answer(r)}", registry=ep.host)
        if r.status_code != 200:
            raise RegistryUnavailable(f"the token server of {ep.describe()} answered {r.status_code}: {_answer(r)}",
                                      registry=ep.host)
        try:
            doc = r.json()
            tok = doc.get("token") or doc.get("access_token")
        except ValueError:
            tok = None
        if not tok:
            raise RegistryAuthFailed(f"the token server of {ep.describe()} sent no token", registry=ep.host)
        with self._lock:
            self._tokens[(ep.base, scope)] = str(tok)

    def request(self, ep: Endpoint, method: str, url: str, *, scope: str, what: str,
                headers: dict[str, str] | None = None, stream: bool = False,
                content: Any = None) -> httpx.Response:
        """One request with auth and retries (connection errors, 429 and 5xx back off and retry).
        Returns the response (the caller judges its status; a streamed one must be closed)."""
        delay = 0.2
        last = ""
        attempts = 0
        authed = False
        while attempts < self.retries:
            h = {**(headers or {}), **self._auth_header(ep, scope)}
            try:
                req = self._http.build_request(method, url, headers=h, content=content)
                r = self._http.send(req, stream=stream)
            except httpx.UnsupportedProtocol as e:
                raise RegistryUnavailable(f"{ep.describe()}: {e}", registry=ep.host) from None
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
                if ep.http_fallback and url.startswith("https://") and _tls_or_refused(e):
                    # a loopback or insecure-listed registry without TLS: plain HTTP, as Docker does
                    url = "http://" + url[len("https://"):]
                    ep = Endpoint(base="http://" + ep.base[len("https://"):], host=ep.host, mirror=ep.mirror)
                    continue
                attempts += 1
                if attempts < self.retries:
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
                continue
            with self._lock:
                self.requests += 1
            if r.status_code == 401 and not authed:
                challenge = r.headers.get("www-authenticate", "")
                _drain(r)
                self._authenticate(ep, scope, challenge, what)
                authed = True
                continue
            if r.status_code == 429 or r.status_code >= 500:
                last = f"HTTP {r.status_code}: {_answer(r)}"
                wait = _retry_after(r) or delay
                _drain(r)
                attempts += 1
                if attempts < self.retries:
                    time.sleep(min(wait, 30.0))
                    delay = min(delay * 2, 5.0)
                continue
            return r
        raise RegistryUnavailable(f"{ep.describe()} failed {what} after {self.retries} attempts: {last}",
                                  registry=ep.host)

    # ---- manifests ---------------------------------------------------------------------------
    def _get_document(self, ep: Endpoint, ref: Reference, reference: str, what: str) -> tuple[bytes, str]:
        scope = f"repository:{ref.repository}:pull"
        r = self.request(ep, "GET", ep.url(ref.repository, "manifests", reference), scope=scope, what=what,
                         headers={"Accept": ACCEPT}, stream=True)
        try:
            if r.status_code != 200:
                _judge(r, ep, what)
            body = _read_limited(r, MAX_DOCUMENT_BYTES, what)
        finally:
            r.close()
        with self._lock:
            self.bytes_received += len(body)
        mt = r.headers.get("content-type", "").split(";")[0].strip()
        return body, mt

    def manifest(self, ref: Reference) -> Manifest:
        """The image manifest of `ref` for this platform (following a manifest list / image index), from the
        first endpoint that has it. Digests are checked: a digest reference must match the bytes served."""
        if ref.local_only:
            raise InvalidRequest(f"{ref.familiar} is a shoal name, not a registry reference: it cannot be pulled")
        failures: list[_Failure] = []
        for ep in self.endpoints(ref):
            try:
                return self._manifest_from(ep, ref)
            except ImageNotFound as e:
                failures.append(_Failure(ep, "not_found", e.message))
            except RegistryAuthFailed as e:
                failures.append(_Failure(ep, "auth", e.message))
            except RegistryUnavailable as e:
                failures.append(_Failure(ep, "unavailable", e.message))
        raise _combined(ref, failures)

    def _manifest_from(self, ep: Endpoint, ref: Reference) -> Manifest:
        what = f"the manifest of {ref.canonical}"
        body, mt = self._get_document(ep, ref, ref.remote_ref, what)
        digest = _sha256(body)
        if ref.digest and digest != ref.digest:
            raise RegistryUnavailable(f"{ep.describe()} served a manifest for {ref.canonical} whose bytes hash to "
                                      f"{digest}, not the digest asked for", registry=ep.host)
        doc = _json(body, what, ep)
        mt = str(doc.get("mediaType") or mt)
        index_digest = None
        if mt in INDEX_TYPES or ("manifests" in doc and "layers" not in doc):
            index_digest = digest
            child = self._pick(doc, ref, ep)
            body, mt = self._get_document(ep, ref, child, f"the {'/'.join(self.platform)} manifest of "
                                                           f"{ref.canonical}")
            digest = _sha256(body)
            if digest != child:
                raise RegistryUnavailable(f"{ep.describe()} served a manifest whose bytes hash to {digest}, not "
                                          f"{child} as its index says", registry=ep.host)
            doc = _json(body, what, ep)
            mt = str(doc.get("mediaType") or mt)
        if mt in MT_SCHEMA1 or doc.get("schemaVersion") == 1:
            raise ImageNotFound(f"{ref.canonical} is a Docker schema 1 image (deprecated since 2017): push it again "
                                "with a current docker or skopeo", reference=ref.familiar)
        if not isinstance(doc.get("layers"), list) or not isinstance(doc.get("config"), dict):
            raise RegistryUnavailable(f"{ep.describe()} served a manifest for {ref.canonical} without config or "
                                      f"layers (media type {mt or 'none'})", registry=ep.host)
        return Manifest(reference=ref, digest=digest, media_type=mt, doc=doc, source=ep, index_digest=index_digest,
                        raw=body)

    def _pick(self, index: dict[str, Any], ref: Reference, ep: Endpoint) -> str:
        want_os, want_arch = self.platform
        found = []
        for d in index.get("manifests") or []:
            if not isinstance(d, dict) or not isinstance(d.get("digest"), str):
                continue
            p = d.get("platform") or {}
            found.append(f"{p.get('os', '?')}/{p.get('architecture', '?')}")
            if p.get("os") == want_os and p.get("architecture") == want_arch:
                if want_arch == "arm64" and p.get("variant") not in (None, "v8"):
                    continue
                return str(d["digest"])
        have = ", ".join(sorted({f for f in found if f != "unknown/unknown"})) or "none"
        raise ImageNotFound(f"{ref.canonical} has no image for {want_os}/{want_arch} (it has: {have})",
                            reference=ref.familiar)

    # ---- blobs -------------------------------------------------------------------------------
    def blob_bytes(self, m: Manifest, digest: str, what: str) -> bytes:
        """A small blob (an image config) read whole, its digest checked."""
        with self.blob(m, digest, what) as f:
            data = f.read(MAX_DOCUMENT_BYTES + 1)
        if len(data) > MAX_DOCUMENT_BYTES:
            raise RegistryUnavailable(f"{what} of {m.reference.canonical} is over {MAX_DOCUMENT_BYTES} bytes")
        if _sha256(data) != digest:
            raise RegistryUnavailable(f"{what} of {m.reference.canonical} hashes to {_sha256(data)}, not {digest}: "
                                      f"{m.source.describe()} served corrupt data")
        return data

    def blob(self, m: Manifest, digest: str, what: str, size: int | None = None,
             on_bytes: Callable[[int], None] | None = None) -> BlobReader:
        """A file-like reading blob `digest` of `m`'s repository, resuming broken downloads (HTTP Range).
        The caller checks the digest of what it read (the reader counts and can hash, see BlobReader)."""
        eps = [m.source] + [e for e in self.endpoints(m.reference) if e.base != m.source.base]
        return BlobReader(self, eps, m.reference, digest, size, what, on_bytes)


class BlobReader(io.RawIOBase):
    """A resumable blob download as a file. A connection that breaks is reopened with `Range:` from the
    byte where it stopped (a registry that ignores Range is read again from the start, skipping what was
    already delivered); after `retries` breaks the next endpoint is tried, then RegistryUnavailable."""

    def __init__(self, rc: RegistryClient, endpoints: list[Endpoint], ref: Reference, digest: str,
                 size: int | None, what: str, on_bytes: Callable[[int], None] | None) -> None:
        self.rc = rc
        self.endpoints = endpoints
        self.ref = ref
        self.digest = digest
        self.size = size
        self.what = what
        self.on_bytes = on_bytes
        self.pos = 0
        self.resumes = 0
        self._ep_i = 0
        self._resp: httpx.Response | None = None
        self._it: Iterator[bytes] | None = None
        self._buf = b""
        self._eof = False
        self._breaks = 0
        self._failures: list[_Failure] = []

    def readable(self) -> bool:
        return True

    def _open(self) -> None:
        while self._ep_i < len(self.endpoints):
            ep = self.endpoints[self._ep_i]
            headers = {"Range": f"bytes={self.pos}-"} if self.pos else {}
            try:
                r = self.rc.request(ep, "GET", ep.url(self.ref.repository, "blobs", self.digest),
                                    scope=f"repository:{self.ref.repository}:pull", what=self.what,
                                    headers=headers, stream=True)
                if r.status_code not in (200, 206):
                    try:
                        _judge(r, ep, self.what)
                    finally:
                        r.close()
            except (ImageNotFound, RegistryAuthFailed, RegistryUnavailable) as e:
                kind = ("not_found" if isinstance(e, ImageNotFound) else
                        "auth" if isinstance(e, RegistryAuthFailed) else "unavailable")
                self._failures.append(_Failure(ep, kind, e.message))
                self._ep_i += 1
                self._breaks = 0
                continue
            skip = self.pos if (self.pos and r.status_code == 200) else 0
            self._resp = r
            it = r.iter_raw()  # no chunk size: a chunker would hold bytes a broken connection then loses
            self._it = _skipping(it, skip) if skip else it
            return
        raise _combined(self.ref, self._failures, blob=self.what)

    def _close_resp(self) -> None:
        if self._resp is not None:
            with contextlib.suppress(Exception):
                self._resp.close()
        self._resp = None
        self._it = None

    def readinto(self, b: Any) -> int:
        while not self._buf:
            if self._eof:
                return 0
            if self._it is None:
                self._open()
            assert self._it is not None
            try:
                self._buf = next(self._it)
            except StopIteration:
                self._close_resp()
                if self.size is not None and self.pos < self.size:
                    self._broke(f"the connection closed after {self.pos} of {self.size} bytes")
                    continue
                self._eof = True
                return 0
            except httpx.HTTPError as e:
                self._close_resp()
                self._broke(f"{type(e).__name__}: {e}")
                continue
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        self.pos += n
        with self.rc._lock:
            self.rc.bytes_received += n
        if self.on_bytes is not None:
            self.on_bytes(n)
        return n

    def _broke(self, why: str) -> None:
        self._breaks += 1
        self.resumes += 1
        if self._breaks >= self.rc.retries:
            ep = self.endpoints[self._ep_i]
            self._failures.append(_Failure(ep, "unavailable", f"{self.what}: {why} ({self._breaks} times)"))
            self._ep_i += 1
            self._breaks = 0
            if self.pos and self._ep_i < len(self.endpoints):
                return  # resume at the same byte on the next endpoint
            if self._ep_i >= len(self.endpoints):
                raise _combined(self.ref, self._failures, blob=self.what)
        time.sleep(min(0.2 * 2 ** self._breaks, 5.0))

    def close(self) -> None:
        self._close_resp()
        super().close()


def _skipping(it: Iterator[bytes], n: int) -> Iterator[bytes]:
    for chunk in it:
        if n >= len(chunk):
            n -= len(chunk)
            continue
        yield chunk[n:]
        n = 0


# ---- helpers --------------------------------------------------------------------------------------
def _tls_or_refused(e: httpx.HTTPError) -> bool:
    s = str(e).lower()
    return isinstance(e, httpx.ConnectError) and ("ssl" in s or "tls" in s or "refused" in s or "wrong version" in s
                                                  or "record layer" in s)


def _retry_after(r: httpx.Response) -> float | None:
    with contextlib.suppress(ValueError, TypeError):
        return max(0.0, float(r.headers.get("retry-after", "")))
    return None


def _drain(r: httpx.Response) -> None:
    with contextlib.suppress(Exception):
        if not r.is_closed:
            r.read()
    with contextlib.suppress(Exception):
        r.close()


def _read_limited(r: httpx.Response, limit: int, what: str) -> bytes:
    buf = bytearray()
    for chunk in r.iter_bytes():
        buf += chunk
        if len(buf) > limit:
            raise RegistryUnavailable(f"{what} is larger than {limit} bytes: refusing it")
    return bytes(buf)


def _answer(r: httpx.Response) -> str:
    """The registry's own words: its error list (code: message), else the start of its body."""
    try:
        body = r.read() if not r.is_stream_consumed else r.content
    except Exception:
        body = b""
    try:
        doc = json.loads(body)
        errs = doc.get("errors") if isinstance(doc, dict) else None
        if isinstance(errs, list) and errs:
            return "; ".join(f"{e.get('code', '?')}: {e.get('message', '')}".strip() for e in errs
                             if isinstance(e, dict))[:500]
        if isinstance(doc, dict) and doc.get("details"):
            return str(doc["details"])[:500]
    except (ValueError, AttributeError):
        pass
    text = body.decode("utf-8", "replace").strip()
    return (text[:300] or f"HTTP {r.status_code}")


def _judge(r: httpx.Response, ep: Endpoint, what: str) -> None:
    """Raise the typed error of a non-success answer."""
    ans = _answer(r)
    if r.status_code == 404:
        raise ImageNotFound(f"{ep.describe()} does not have {what}: {ans}", registry=ep.host, answer=ans)
    if r.status_code in (401, 403):
        raise RegistryAuthFailed(f"{ep.describe()} refused {what} (HTTP {r.status_code}): {ans}; if the image is "
                                 f"private, run `docker login {ep.host}`", registry=ep.host, answer=ans)
    raise RegistryUnavailable(f"{ep.describe()} answered HTTP {r.status_code} for {what}: {ans}",
                              registry=ep.host, answer=ans)


def _json(body: bytes, what: str, ep: Endpoint) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise RegistryUnavailable(f"{ep.describe()} served {what} that is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise RegistryUnavailable(f"{ep.describe()} served {what} that is not a JSON object")
    return doc


def _combined(ref: Reference, failures: list[_Failure], blob: str | None = None) -> Exception:
    """One typed error for what every endpoint answered: not found beats auth beats unavailable."""
    what = blob or ref.canonical
    lines = "; ".join(f.message for f in failures) or "no endpoint to ask"
    kinds = {f.kind for f in failures}
    details = {"reference": ref.familiar, "answers": [{"endpoint": f.endpoint.base, "kind": f.kind,
                                                       "message": f.message} for f in failures]}
    if "not_found" in kinds:
        return ImageNotFound(f"{what} was not found: {lines}", **details)
    if "auth" in kinds:
        return RegistryAuthFailed(f"{what}: access denied: {lines}", **details)
    return RegistryUnavailable(f"{what}: no registry answered: {lines}", **details)
