"""Part of `shoal bench compat` about E2B's `get_host(port)` (issue 26): the round trip of one HTTP request to a
server inside a sandbox (`python3 -m http.server`, HTTP/1.0: a new connection per request, as a browser or
`requests.get` to such a server makes), two ways, interleaved round by round on one sandbox:

- **direct**: from the host to the sandbox's own address on the node's bridge (the sandbox has a network for this
  path alone; it is what a request costs without shoal in between);
- **get_host**: to `shoal serve` with the E2B routing headers (`E2b-Sandbox-Id`, `E2b-Sandbox-Port`): the server
  asks the sandbox's agent to connect to the port from inside and relays the bytes
  (shoal.server.compat.ports), the path `network=False` sandboxes take.

The ratio get_host / direct is the relay's cost; both paths hit the same server.
"""

from __future__ import annotations

import time
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric
from shoal.bench.stats import latency_summary

PORT = 8000
SERVE = (f"cd /tmp && head -c 65536 /dev/urandom > f64k && (python3 -m http.server {PORT} --bind 0.0.0.0 "
         f">/dev/null 2>&1 &) && for i in $(seq 300); do (echo > /dev/tcp/127.0.0.1/{PORT}) 2>/dev/null "
         "&& exit 0; sleep 0.1; done; exit 1")


async def get_host_round_trip(ctx: BenchContext, client: Any, url: str, token: str, rounds: int) -> tuple[dict, list]:
    """Latency of GET / and GET /f64k through get_host vs straight from the host (module docstring)."""
    import httpx

    from shoal.records import SandboxRecord

    sb = await client.create(ctx.image, memory_mb=256, network=True)
    try:
        r = await sb.exec(SERVE, timeout=60)
        if r.exit_code != 0:
            raise RuntimeError(f"the http.server in the sandbox did not start: {r.stderr[-300:]!r}")
        ip = SandboxRecord.load(ctx.home / "sandboxes" / sb.id).extra.get("ip")
        if not ip:
            raise RuntimeError("the sandbox has no address on the bridge: the direct path cannot be measured")
        routed = {"E2b-Sandbox-Id": sb.id, "E2b-Sandbox-Port": str(PORT), "X-API-KEY": token}
        paths = {"direct": (f"http://{ip}:{PORT}", {}), "get_host": (url, routed)}
        lat: dict[str, list[float]] = {f"{k}{p}": [] for k in paths for p in ("/", "/f64k")}
        async with httpx.AsyncClient(timeout=30) as http:
            async def once(name: str, path: str) -> float:
                base, headers = paths[name]
                t = time.perf_counter()
                resp = await http.get(base + path, headers=headers)
                dt = time.perf_counter() - t
                if resp.status_code != 200:
                    raise RuntimeError(f"{name} GET {path}: {resp.status_code} {resp.text[:200]}")
                return dt

            for _ in range(5):  # warm-up: connections to shoal serve, the server's imports
                for name in paths:
                    await once(name, "/")
            with ctx.task(f"{rounds} rounds of GET through get_host and directly", rounds) as adv:
                for _ in range(rounds):
                    for name in paths:
                        for path in ("/", "/f64k"):
                            lat[f"{name}{path}"].append(await once(name, path))
                    adv()
    finally:
        await sb.close()
    summ = {k: latency_summary(v) for k, v in lat.items()}
    p50 = {k: s.get("p50_ms") for k, s in summ.items()}
    data = {"rounds": rounds, "latency": summ, "server": "python3 -m http.server (HTTP/1.0)", "interleaved": True}

    def note(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}× of the direct request" if a and b else ""

    metrics = [
        Metric("get_host GET / p50, directly from the host", p50["direct/"], None, "ms",
               note="the sandbox's bridge address"),
        Metric("get_host GET / p50, through shoal's port relay", p50["get_host/"], None, "ms",
               note=note(p50["get_host/"], p50["direct/"])),
        Metric("get_host GET 64 KiB p50, directly from the host", p50["direct/f64k"], None, "ms"),
        Metric("get_host GET 64 KiB p50, through shoal's port relay", p50["get_host/f64k"], None, "ms",
               note=note(p50["get_host/f64k"], p50["direct/f64k"])),
    ]
    return data, metrics
