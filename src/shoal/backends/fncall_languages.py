"""Languages of the fncall backend: how to write, compile and run a snippet of each.

A language is data: the source file name, an optional compile command and a run command (argv run in
the call's fresh working directory), the tools the image must have, and the image used by default.
`python` is special: its run step is not an exec but a fork of the pool's warm interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.errors import InvalidRequest

#: image with gcc/g++ added to `base` (built by `shoal fncall setup` or on first use)
FNCALL_IMAGE = "fncall:latest"
BASE_IMAGE = "base:latest"


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
