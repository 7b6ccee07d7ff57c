"""`shoal serve` and `shoal token …`: the API server and its tokens/projects/quotas."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from shoal.cli.common import console, err_console

if TYPE_CHECKING:
    from shoal.server.tokens import TokenStore

token_app = typer.Typer(help="API tokens, projects and quotas (stored hashed under $SHOAL_HOME/api).",
                        no_args_is_help=True)


def _store() -> TokenStore:
    from shoal.config import Paths
    from shoal.server.tokens import TokenStore

    return TokenStore(Paths.from_env().home)


def serve(host: Annotated[str | None, typer.Option(help="address to bind [env SHOAL_API_HOST; 127.0.0.1]")] = None,
          port: Annotated[int | None, typer.Option(help="TCP port [env SHOAL_API_PORT; 8700]")] = None,
          no_auth: Annotated[bool, typer.Option("--no-auth", help="serve without tokens on any address "
                                                "(anyone who reaches it controls every sandbox)")] = False,
          max_upload_mb: Annotated[float | None, typer.Option(help="largest file upload, MiB [64]")] = None,
          max_request_mb: Annotated[float | None, typer.Option(help="largest JSON request, MiB [8]")] = None,
          max_inflight: Annotated[int | None, typer.Option(help="requests in progress per token [1024]")] = None,
          create_concurrency: Annotated[int | None, typer.Option(help="sandboxes created at once [32]")] = None,
          log_level: Annotated[str | None, typer.Option(help="uvicorn log level [warning]")] = None,
          access_log: Annotated[bool, typer.Option(help="log every request")] = False,
          cluster: Annotated[str | None, typer.Option("--cluster", help="serve a whole Ray cluster: ray://ADDR "
                                                      "(a gateway to its node agents; see docs/cluster.md)")]
          = None) -> None:
    """Serve the HTTP API (REST + WebSocket streams, /openapi.json, /healthz, /metrics).

    Without any token configured the server binds loopback only; `shoal token create` turns auth on.
    Stopping the server (Ctrl-C, SIGTERM, even kill -9) keeps sandboxes running; the next server serves them.
    Every limit is also a setting (SHOAL_API_*, see docs/configuration.md); options given here win.
    With --cluster ray://ADDR it serves every node agent of a Ray cluster (tokens, projects and quotas
    cluster-wide; run `shoal cluster up` first).
    """
    from shoal.config import InvalidSetting, NodeConfig, Settings
    from shoal.node.node import Node
    from shoal.server.run import serve as run_serve
    from shoal.server.settings import ServerSettings

    # options are the "argument" layer of the settings (over file and environment), checked like the rest
    given = {"api_host": host, "api_port": port, "api_max_inflight": max_inflight,
             "api_create_concurrency": create_concurrency, "api_log_level": log_level,
             "api_max_upload_bytes": None if max_upload_mb is None else int(max_upload_mb * 2**20),
             "api_max_request_bytes": None if max_request_mb is None else int(max_request_mb * 2**20)}
    try:
        st = Settings.load(args=given, warn=lambda m: None)  # unknown variables: reported at CLI start
    except InvalidSetting as e:
        err_console.print(f"[red]error:[/red] {e.message}")
        raise typer.Exit(2) from None
    s = ServerSettings.from_settings(st, no_auth=no_auth, access_log=access_log)
    if cluster is not None:
        if not cluster.startswith("ray://"):
            err_console.print(f"[red]error:[/red] --cluster {cluster!r} must look like ray://ADDR")
            raise typer.Exit(2)
        run_serve(s, say=lambda m: print(m, file=sys.stderr, flush=True), cluster=cluster)
        return
    node = Node(NodeConfig.from_settings(st))
    run_serve(s, node=node, say=lambda m: print(m, file=sys.stderr, flush=True))  # plain lines: logs get parsed


@token_app.command("create")
def token_create(project: Annotated[str, typer.Option(help="project the token acts in")] = "default",
                 max_sandboxes: Annotated[int | None, typer.Option(help="project quota: sandboxes alive")] = None,
                 max_cpus: Annotated[float | None, typer.Option(help="project quota: CPUs promised")] = None,
                 max_memory_mb: Annotated[int | None, typer.Option(help="project quota: memory promised (MiB)")]
                 = None,
                 max_store_mb: Annotated[int | None, typer.Option(help="project quota: image store bytes "
                                                                  "(MiB; snapshots, forks, builds)")] = None,
                 admin: Annotated[bool, typer.Option("--admin", help="operator token: sees every project, "
                                                     "reads /metrics, builds and pulls images")] = False,
                 name: Annotated[str, typer.Option(help="a note to recognise the token by")] = "") -> None:
    """Make a token and print it once (only its hash is stored). Quota options set the project's quota."""
    from shoal.server.tokens import Quota

    q = Quota(max_sandboxes=max_sandboxes, max_cpus=max_cpus, max_memory_mb=max_memory_mb, max_store_mb=max_store_mb)
    try:
        tok = _store().create(project, admin=admin, name=name, quota=q)
    except Exception as e:
        err_console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    print(tok)
    err_console.print(f"token for project {project!r}{' (admin)' if admin else ''}: shown once, keep it "
                      "(export SHOAL_TOKEN=...; clients send 'Authorization: Bearer <token>')")


@token_app.command("ls")
def token_ls(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List tokens (ids, projects, quotas; never secrets)."""
    st = _store()
    toks = st.tokens()
    quotas = st.projects()
    if as_json:
        print(json.dumps({"tokens": [t.public() for t in toks],
                          "projects": {p: q.__dict__ for p, q in quotas.items()},
                          "policies": {p: q.__dict__ for p, q in st.policies().items()}}, indent=1))
        return
    t = Table(title=f"{len(toks)} tokens")
    for col in ("id", "project", "admin", "max sandboxes", "max cpus", "max MiB", "max store MiB", "created",
                "name"):
        t.add_column(col)
    for tok in toks:
        q = quotas.get(tok.project)

        def lim(v: object) -> str:
            return "-" if v is None else str(v)

        t.add_row(tok.id, tok.project, "yes" if tok.admin else "", lim(q and q.max_sandboxes), lim(q and q.max_cpus),
                  lim(q and q.max_memory_mb), lim(q and q.max_store_mb),
                  time.strftime("%Y-%m-%d %H:%M", time.localtime(tok.created)), tok.name)
    console.print(t)


@token_app.command("rm")
def token_rm(token_ids: Annotated[list[str], typer.Argument(help="token ids (or whole tokens)")]) -> None:
    """Revoke tokens (servers refuse them from the next request on)."""
    from shoal.errors import ShoalError

    st = _store()
    bad = 0
    for tid in token_ids:
        try:
            e = st.remove(tid)
            err_console.print(f"revoked {e.id} (project {e.project})")
        except ShoalError as e:
            bad += 1
            err_console.print(f"[red]error:[/red] {e.message}")
    raise typer.Exit(1 if bad else 0)


@token_app.command("quota")
def token_quota(project: Annotated[str, typer.Argument(help="project")],
                max_sandboxes: Annotated[int | None, typer.Option()] = None,
                max_cpus: Annotated[float | None, typer.Option()] = None,
                max_memory_mb: Annotated[int | None, typer.Option()] = None,
                max_store_mb: Annotated[int | None, typer.Option(help="image store bytes (MiB)")] = None) -> None:
    """Set a project's quota (options left out become unlimited)."""
    from shoal.server.tokens import Quota

    try:
        _store().set_quota(project, Quota(max_sandboxes, max_cpus, max_memory_mb, max_store_mb))
    except Exception as e:
        err_console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    err_console.print(f"quota of {project!r}: sandboxes={max_sandboxes}, cpus={max_cpus}, memory_mb={max_memory_mb}, "
                      f"store_mb={max_store_mb}")


@token_app.command("policy")
def token_policy(project: Annotated[str, typer.Argument(help="project")],
                 egress_allow: Annotated[list[str] | None, typer.Option(
                     "--egress-allow", help="a protected destination its sandboxes may reach: private, metadata, "
                     "reserved, cluster, or CIDR[:port] (repeat)")] = None,
                 priorities: Annotated[str | None, typer.Option(
                     help="priority classes it may use, comma-separated (default: the default class and "
                     "those below it)")] = None,
                 clear: Annotated[bool, typer.Option("--clear", help="back to the defaults")] = False,
                 as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Show or set what a project's sandboxes may ask for beyond the defaults: protected egress
    destinations (docs/security.md) and priority classes (docs/scheduling.md). Options given replace
    those fields; without options it prints the policy."""
    from shoal.server.tokens import ProjectPolicy

    st = _store()
    pol = ProjectPolicy() if clear else st.policy(project)
    if egress_allow is not None:
        pol.egress_allow = [g for item in egress_allow for g in item.replace(",", " ").split()]
    if priorities is not None:
        pol.priorities = [p.strip() for p in priorities.split(",") if p.strip()]
    if clear or egress_allow is not None or priorities is not None:
        try:
            st.set_policy(project, pol)
        except Exception as e:
            err_console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
    if as_json:
        print(json.dumps({"project": project, **pol.__dict__}, indent=1))
        return
    from shoal.server.policy import granted_priorities

    class _St:
        tokens = st

    err_console.print(f"policy of {project!r}: egress_allow={pol.egress_allow or 'none (the node setting only)'}, "
                      f"priorities={', '.join(granted_priorities(_St, project))}"
                      f"{'' if pol.priorities is not None else ' (default)'}")


def register(app: typer.Typer) -> None:
    """Add `serve` and `token` to the main CLI."""
    app.command("serve")(serve)
    app.add_typer(token_app, name="token")
