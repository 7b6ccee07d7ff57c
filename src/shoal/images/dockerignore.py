""".dockerignore as Docker reads it (moby's patternmatcher): Go `filepath.Match` patterns plus `**`, `!`
exceptions, later lines winning, and a pattern that matches a directory excluding everything below it.

    ign = DockerIgnore.load(Path("ctx"))
    ign.excluded("build/out.o")        # True / False
    files = context_files(Path("ctx"), ign)   # [(relative path, lstat)], sorted, excluded ones left out
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass
class _Pattern:
    text: str
    rx: re.Pattern[str]
    exclusion: bool


def _compile(pat: str) -> re.Pattern[str]:
    out = ["^"]
    i, n = 0, len(pat)
    while i < n:
        c = pat[i]
        if c == "*":
            if i + 1 < n and pat[i + 1] == "*":
                i += 2
                if i < n and pat[i] == "/":
                    i += 1
                    out.append("(?:.*/)?")  # **/ : zero or more directories
                else:
                    out.append(".*")
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pat.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pat[i + 1:j]
                if body.startswith("^"):
                    body = "!" + body[1:]
                out.append("[" + ("^" + re.escape(body[1:]).replace("\\-", "-") if body.startswith("!")
                                  else re.escape(body).replace("\\-", "-")) + "]")
                i = j
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pat[i]))
        else:
            out.append(re.escape(c))
        i += 1
    out.append("$")
    return re.compile("".join(out), re.S)


class DockerIgnore:
    """The patterns of one .dockerignore."""

    def __init__(self, lines: list[str]) -> None:
        self.patterns: list[_Pattern] = []
        for raw in lines:
            ln = raw.strip()
            if not ln or ln.startswith("#"):
                continue
            excl = ln.startswith("!")
            if excl:
                ln = ln[1:].strip()
            ln = posixpath.normpath(ln.replace("\\", "/") if os.sep == "\\" else ln).lstrip("/")
            if ln in ("", "."):
                if excl:
                    continue
                ln = "*"  # a bare "/" or "." excludes everything
            self.patterns.append(_Pattern(ln, _compile(ln), excl))

    @classmethod
    def load(cls, context: Path, dockerfile: Path | None = None) -> DockerIgnore:
        """The context's `.dockerignore` (or `<Dockerfile>.dockerignore` next to the Dockerfile, which BuildKit
        prefers); no file: nothing is ignored."""
        cands = []
        if dockerfile is not None:
            cands.append(Path(str(dockerfile) + ".dockerignore"))
        cands.append(Path(context) / ".dockerignore")
        for c in cands:
            if c.is_file():
                return cls(c.read_text(errors="replace").splitlines())
        return cls([])

    @property
    def has_exclusions(self) -> bool:
        """True when some `!pattern` may bring back a path below an excluded directory."""
        return any(p.exclusion for p in self.patterns)

    def excluded(self, rel: str) -> bool:
        """True when context path `rel` (relative, '/'-separated) is left out of the context."""
        if not self.patterns:
            return False
        rel = rel.strip("/")
        parents = []
        parts = rel.split("/")
        for k in range(1, len(parts)):
            parents.append("/".join(parts[:k]))
        matched = False
        for p in self.patterns:
            hit = bool(p.rx.match(rel)) or any(p.rx.match(par) for par in parents)
            if hit:
                matched = not p.exclusion
        return matched


def context_files(context: Path, ignore: DockerIgnore) -> list[tuple[str, os.stat_result]]:
    """Every path of the build context that is not ignored, with its lstat, sorted by path. A directory
    that is excluded is still listed when an exception (`!pattern`) brings back something below it."""
    context = Path(context)
    out: list[tuple[str, os.stat_result]] = []
    for dirpath, dirnames, filenames in os.walk(context):
        rel_dir = os.path.relpath(dirpath, context)
        rel_dir = "" if rel_dir == "." else rel_dir
        keep = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            st = os.lstat(os.path.join(dirpath, d))
            if ignore.excluded(rel):
                if ignore.has_exclusions and stat.S_ISDIR(st.st_mode):
                    keep.append(d)  # walk on: an exception may bring back a file inside
                continue
            out.append((rel, st))
            if stat.S_ISDIR(st.st_mode):
                keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if not ignore.excluded(rel):
                out.append((rel, os.lstat(os.path.join(dirpath, f))))
    if ignore.has_exclusions:
        # parents of brought-back files are part of the context even when their pattern excluded them
        have = {r for r, _ in out}
        for rel, _ in list(out):
            parts = rel.split("/")
            for k in range(1, len(parts)):
                par = "/".join(parts[:k])
                if par not in have:
                    have.add(par)
                    out.append((par, os.lstat(context / par)))
    out.sort(key=lambda x: x[0])
    return out
