"""Languages of the fncall backend: how to write, compile and run a snippet of each.

A language is data: the source file name, an optional compile command and a run command (argv run in
the call's fresh working directory), the tools the image must have, the image used by default, and
environment variables its tools need. `python` is special: its run step is not an exec but a fork of the
pool's warm interpreter.

The names are SandboxFusion's (`python`, `cpp`, `go`, `java`, `nodejs`, `typescript`, `rust`, `pytest`,
`bash`, ...), and so are the commands where it matters for a verdict: Java's class is `Main`, Rust is
compiled without optimisation or edition flags as SandboxFusion's `rustc file -o test`, TypeScript is
transpiled without type checking (SandboxFusion runs `tsx`; here Debian's esbuild, then node), pytest runs
the snippet as a test file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.errors import InvalidRequest

#: image with gcc/g++ added to `base` (built by `shoal fncall setup` or on first use)
FNCALL_IMAGE = "fncall:latest"
BASE_IMAGE = "base:latest"


def _langs_image() -> str:
    from shoal.backends.fncall_image import LANGS_RECIPE

    return LANGS_RECIPE.ref


#: image with Go, a JDK, Node.js + esbuild, rustc and pytest added to `fncall` (built on first use)
LANGS_IMAGE = _langs_image()
# The JVM reserves far more address space than it uses (heap, code cache, class space): under an address-space
# rlimit it does not start, so its steps are bounded by the pooled container's memory limit instead.
_JVM_FLAGS = ("-XX:+UseSerialGC", "-XX:-UsePerfData", "-Xshare:auto")
#: javac is a short JVM run: the C1 compiler alone starts it faster (the program itself keeps full tiering)
_JAVAC_FLAGS = (*_JVM_FLAGS, "-XX:TieredStopAtLevel=1")


@dataclass(frozen=True)
class Language:
    """How one language is run; see the module docstring."""

    name: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    tools: tuple[str, ...] = ()
    image: str = BASE_IMAGE
    #: "python": fork the warm interpreter; "exec": exec `run`
    mode: str = "exec"
    aliases: tuple[str, ...] = ()
    #: environment every step gets (under the caller's own `env`)
    env: tuple[tuple[str, str], ...] = field(default=())
    #: False for runtimes that reserve much more address space than they use (the JVM, V8): their run step
    #: gets no RLIMIT_AS; the pooled container's memory limit (memory_mb + the worker's share) bounds them
    limit_address_space: bool = True

    @property
    def compiled(self) -> bool:
        """True when the language has a compile step."""
        return self.compile is not None


LANGUAGES: dict[str, Language] = {
    lang.name: lang for lang in (
        Language("python", "main.py", ("python3", "main.py"), tools=("python3",), mode="python",
                 aliases=("python3", "py")),
        Language("bash", "main.sh", ("bash", "main.sh"), tools=("bash",), aliases=("shell",)),
        Language("sh", "main.sh", ("sh", "main.sh"), tools=("sh",)),
        Language("c", "main.c", ("./main",),
                 compile=("gcc", "-std=gnu17", "-O2", "-pipe", "-o", "main", "main.c", "-lm"),
                 tools=("gcc",), image=FNCALL_IMAGE),
        Language("cpp", "main.cpp", ("./main",),
                 compile=("g++", "-std=gnu++17", "-O2", "-pipe", "-o", "main", "main.cpp", "-lm", "-lpthread"),
                 tools=("g++",), image=FNCALL_IMAGE, aliases=("c++", "cxx")),
        Language("go", "main.go", ("./main",), compile=("go", "build", "-o", "main", "main.go"),
                 tools=("go",), image=LANGS_IMAGE, aliases=("golang",),
                 # a fresh build cache per call (in the call's directory, cleaned with it); no cgo, so no C
                 # toolchain in the way; GOFLAGS/GOPROXY: never reach for the network
                 env=(("GOCACHE", "/sandbox/.cache/go-build"), ("HOME", "/sandbox"), ("CGO_ENABLED", "0"),
                      ("GOPROXY", "off"), ("GOFLAGS", "-mod=mod"), ("GOTOOLCHAIN", "local"))),
        Language("java", "Main.java", ("java", *_JVM_FLAGS, "-ea", "-cp", ".", "Main"),
                 compile=("javac", *(f"-J{f}" for f in _JAVAC_FLAGS), "-encoding", "UTF-8", "-cp", ".",
                          "Main.java"),
                 tools=("java", "javac"), image=LANGS_IMAGE, limit_address_space=False),
        Language("nodejs", "main.js", ("node", "main.js"), tools=("node",), image=LANGS_IMAGE,
                 aliases=("javascript", "js", "node"), limit_address_space=False),
        # one run step, as SandboxFusion's `tsx main.ts`: a syntax error is the run's failure, not a compile step
        Language("typescript", "main.ts",
                 ("sh", "-c", 'esbuild main.ts --outfile=main.js --format=cjs --platform=node --log-level=error'
                              ' && exec node main.js "$@"', "main.ts"),
                 tools=("esbuild", "node"), image=LANGS_IMAGE, aliases=("ts",), limit_address_space=False),
        Language("rust", "main.rs", ("./main",), compile=("rustc", "main.rs", "-o", "main"),
                 tools=("rustc",), image=LANGS_IMAGE, aliases=("rs",), env=(("HOME", "/sandbox"),)),
        Language("pytest", "test_main.py", ("python3", "-m", "pytest", "-p", "no:cacheprovider", "test_main.py"),
                 tools=("python3",), image=LANGS_IMAGE),
    )
}
_ALIASES = {alias: lang.name for lang in LANGUAGES.values() for alias in lang.aliases}

#: every tool a worker reports on at startup (so a missing compiler is named before a call fails)
ALL_TOOLS = sorted({t for lang in LANGUAGES.values() for t in lang.tools})


def supported() -> list[str]:
    """Names of the languages run_code accepts (aliases not included)."""
    return list(LANGUAGES)


def get_language(name: str) -> Language:
    """The Language called `name` (or one of its aliases); InvalidRequest names the supported ones."""
    if not isinstance(name, str):
        raise InvalidRequest(f"language must be a string, not {type(name).__name__}")
    key = name.strip().lower()
    lang = LANGUAGES.get(key) or LANGUAGES.get(_ALIASES.get(key, ""))
    if lang is None:
        raise InvalidRequest(f"unknown language {name!r}: the fncall backend runs {', '.join(supported())}")
    return lang
