"""Does the Python running this script fit wan-s2v's ``requires-python``? (Makefile helper.)

The supported range has one home, ``pyproject.toml``'s ``requires-python``; this script reads it
with the standard library only (it runs on whatever interpreter the Makefile is trying, before any
venv exists, so no ``packaging``/``tomllib``) and answers with its exit status:

    python3.12 tools/python_fits.py            # exit 0 if it fits, else 1 and one line why
    python3 tools/python_fits.py --minors      # the supported minor versions, newest first

Only the clause forms pyproject uses are understood (``>=X.Y``, ``<X.Y``, ``<=X.Y``, ``>X.Y``,
``==X.Y.*``); anything else is an error, so a new form cannot be silently misread.
"""
from __future__ import annotations

import operator
import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}
CLAUSE = re.compile(r"^(>=|<=|==|>|<)\s*(\d+)\.(\d+)(\.\*)?$")


def requires_python(text: str) -> str:
    m = re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if not m:
        raise SystemExit(f"no requires-python in {PYPROJECT}")
    return m.group(1)


def fits(spec: str, minor: tuple) -> bool:
    """Whether Python ``minor`` (major, minor) satisfies every clause of ``spec``."""
    for clause in (c.strip() for c in spec.split(",") if c.strip()):
        m = CLAUSE.match(clause)
        if not m:
            raise SystemExit(f"tools/python_fits.py does not understand the clause {clause!r}")
        op, want = m.group(1), (int(m.group(2)), int(m.group(3)))
        if not OPS[op](tuple(minor), want):
            return False
    return True


def supported_minors(spec: str) -> list:
    return [f"3.{m}" for m in range(30, 5, -1) if fits(spec, (3, m))]


def main(argv: list) -> int:
    spec = requires_python(PYPROJECT.read_text(encoding="utf-8"))
    if argv[1:] == ["--minors"]:
        print(" ".join(supported_minors(spec)))
        return 0
    here = sys.version_info[:2]
    if fits(spec, here):
        return 0
    print(f"Python {sys.version.split()[0]} ({sys.executable}) is outside wan-s2v's supported "
          f"range {spec} ({', '.join(reversed(supported_minors(spec)))})")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
