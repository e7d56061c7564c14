"""The venv check (``wan_s2v_runner.loading.venv_check``): every third-party module the code
imports is on its lists, and a package whose native library does not load is named, with the
file it was installed from and the fix, by the set-up's check and by ``wan-s2v doctor``."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli
from wan_s2v_runner.loading import venv_check

PRODUCT_ROOTS = ("wan_s2v_runner", "patches", "runners")
DEV_ROOTS = ("tests", "tools", "bench")


def third_party_imports(roots) -> dict:
    """Top-level module -> a file that imports it (every import, lazy ones included), for the
    modules that are neither the standard library's nor this project's."""
    ours = {"wan_s2v_runner", "patches", "runners", "tests"} | {
        p.stem for root in DEV_ROOTS for p in (ROOT / root).rglob("*.py")}
    found: dict = {}
    for root in roots:
        for path in (ROOT / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ours:
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_the_lists_hold_every_module_the_code_imports():
    """Add an import of a new package and this fails until the check loads it too (or says why not)."""
    listed = {m.name for m in venv_check.modules(dev=False)} | venv_check.OPTIONAL | {"tomli"}
    product = third_party_imports(PRODUCT_ROOTS)
    missing = {m: f for m, f in product.items() if m not in listed}
    assert not missing, f"imported by the product but not in venv_check's lists: {missing}"
    listed_dev = listed | {m.name for m in venv_check.DEV}
    dev = third_party_imports(DEV_ROOTS)
    missing = {m: f for m, f in dev.items() if m not in listed_dev}
    assert not missing, f"imported by tests/tools/bench but not in venv_check's lists: {missing}"


def test_each_module_names_an_installed_distribution():
    """The package a failure names is the one installed (a wrong name would send the fix elsewhere)."""
    import importlib.metadata as md

    for m in venv_check.modules(dev=True):
        assert md.version(m.dist), m


def fake_site(tmp_path: Path) -> Path:
    """A site directory ahead of the venv's: soundfile 0.14.0 installed from its generic wheel,
    whose import loads a libsndfile this machine does not have (what soundfile does: ctypes)."""
    site = tmp_path / "site"
    (site / "soundfile-0.14.0.dist-info").mkdir(parents=True)
    (site / "soundfile.py").write_text("import ctypes\n\n_lib = ctypes.CDLL('libsndfile-not-on-this-machine.so.1')\n")
    info = site / "soundfile-0.14.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: soundfile\nVersion: 0.14.0\n")
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py2-none-any\nTag: py3-none-any\n")
    (info / "direct_url.json").write_text(json.dumps(
        {"url": "file:///idx/files/soundfile-0.14.0-py2.py3-none-any.whl", "archive_info": {}}))
    return site


@pytest.mark.slow(seconds=20)
def test_a_native_library_that_does_not_load_is_named_with_its_file_and_fix(tmp_path):
    """The set-up's check (exit 1, one line) and the doctor (a failing ``python.packages``) on the
    same broken site; the venv's own verdict is left as it was."""
    import os

    before = venv_check._kept()
    env = {"PYTHONPATH": os.pathsep.join([str(fake_site(tmp_path)), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "wan_s2v_runner.loading.venv_check"], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("venv check: soundfile 0.14.0 (soundfile-0.14.0-py2.py3-none-any.whl): "
                           "import soundfile fails: OSError: libsndfile-not-on-this-machine.so.1"), line
    assert "fix: install soundfile's manylinux wheel, which carries libsndfile" in line, line

    doctor = run_cli(["doctor", "--device", "cpu", "--json"], cwd=tmp_path, env=env)
    report = json.loads(doctor.stdout)
    got = [r for r in report["results"] if r["id"] == "python.packages"]
    assert [r["status"] for r in got] == ["fail"], got
    assert got[0]["finding"].startswith("soundfile 0.14.0 (soundfile-0.14.0-py2.py3-none-any.whl): import "
                                        "soundfile fails: OSError"), got
    assert "apt-get install libsndfile1" in got[0]["fix"], got
    assert doctor.returncode != 0
    # the broken site's verdict is kept under its own fingerprint, beside the venv's (not over it)
    after = venv_check._kept()
    broken = [v for fp, v in after.items() if fp not in before and v["failures"]]
    assert [f["module"] for v in broken for f in v["failures"]] == ["soundfile"], after
    assert all(after[fp] == v for fp, v in before.items()), "the venv's own verdict was replaced"


def test_installed_file_reads_the_url_else_the_wheel_tags():
    assert venv_check.installed_file("not-a-package-here") == ""
    got = venv_check.installed_file("numpy")
    assert got.startswith("numpy-") and got.endswith(".whl") or got.startswith("wheel cp3"), got
