"""`shoal fncall` — run snippets on the warm pools, build the fncall image, serve SandboxFusion's API."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from shoal.cli.common import console, err_console, make_client, run_async

fncall_app = typer.Typer(help="The function-call backend: short code runs on warm pools of containers.",
                         no_args_is_help=True)

UrlOpt = Annotated[str | None, typer.Option("--url", help="API server (default: embedded node; env SHOAL_URL)")]


def _read_code(source: str | None, code: str | None) -> str:
    if code is not None:
        return code
    if source in (None, "-"):
        if sys.stdin.isatty():
            err_console.print("[red]error:[/red] give a file, `-c CODE`, or pipe the code on stdin")
            raise typer.Exit(2)
        return sys.stdin.read()
    p = Path(source)
    if not p.is_file():
        err_console.print(f"[red]error:[/red] no such file: {source}")
        raise typer.Exit(2)
    return p.read_text()


def _guess_language(source: str | None) -> str:
    ext = Path(source).suffix.lower() if source and source != "-" else ""
    return {".sh": "bash", ".c": "c", ".cc": "cpp", ".cpp": "cpp", ".cxx": "cpp", ".go": "go", ".java": "java",
            ".js": "nodejs", ".mjs": "nodejs", ".ts": "typescript", ".rs": "rust"}.get(ext, "python")


@fncall_app.command("run")
def run_cmd(source: Annotated[str | None, typer.Argument(help="file with the code ('-' or none: stdin)")] = None,
            code: Annotated[str | None, typer.Option("-c", help="the code itself")] = None,
            language: Annotated[str | None, typer.Option(
                "--language", "-l", help="python, bash, sh, c, cpp, go, java, nodejs, typescript, rust, pytest "
                             "(default: by extension)")] = None,
            stdin: Annotated[str | None, typer.Option("--stdin", help="text fed to the program's stdin")] = None,
            stdin_file: Annotated[Path | None, typer.Option("--stdin-file", help="file fed to stdin")] = None,
            file: Annotated[list[str] | None, typer.Option("--file", "-f",
                                                           help="LOCAL[:PATH] put into the working dir")] = None,
            timeout: Annotated[float | None, typer.Option(help="run timeout, seconds (default 10)")] = None,
            compile_timeout: Annotated[float | None, typer.Option(help="compile timeout, seconds")] = None,
            memory_mb: Annotated[int | None, typer.Option(help="memory limit, MiB (default 1024)")] = None,
            image: Annotated[str | None, typer.Option(
                help="image (default: the language's, see `shoal fncall languages`)")] = None,
            as_json: Annotated[bool, typer.Option("--json", help="print the whole result as JSON")] = False,
            url: UrlOpt = None) -> None:
    """Run a snippet in a fresh process of a warm pooled container: `shoal fncall run -c 'print(1+1)'`."""
    text = _read_code(source, code)
    lang = language or _guess_language(source)
    kw: dict[str, Any] = {"timeout": timeout, "compile_timeout": compile_timeout, "memory_mb": memory_mb}
    if image:
        kw["image"] = image
    if stdin_file is not None:
        kw["stdin"] = stdin_file.read_bytes()
    elif stdin is not None:
        kw["stdin"] = stdin
    files: dict[str, bytes] = {}
    for spec in file or []:
        local, _, remote = spec.partition(":")
        files[remote or Path(local).name] = Path(local).read_bytes()
    if files:
        kw["files"] = files

    async def go() -> Any:
        async with make_client(url, keep=False) as client:
            return await client.run_code(text, language=lang, **{k: v for k, v in kw.items() if v is not None})

    from shoal.models import RunCodeResult

    r = run_async(go)
    if isinstance(r, dict):  # an HTTP transport answers with the result's JSON form
        r = RunCodeResult.from_dict(r)
    if as_json:
        print(json.dumps(r.to_dict(), indent=1))
    else:
        if r.compile is not None and (r.compile.stderr or r.compile.stdout):
            out = r.compile.stdout + r.compile.stderr
            sys.stderr.buffer.write(out if isinstance(out, bytes) else out.encode())
        sys.stdout.buffer.write(r.stdout if isinstance(r.stdout, bytes) else r.stdout.encode())
        sys.stderr.buffer.write(r.stderr if isinstance(r.stderr, bytes) else r.stderr.encode())
        sys.stdout.flush()
        if r.status != "success":
            detail = f": {r.error}" if r.error else ""
            err_console.print(f"[yellow]{r.status}[/yellow] (exit {r.exit_code}){detail}")
        if r.truncated:
            err_console.print("[yellow]output truncated[/yellow]")
    codes = {"success": 0, "timeout": 124, "compile_error": 1, "compile_timeout": 124, "error": 1}
    raise typer.Exit(codes.get(r.status, r.exit_code if 0 < r.exit_code < 256 else 1))


@fncall_app.command("setup")
def setup_cmd(ref: Annotated[str | None, typer.Option(help="image to build (default: fncall:latest)")] = None,
              all_: Annotated[bool, typer.Option("--all", help="also the image of go, java, nodejs, typescript, "
                                                             "rust and pytest (about 1 GB of packages)")] = False,
              language: Annotated[list[str] | None,
                                  typer.Option("--language", "-l", help="build what LANG runs in (repeatable)")] = None,
              rebuild: Annotated[bool, typer.Option(help="build even if the image exists")] = False) -> None:
    """Build the images fncall languages run in: `fncall` (base + gcc, g++) for c and cpp by default; with
    `--all` or `--language go` the larger one with Go, a JDK, Node.js, esbuild, rustc and pytest. Without
    this, each is built on the first call that needs it."""
    from shoal.backends.fncall_image import LANGS_RECIPE, build_fncall_image, ensure_fncall_image
    from shoal.backends.fncall_languages import FNCALL_IMAGE, get_language
    from shoal.node.node import Node

    refs = [ref] if ref else []
    refs += [get_language(x).image for x in language or []]
    if all_:
        refs += [FNCALL_IMAGE, LANGS_RECIPE.ref]
    refs = [r for r in dict.fromkeys(refs or [FNCALL_IMAGE]) if r != "base:latest"]

    async def go() -> None:
        node = Node()
        await node.start(reap=False, reconcile=False)
        try:
            for r in refs:
                if node.store.exists(r) and not rebuild:
                    console.print(f"{r} already exists (use --rebuild to build it again)")
                    continue
                with console.status(f"building {r}…") as status:
                    def log(line: str) -> None:
                        status.update(line[:100])
                        err_console.print(f"  {line}", highlight=False, markup=False)

                    if rebuild:
                        await build_fncall_image(node, r, log=log)
                    else:
                        await ensure_fncall_image(node, r, log=log)
                console.print(f"[green]built[/green] {r}")
        finally:
            await node.stop()

    run_async(go)


@fncall_app.command("serve")
def serve_cmd(host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
              port: Annotated[int, typer.Option(help="port")] = 8080,
              warm: Annotated[list[str] | None,
                              typer.Option(help="LANG=N workers to start first, e.g. python=4")] = None,
              log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "warning") -> None:
    """Serve SandboxFusion's API (`POST /run_code`, `/run_code_many`) alone, on an embedded node.

    Point SandboxFusion clients at it (e.g. `sandbox_fusion.set_endpoint("http://127.0.0.1:8080")`).
    It has no authentication: keep it on loopback, or use `shoal serve`, which includes the same routes.
    """
    import uvicorn

    from shoal.server.fusion import create_fusion_app

    pools: dict[str, int] = {}
    for w in warm or []:
        lang, _, n = w.partition("=")
        pools[lang] = int(n or 2)
    err_console.print(f"shoal fncall: SandboxFusion-compatible API on http://{host}:{port}/run_code")
    uvicorn.run(create_fusion_app(warm=pools), host=host, port=port, log_level=log_level)


@fncall_app.command("languages")
def languages_cmd() -> None:
    """The languages run_code accepts, how each is compiled and run, and its default image."""
    from rich.table import Table

    from shoal.backends.fncall_languages import LANGUAGES

    t = Table(title="fncall languages")
    for col in ("language", "aliases", "compile", "run", "image"):
        t.add_column(col)
    for lang in LANGUAGES.values():
        t.add_row(lang.name, ", ".join(lang.aliases), " ".join(lang.compile or ()) or "-",
                  "fork of the warm interpreter" if lang.mode == "python" else " ".join(lang.run), lang.image)
    console.print(t)
