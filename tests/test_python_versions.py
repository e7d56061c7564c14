"""The supported Python range has one home (pyproject's ``requires-python``) and everyone agrees.

pip enforces it at install; ``tools/python_fits.py``/``tools/find_python`` (the Makefile's
interpreter search), the doctor's ``python.version`` check, the Makefile's default candidates,
the README and ``.ci/run`` must say the same. Change the range in pyproject.toml and these fail
until the rest follow.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from wan_s2v_runner.preflight.checks_python import check_python, supported_minors, supported_python
from wan_s2v_runner.preflight.context import CheckContext
from wan_s2v_runner.preflight.core import Status
from wan_s2v_runner.preflight.facts import MachineFacts

ROOT = Path(__file__).resolve().parent.parent
MACHINES = ROOT / "tests" / "data" / "machines"


def pyproject_spec() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.MULTILINE).group(1)


def minors() -> list:
    return supported_minors(supported_python())


def test_doctor_reads_the_same_range_as_pyproject():
    from packaging.specifiers import SpecifierSet

    assert supported_python() == SpecifierSet(pyproject_spec())
    assert len(minors()) >= 2 and minors()[0] == "3.10"


def test_makefile_helper_agrees_and_judges_this_interpreter():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "python_fits.py"), "--minors"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == list(reversed(minors()))  # newest first: the order the Makefile tries them
    here = subprocess.run([sys.executable, str(ROOT / "tools" / "python_fits.py")])
    assert here.returncode == 0  # the suite runs on a supported Python


def test_makefile_default_candidates_are_the_supported_minors():
    make = (ROOT / "Makefile").read_text()
    candidates = re.search(r"^PYTHON \?= (.+)$", make, re.MULTILINE).group(1).split()
    assert candidates == ["python3"] + [f"python{m}" for m in reversed(minors())]


def test_readme_states_the_range():
    readme = (ROOT / "README.md").read_text()
    assert f"Python {minors()[0]}-{minors()[-1]}" in readme
    assert "Python 3.10+" not in readme


def test_find_python_prints_a_fitting_interpreter_or_one_line_why(tmp_path):
    ok = subprocess.run([str(ROOT / "tools" / "find_python"), str(tmp_path / "nope"), sys.executable],
                        capture_output=True, text=True)
    assert ok.returncode == 0
    assert Path(ok.stdout.strip()).resolve() == Path(sys.executable).resolve()
    fake = tmp_path / "python-too-new"  # runs, but says it is unsupported (as python_fits would)
    fake.write_text("#!/bin/sh\necho 'Python 3.99.0'; exit 1\n")
    fake.chmod(0o755)
    bad = subprocess.run([str(ROOT / "tools" / "find_python"), str(fake), str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1, bad.stderr
    assert " ".join(reversed(minors())) in lines[0] and "make PYTHON=" in lines[0]
    assert "nope (not runnable)" in lines[0]


def facts_with_python(version: str) -> MachineFacts:
    raw = json.loads((MACHINES / "cpu_only.json").read_text())
    raw["python"] = version
    return MachineFacts(raw)


def test_doctor_python_check_inside_and_outside_the_range():
    for version in ("3.10.12", "3.12.1"):
        r = check_python(CheckContext.for_values({}, facts_with_python(version)))
        assert r.status is Status.OK, r.finding
    for version in ("3.9.18", "3.13.0"):
        r = check_python(CheckContext.for_values({}, facts_with_python(version)))
        assert r.status is Status.FAIL
        assert version in r.finding and pyproject_spec().split(",")[0] in str(r.finding)
        assert f"make PYTHON=python{minors()[-1]}" in r.fix
