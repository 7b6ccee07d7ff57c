"""A real registry on loopback for tests and benchmarks (`shoal bench pull`): Debian's `docker-registry`
(distribution 2.8) bound to 127.0.0.1, with images pushed by skopeo from archives the tests make (or exactly
as given, `push_oci`), and served under Docker Hub (or ghcr.io) names through shoal's mirror setting.
Optional auth: htpasswd (basic) or bearer tokens from a tiny token server started here (JWTs signed with a
throwaway key through openssl). Never a dependency of shoal itself: `apt-get install docker-registry skopeo`.

    with LoopbackRegistry(tmp) as reg:
        reg.push("library/python:3.12-slim", [layer_tar([...])], env=["A=1"])
        monkeypatch.setenv("SHOAL_REGISTRY_MIRRORS", reg.mirror_setting())   # docker.io=http://127.0.0.1:N
        # or: for k, v in reg.env().items(): monkeypatch.setenv(k, v)        # + fallback off, policy missing

The registry's JSON request log is parsed by `requests()`: what a test or a benchmark fetched, measured
on the server side.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import json
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MT_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def available() -> str | None:
    """None when docker-registry and skopeo are installed, else what is missing."""
    missing = [x for x in ("docker-registry", "skopeo") if not shutil.which(x)]
    return f"needs {' and '.join(missing)} (apt-get install docker-registry skopeo)" if missing else None


@dataclass
class Request:
    """One request the registry served."""

    method: str
    uri: str
    status: int
    written: int
    agent: str

    @property
    def is_blob(self) -> bool:
        return "/blobs/sha256:" in self.uri and self.method == "GET"

    @property
    def is_manifest(self) -> bool:
        return "/manifests/" in self.uri and self.method in ("GET", "HEAD")


class _TokenServer:
    """Bearer tokens for the registry's `auth: token` mode: checks basic credentials, signs a JWT (RS256,
    x5c header) granting what was asked."""

    def __init__(self, root: Path, users: dict[str, str], service: str, issuer: str) -> None:
        self.root, self.users, self.service, self.issuer = root, users, service, issuer
        self.key = root / "token.key"
        self.cert = root / "token.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key),
                        "-out", str(self.cert), "-days", "2", "-subj", "/CN=shoal-test-token"],
                       check=True, capture_output=True)
        der = subprocess.run(["openssl", "x509", "-in", str(self.cert), "-outform", "DER"], check=True,
                             capture_output=True).stdout
        self.x5c = base64.b64encode(der).decode()
        self.issued = 0
        self.refused = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                user = None
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Basic "):
                    u, _, p = base64.b64decode(auth[6:]).decode().partition(":")
                    if server.users.get(u) != p:
                        server.refused += 1
                        self.send_response(401)
                        self.end_headers()
                        self.wfile.write(b'{"details":"wrong user or password"}')
                        return
                    user = u
                access = []
                for scope in q.get("scope", []):
                    kind, _, rest = scope.partition(":")
                    name, _, actions = rest.rpartition(":")
                    if user is not None:  # anonymous callers get a token with no access (as Docker Hub does)
                        access.append({"type": kind, "name": name, "actions": actions.split(",")})
                tok = server.sign(user or "", access)
                server.issued += 1
                body = json.dumps({"token": tok, "access_token": tok, "expires_in": 300}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/token"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def sign(self, subject: str, access: list[dict[str, Any]]) -> str:
        def b64(d: bytes) -> str:
            return base64.urlsafe_b64encode(d).rstrip(b"=").decode()

        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {"iss": self.issuer, "sub": subject, "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": hashlib.sha256(f"{now}{time.monotonic()}".encode()).hexdigest()[:16],
                  "access": access}
        signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)], input=signing_input.encode(),
                             check=True, capture_output=True).stdout
        return f"{signing_input}.{b64(sig)}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class LoopbackRegistry:
    """docker-registry on 127.0.0.1:<free port>. `auth`: None, "basic" (htpasswd) or "token" (bearer).
    `users` are the accounts of either auth mode."""

    def __init__(self, root: Path | None = None, *, auth: str | None = None,
                 users: dict[str, str] | None = None) -> None:
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="shoal-registry-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.auth = auth
        self.users = users or {"alice": "s3cret"}
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}"
        self.log_path = self.root / "registry.log"
        self.token: _TokenServer | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> LoopbackRegistry:
        exe = shutil.which("docker-registry")
        if not exe:
            raise RuntimeError(available() or "docker-registry missing")
        auth = ""
        if self.auth == "basic":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                try:
                    import crypt  # bcrypt through libxcrypt: what distribution's htpasswd wants
                except ImportError:  # Python >= 3.13
                    raise RuntimeError("htpasswd for the basic-auth registry needs Python's crypt module") from None
                lines = [f"{u}:{crypt.crypt(p, crypt.mksalt(crypt.METHOD_BLOWFISH))}" for u, p in self.users.items()]
            (self.root / "htpasswd").write_text("\n".join(lines) + "\n")
            auth = f"""auth:
  htpasswd:
    realm: shoal-test
    path: {self.root / "htpasswd"}
"""
        elif self.auth == "token":
            self.token = _TokenServer(self.root, self.users, service="shoal-test-registry", issuer="shoal-test")
            auth = f"""auth:
  token:
    realm: {self.token.url}
    service: shoal-test-registry
    issuer: shoal-test
    rootcertbundle: {self.token.cert}
"""
        elif self.auth is not None:
            raise ValueError(f"unknown auth {self.auth!r}")
        cfg = self.root / "config.yml"
        cfg.write_text(f"""version: 0.1
log:
  level: info
  formatter: json
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {self.root / "data"}
  delete:
    enabled: true
http:
  addr: {self.host}
{auth}""")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([exe, "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=log)

        def up() -> bool:
            try:
                with urllib.request.urlopen(f"{self.url}/v2/", timeout=1) as r:
                    return r.status == 200
            except urllib.error.HTTPError as e:
                return e.code == 401  # it answers (and wants a login)

        deadline = time.monotonic() + 20
        while True:
            try:
                if up():
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline or (self.proc is not None and self.proc.poll() is not None):
                tail = self.log_path.read_bytes()[-800:].decode(errors="replace") if self.log_path.exists() else ""
                self.stop()
                raise RuntimeError(f"docker-registry did not answer: {tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.token is not None:
            self.token.stop()
            self.token = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LoopbackRegistry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- settings for shoal ------------------------------------------------------------------
    def mirror_setting(self, registries: tuple[str, ...] = ("docker.io", "ghcr.io", "quay.io")) -> str:
        """SHOAL_REGISTRY_MIRRORS serving these registries' names from here."""
        return " ".join(f"{r}={self.url}" for r in registries)

    def env(self) -> dict[str, str]:
        """The environment that makes shoal pull Hub/ghcr/quay names from here and never from the internet."""
        return {"SHOAL_REGISTRY_MIRRORS": self.mirror_setting(), "SHOAL_REGISTRY_FALLBACK": "0",
                "SHOAL_PULL_POLICY": "missing"}

    def docker_config(self, directory: Path, user: str | None = None, password: str | None = None) -> Path:
        """Write a Docker config.json with credentials for this registry; returns the directory (DOCKER_CONFIG)."""
        user = user or next(iter(self.users))
        password = self.users[user] if password is None else password
        directory.mkdir(parents=True, exist_ok=True)
        auth = base64.b64encode(f"{user}:{password}".encode()).decode()
        (directory / "config.json").write_text(json.dumps({"auths": {self.host: {"auth": auth}}}))
        return directory

    # ---- content -----------------------------------------------------------------------------
    def _creds(self) -> list[str]:
        if self.auth is None:
            return []
        u = next(iter(self.users))
        return [f"--dest-creds={u}:{self.users[u]}"]

    def push_archive(self, archive: Path, name: str, *, fmt: str = "docker-archive") -> None:
        """skopeo copy an archive (docker-archive or oci-archive) to `name` (repository:tag) here."""
        r = subprocess.run(["skopeo", "--insecure-policy", "copy", "--quiet", "--dest-tls-verify=false",
                            *self._creds(), f"{fmt}:{archive}", f"docker://{self.host}/{name}"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"skopeo push of {name} failed: {r.stderr.strip()[-1000:]}")

    def push(self, name: str, layer_tars: list[bytes], *, compression: str | None = "gzip", oci: bool = False,
             **cfg: Any) -> str:
        """Push an image made of `layer_tars` (bottom first) as `name` (repository:tag) with skopeo; returns
        its manifest digest. A Docker v2 manifest from a docker-archive, or (`oci`) from an OCI archive
        (skopeo compresses the layers as it sees fit: use push_oci for exact media types)."""
        from shoal.images.archive import image_config, write_docker_archive, write_oci_layout

        work = Path(tempfile.mkdtemp(prefix="push-", dir=self.root))
        try:
            config = image_config(layer_tars, **cfg)
            if oci:
                tar = write_oci_layout(work / "image.tar", layer_tars, config, compression=compression)
                self.push_archive(tar, name, fmt="oci-archive")
            else:
                tar = write_docker_archive(work / "image.tar", layer_tars, config)
                self.push_archive(tar, name)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return self.manifest_digest(name)

    def upload_blob(self, repo: str, data: bytes) -> str:
        """Upload one blob (monolithic POST + PUT); returns its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        st, h, body = self._http("POST", f"/v2/{repo}/blobs/uploads/", data=b"")
        if st != 202:
            raise RuntimeError(f"blob upload start: HTTP {st} {body[:200]!r}")
        loc = {k.lower(): v for k, v in h.items()}["location"]
        loc = loc if loc.startswith("/") else "/" + loc.split("/", 3)[3]
        sep = "&" if "?" in loc else "?"
        st, _, body = self._http("PUT", f"{loc}{sep}digest={urllib.parse.quote(digest)}", data=data,
                                 headers={"Content-Type": "application/octet-stream"})
        if st != 201:
            raise RuntimeError(f"blob upload: HTTP {st} {body[:200]!r}")
        return digest

    def push_oci(self, name: str, layer_tars: list[bytes], *, compression: str | None = "gzip", **cfg: Any) -> str:
        """Push an OCI image exactly as given, without skopeo: layers compressed by `compression` (gzip, zstd
        or None: plain tar) with the matching OCI media types; returns the manifest digest."""
        from shoal.images.archive import _OCI_CONFIG, _OCI_LAYER, _OCI_MANIFEST, _compress, image_config

        repo = name.rpartition(":")[0]
        cfg_bytes = json.dumps(image_config(layer_tars, **cfg)).encode()
        layers = []
        for t in layer_tars:
            blob = _compress(t, compression)
            layers.append({"mediaType": _OCI_LAYER[compression], "digest": self.upload_blob(repo, blob),
                           "size": len(blob)})
        manifest = {"schemaVersion": 2, "mediaType": _OCI_MANIFEST,
                    "config": {"mediaType": _OCI_CONFIG, "digest": self.upload_blob(repo, cfg_bytes),
                               "size": len(cfg_bytes)},
                    "layers": layers}
        return self.put_manifest(name, json.dumps(manifest).encode(), _OCI_MANIFEST)

    def _http(self, method: str, path: str, data: bytes | None = None, headers: dict[str, str] | None = None
              ) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=headers or {})
        if self.auth == "basic":
            u = next(iter(self.users))
            req.add_header("Authorization", "Basic " + base64.b64encode(f"{u}:{self.users[u]}".encode()).decode())
        elif self.auth == "token":
            assert self.token is not None
            repo = path.split("/manifests/")[0].split("/blobs/")[0].removeprefix("/v2/")
            tok = self.token.sign(next(iter(self.users)), [{"type": "repository", "name": repo,
                                                            "actions": ["pull", "push"]}])
            req.add_header("Authorization", f"Bearer {tok}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def manifest(self, name: str) -> tuple[bytes, str, str]:
        """(body, media type, digest) of `repository:tag`."""
        repo, _, tag = name.rpartition(":")
        accept = ", ".join(["application/vnd.docker.distribution.manifest.v2+json",
                            "application/vnd.oci.image.manifest.v1+json", MT_DOCKER_LIST, MT_OCI_INDEX])
        st, h, body = self._http("GET", f"/v2/{repo}/manifests/{tag}", headers={"Accept": accept})
        if st != 200:
            raise LookupError(f"{name}: HTTP {st} {body[:200]!r}")
        ct = {k.lower(): v for k, v in h.items()}.get("content-type", "")
        return body, ct, "sha256:" + hashlib.sha256(body).hexdigest()

    def manifest_digest(self, name: str) -> str:
        return self.manifest(name)[2]

    def put_manifest(self, name: str, body: bytes, media_type: str) -> str:
        """PUT a manifest (or index) as `repository:tag`; returns its digest."""
        repo, _, tag = name.rpartition(":")
        st, _, resp = self._http("PUT", f"/v2/{repo}/manifests/{tag}", data=body,
                                 headers={"Content-Type": media_type})
        if st not in (200, 201):
            raise RuntimeError(f"PUT manifest {name}: HTTP {st} {resp[:300]!r}")
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def put_index(self, name: str, entries: list[tuple[str, str, str]], *, oci: bool = False) -> str:
        """Make `name` a manifest list / OCI index of (source `repository:tag`, os, architecture) entries
        (each source must be in this repository); returns the index digest."""
        manifests = []
        for src, os_, arch in entries:
            body, ct, digest = self.manifest(src)
            manifests.append({"mediaType": ct.split(";")[0], "digest": digest, "size": len(body),
                              "platform": {"os": os_, "architecture": arch}})
        mt = MT_OCI_INDEX if oci else MT_DOCKER_LIST
        doc = {"schemaVersion": 2, "mediaType": mt, "manifests": manifests}
        return self.put_manifest(name, json.dumps(doc).encode(), mt)

    def delete_blob(self, repo: str, digest: str) -> None:
        """Remove a blob (to test what a registry missing one answers)."""
        st, _, body = self._http("DELETE", f"/v2/{repo}/blobs/{digest}")
        if st != 202:
            raise RuntimeError(f"DELETE blob: HTTP {st} {body[:200]!r}")

    # ---- what was served ---------------------------------------------------------------------
    def requests(self) -> list[Request]:
        """Every request completed so far, from the registry's JSON log."""
        out = []
        with contextlib.suppress(FileNotFoundError), open(self.log_path, "rb") as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                if not str(d.get("msg", "")).startswith("response completed"):
                    continue
                out.append(Request(method=d.get("http.request.method", ""), uri=d.get("http.request.uri", ""),
                                   status=int(d.get("http.response.status", 0)),
                                   written=int(d.get("http.response.written", 0)),
                                   agent=d.get("http.request.useragent", "")))
        return out

    def mark(self) -> int:
        """How many requests so far (pass to `since`)."""
        return len(self.requests())

    def since(self, mark: int) -> list[Request]:
        """Requests completed after `mark`."""
        return self.requests()[mark:]

