#!/usr/bin/env python3
"""mypy with a baseline: `make lint` fails on type errors that are not in scripts/mypy-baseline.txt.

The modules under strict checking (pyproject.toml [tool.mypy] overrides: shoal.sdk, shoal.models,
shoal.spec, shoal.limits, shoal.config) have no baseline entries: any error there fails. Elsewhere the
baseline records the errors the code had when mypy was introduced, so new code gets no new ones while old
ones are fixed over time.

    python scripts/mypy_baseline.py            # check (exit 1 on errors not in the baseline)
    python scripts/mypy_baseline.py --update   # rewrite the baseline from the current errors (only shrink it)

An entry is `path: message  [code]` without the line number (lines move with every edit); the same error
twice in one file is two entries. Errors fixed since the baseline was written are reported, so the
baseline can be shrunk with --update.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "scripts" / "mypy-baseline.txt"
#: modules that must stay free of type errors (strict in pyproject.toml): never baselined
STRICT = ("src/shoal/sdk/", "src/shoal/models.py", "src/shoal/spec.py", "src/shoal/limits.py", "src/shoal/config.py")
_LINE = re.compile(r"^(?P<path>[^:]+\.py):(?P<line>\d+)(?::\d+)?: error: (?P<msg>.*)$")


def run_mypy() -> tuple[list[str], list[str], int]:
    """(normalised errors, raw error lines, mypy's exit code)."""
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash)
        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit(2)
    norm, raw = [], []
    for ln in r.stdout.splitlines():
        m = _LINE.match(ln)
        if m:
            norm.append(f"{m['path']}: {m['msg']}")
            raw.append(ln)
    return norm, raw, r.returncode


def read_baseline() -> collections.Counter[str]:
    """The baseline's entries with their counts."""
    if not BASELINE.exists():
        return collections.Counter()
    return collections.Counter(ln for ln in BASELINE.read_text().splitlines() if ln and not ln.startswith("#"))


def main(argv: list[str] | None = None) -> int:
    """Check against the baseline, or rewrite it with --update."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--update", action="store_true", help="rewrite the baseline from the current errors")
    args = ap.parse_args(argv)
    norm, raw, _ = run_mypy()
    now = collections.Counter(norm)
    strict = [ln for ln in raw if ln.startswith(STRICT)]
    if args.update:
        if strict:
            print("type errors in strictly checked modules are never baselined; fix them:\n" + "\n".join(strict))
            return 1
        grew = now - read_baseline()
        header = ("# mypy errors tolerated in code written before mypy ran in `make lint` (scripts/mypy_baseline.py).\n"
                  "# Shrink it with `make mypy-baseline` after fixing some; never add to it by hand.\n")
        BASELINE.write_text(header + "".join(f"{e}\n" for e in sorted(now.elements())))
        print(f"wrote {BASELINE.relative_to(ROOT)}: {sum(now.values())} entries"
              + (f" ({sum(grew.values())} more than before)" if grew else ""))
        return 0
    base = read_baseline()
    new = now - base
    fixed = base - now
    if fixed:
        print(f"mypy: {sum(fixed.values())} baselined error(s) are fixed: shrink the baseline with "
              "`make mypy-baseline`")
    if new or strict:
        shown = [ln for ln in raw if (m := _LINE.match(ln)) and (f"{m['path']}: {m['msg']}" in new
                                                                 or ln.startswith(STRICT))]
        print("mypy: type errors not in the baseline (scripts/mypy-baseline.txt):")
        print("\n".join(shown))
        return 1
    print(f"mypy: no new type errors ({sum(now.values())} baselined in code written before mypy was checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
