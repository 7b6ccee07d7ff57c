"""Dockerfile syntax as BuildKit's Dockerfile frontend reads it: parser directives, line continuations,
heredocs, flags, JSON and shell forms, and the shell-like word expansion of `$VAR`, `${VAR:-default}`…

    df = parse_dockerfile(text, where="Dockerfile")
    for ins in df.instructions: ins.cmd, ins.flags, ins.args, ins.json, ins.heredocs, ins.line
    Lexer("\\\\").words('a "b c" $X', {"X": "d e"})   # -> ["a", "b c", "d", "e"]

Only the syntax lives here; what each instruction does is shoal.images.dockerbuild's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from shoal.errors import InvalidRequest

_DIRECTIVE = re.compile(r"^#\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(.*?)\s*$")
#: a heredoc marker: <<EOF, <<-EOF, <<"EOF", <<'EOF'
_HEREDOC = re.compile(r"<<(-?)(?:\"([^\"\s]+)\"|'([^'\s]+)'|([A-Za-z0-9_./-]+))")
HEREDOC_CMDS = frozenset({"RUN", "COPY", "ADD"})
#: instructions whose arguments the builder expands ($VAR) itself (RUN/CMD/ENTRYPOINT are the shell's)
EXPANDED = frozenset({"ADD", "COPY", "ENV", "EXPOSE", "FROM", "LABEL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
                      "ARG", "ONBUILD"})


@dataclass
class Heredoc:
    """One `<<NAME` document: its name, content (lines joined with newlines, ending in one), and whether
    variables in it are expanded (unquoted name) and leading tabs stripped (`<<-`)."""

    name: str
    content: str
    expand: bool
    chomp: bool


@dataclass
class Instruction:
    """One instruction: upper-case command, its `--flags` (a flag given twice keeps every value), the text
    after the flags, the JSON list when the arguments are one, and its heredocs."""

    cmd: str
    line: int
    original: str
    flags: list[tuple[str, str | None]] = field(default_factory=list)
    rest: str = ""
    json: list[str] | None = None
    heredocs: list[Heredoc] = field(default_factory=list)

    def flag(self, name: str, default: str | None = None) -> str | None:
        """The last value of `--name` ("" for a bare `--name`), or `default`."""
        val = default
        for k, v in self.flags:
            if k == name:
                val = "" if v is None else v
        return val

    def flag_all(self, name: str) -> list[str]:
        """Every value of a repeatable flag (`--mount`)."""
        return ["" if v is None else v for k, v in self.flags if k == name]


@dataclass
class Dockerfile:
    """A parsed Dockerfile: its directives (`syntax`, `escape`, `check`) and instructions."""

    instructions: list[Instruction]
    directives: dict[str, str]
    escape: str = "\\"


def _json_list(rest: str) -> list[str] | None:
    s = rest.strip()
    if not s.startswith("["):
        return None
    try:
        v = json.loads(s)
    except json.JSONDecodeError:
        return None
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return v
    return None


def _split_flags(rest: str) -> tuple[list[tuple[str, str | None]], str]:
    """Leading `--name[=value]` words (values may be quoted) and what follows them."""
    flags: list[tuple[str, str | None]] = []
    s = rest.lstrip()
    while s.startswith("--"):
        i, quote = 0, ""
        while i < len(s) and (quote or not s[i].isspace()):
            if quote and s[i] == quote:
                quote = ""
            elif not quote and s[i] in "\"'":
                quote = s[i]
            i += 1
        word, s = s[:i], s[i:].lstrip()
        if word == "--":
            break
        name, eq, val = word[2:].partition("=")
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "\"'":
            val = val[1:-1]
        flags.append((name.lower(), val if eq else None))
    return flags, s


def parse_dockerfile(text: str, where: str = "Dockerfile") -> Dockerfile:
    """Parse a Dockerfile; InvalidRequest names the file and line of the first error."""
    lines = text.splitlines()
    directives: dict[str, str] = {}
    i = 0
    # parser directives: only at the very top, before any instruction, blank line or other comment
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i].strip()) if lines[i].strip().startswith("#") else None
        if not m or m.group(1).lower() in directives:
            break
        directives[m.group(1).lower()] = m.group(2)
        i += 1
    escape = directives.get("escape", "\\")
    if escape not in ("\\", "`"):
        raise InvalidRequest(f"{where}:{i}: the escape directive must be \\ or `, not {escape!r}")
    out: list[Instruction] = []
    n = len(lines)
    while i < n:
        raw = lines[i]
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        start = i + 1
        # one logical line: physical lines joined while they end in the escape character (then optional
        # blanks), as BuildKit does: the escape goes, the next line's leading whitespace stays
        logical = ""
        first = True
        while i < n:
            cur = lines[i]
            i += 1
            if not first and cur.strip().startswith("#"):
                continue  # a comment line inside a continued instruction is dropped
            if not first and not cur.strip():
                continue  # so is an empty one
            cur = cur.lstrip() if first else cur
            first = False
            body = cur.rstrip(" \t\r")
            if body.endswith(escape):
                logical += body[:-1]
                continue
            logical += cur.rstrip("\r")
            break
        logical = logical.strip()
        m_word = re.match(r"(\S+)\s*(.*)\Z", logical, re.S)
        word, rest = (m_word.group(1), m_word.group(2)) if m_word else (logical, "")
        cmd = word.upper()
        if not re.fullmatch(r"[A-Z]+", cmd):
            raise InvalidRequest(f"{where}:{start}: cannot parse {logical[:80]!r}: an instruction starts with "
                                 "a keyword (FROM, RUN, COPY, …)")
        flags: list[tuple[str, str | None]] = []
        if cmd in ("RUN", "COPY", "ADD", "FROM", "HEALTHCHECK"):
            flags, rest = _split_flags(rest)
        ins = Instruction(cmd=cmd, line=start, original=logical, flags=flags, rest=rest.strip())
        ins.json = _json_list(ins.rest) if cmd in ("RUN", "CMD", "ENTRYPOINT", "SHELL", "COPY", "ADD", "VOLUME",
                                                    "HEALTHCHECK") else None
        if cmd in HEREDOC_CMDS and ins.json is None and "<<" in ins.rest:
            for m in _HEREDOC.finditer(ins.rest):
                name = m.group(2) or m.group(3) or m.group(4)
                doc_lines: list[str] = []
                while True:
                    if i >= n:
                        raise InvalidRequest(f"{where}:{start}: heredoc <<{name} has no terminating {name!r} line")
                    ln = lines[i]
                    i += 1
                    test = ln.lstrip("\t") if m.group(1) else ln
                    if test.rstrip("\r") == name:
                        break
                    doc_lines.append(test if m.group(1) else ln)
                ins.heredocs.append(Heredoc(name=name, content="".join(b + "\n" for b in doc_lines),
                                            expand=m.group(4) is not None, chomp=bool(m.group(1))))
        out.append(ins)
    return Dockerfile(instructions=out, directives=directives, escape=escape)


class Lexer:
    """BuildKit's shell-word processing: quotes, the escape character and `$` expansions
    (`$V`, `${V}`, `${V:-w}`, `${V-w}`, `${V:+w}`, `${V+w}`, `${V:?m}`, `${V#p}`, `${V%p}`, `${V/p/r}`)."""

    def __init__(self, escape: str = "\\") -> None:
        self.escape = escape

    def word(self, s: str, env: dict[str, str]) -> str:
        """One word: quotes removed, escapes applied, variables expanded (no splitting)."""
        return "".join(w for w, _ in self._scan(s, env, split=False)) if s else ""

    def words(self, s: str, env: dict[str, str]) -> list[str]:
        """Words split on unquoted whitespace (an unquoted expansion splits too, as in the shell)."""
        out: list[str] = []
        cur: list[str] = []
        has = False
        for piece, brk in self._scan(s, env, split=True):
            if brk:
                if has:
                    out.append("".join(cur))
                cur, has = [], False
                continue
            cur.append(piece)
            has = True
        if has:
            out.append("".join(cur))
        return out

    def expand(self, s: str, env: dict[str, str]) -> str:
        """Only `$` expansions (JSON-form arguments): quotes and escapes stay as they are, except `\\$`."""
        out: list[str] = []
        i = 0
        while i < len(s):
            c = s[i]
            if c == self.escape and i + 1 < len(s) and s[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if c == "$":
                val, i = self._dollar(s, i, env)
                out.append(val)
                continue
            out.append(c)
            i += 1
        return "".join(out)

    # (piece, is_break) pairs; a break separates words when splitting
    def _scan(self, s: str, env: dict[str, str], split: bool) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        i = 0
        n = len(s)
        esc = self.escape
        while i < n:
            c = s[i]
            if split and c.isspace():
                out.append(("", True))
                i += 1
                continue
            if c == esc:
                if i + 1 < n:
                    out.append((s[i + 1], False))
                    i += 2
                else:
                    out.append((c, False))
                    i += 1
                continue
            if c == "'":
                j = s.find("'", i + 1)
                if j < 0:
                    raise InvalidRequest(f"unexpected end of statement while looking for matching single-quote "
                                         f"in {s[:80]!r}")
                out.append((s[i + 1:j], False))
                out.append(("", False))  # '' is a word of its own
                i = j + 1
                continue
            if c == '"':
                i += 1
                buf: list[str] = []
                while True:
                    if i >= n:
                        raise InvalidRequest(f"unexpected end of statement while looking for matching double-quote "
                                             f"in {s[:80]!r}")
                    d = s[i]
                    if d == '"':
                        i += 1
                        break
                    if d == esc and i + 1 < n:
                        nxt = s[i + 1]
                        if nxt in ('"', "$", esc):
                            buf.append(nxt)
                        else:
                            buf.append(d + nxt)
                        i += 2
                        continue
                    if d == "$":
                        val, i = self._dollar(s, i, env)
                        buf.append(val)
                        continue
                    buf.append(d)
                    i += 1
                out.append(("".join(buf), False))
                continue
            if c == "$":
                val, i = self._dollar(s, i, env)
                if split:
                    # an unquoted expansion splits on whitespace
                    pieces = re.split(r"(\s+)", val)
                    for k, p in enumerate(pieces):
                        if k % 2:
                            out.append(("", True))
                        elif p:
                            out.append((p, False))
                else:
                    out.append((val, False))
                continue
            out.append((c, False))
            i += 1
        # drop the empty '' markers that are not words of their own
        return out

    def _dollar(self, s: str, i: int, env: dict[str, str]) -> tuple[str, int]:
        """Expand the `$…` at s[i]; (value, index after it)."""
        n = len(s)
        if i + 1 >= n:
            return "$", i + 1
        c = s[i + 1]
        if c == "{":
            depth, j = 1, i + 2
            while j < n and depth:
                if s[j] == "{":
                    depth += 1
                elif s[j] == "}":
                    depth -= 1
                j += 1
            if depth:
                raise InvalidRequest(f"missing '}}' in {s[:80]!r}")
            return self._brace(s[i + 2:j - 1], env), j
        m = re.match(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]", s[i + 1:])
        if not m:
            return "$", i + 1
        return env.get(m.group(0), ""), i + 1 + m.end()

    def _brace(self, body: str, env: dict[str, str]) -> str:
        m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)", body)
        if not m:
            raise InvalidRequest(f"bad substitution ${{{body}}}")
        name = m.group(1)
        rest = body[m.end():]
        val = env.get(name)
        if not rest:
            return val or ""
        for op in (":-", ":+", ":?", "-", "+", "?"):
            if rest.startswith(op):
                word = self.word(rest[len(op):], env) if rest[len(op):] else ""
                unset = val is None or (op.startswith(":") and val == "")
                if op.endswith("-"):
                    return word if unset else (val or "")
                if op.endswith("+"):
                    return "" if unset else word
                if unset:
                    raise InvalidRequest(f"{name}: {word or 'is not set'}")
                return val or ""
        if rest[0] in "#%":
            longest = rest[:2] in ("##", "%%")
            pat = self.word(rest[2 if longest else 1:], env)
            return _trim(val or "", pat, prefix=rest[0] == "#", longest=longest)
        if rest[0] == "/":
            every = rest.startswith("//")
            body2 = rest[2 if every else 1:]
            pat, _, repl = body2.partition("/")
            rx = _glob_rx(self.word(pat, env))
            repl = self.word(repl, env)
            return re.sub(rx, lambda _m: repl, val or "", count=0 if every else 1)
        raise InvalidRequest(f"unsupported modifier ({rest[:10]}) in substitution ${{{body}}}")


def _glob_rx(pat: str) -> str:
    out = []
    for ch in pat:
        out.append(".*?" if ch == "*" else "." if ch == "?" else re.escape(ch))
    return "".join(out)


def _trim(val: str, pat: str, prefix: bool, longest: bool) -> str:
    rx = _glob_rx(pat).replace(".*?", ".*" if longest else ".*?")
    if prefix:
        m = re.match(rx, val)
        if longest:
            m = re.match(f"(?:{rx})", val)
        if not m:
            return val
        # shortest/longest prefix match
        cands = [k for k in range(len(val) + 1) if re.fullmatch(rx, val[:k])]
        if not cands:
            return val
        k = max(cands) if longest else min(cands)
        return val[k:]
    cands = [k for k in range(len(val) + 1) if re.fullmatch(rx, val[k:])]
    if not cands:
        return val
    k = min(cands) if longest else max(cands)
    return val[:k]
