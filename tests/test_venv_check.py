"""The venv check (``wan_s2v_runner.loading.venv_check``): every third-party module the code
imports is on its lists, and a package whose native library does not load is named, with the
file it was installed from and the fix, by the set-up's check and by ``wan-s2v doctor``."""
from __future__ import annotations

import ast
import json
import os
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


def imported_names(roots) -> dict:
    """Every dotted module name the files under ``roots`` import (``from a.b import c``: ``a.b``
    and ``a.b.c``, either may be the module) -> a file that imports it."""
    found: dict = {}
    for root in roots:
        for path in (ROOT / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                else:
                    names = []
                for name in names:
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


EXTRA_TOPS = {m.name.split(".")[0] for x in venv_check.EXTRAS for m in x.modules}


def test_the_lists_hold_every_module_the_code_imports():
    """Add an import of a new package and this fails until the check loads it too (or says why not).
    The extras' packages (livekit, pipecat) are on :data:`venv_check.EXTRAS`' lists, checked where
    installed (the product's integrations, ``wan_s2v_runner/integrations``, import them)."""
    listed = {m.name for m in venv_check.modules(dev=False)} | venv_check.OPTIONAL | {"tomli"} | EXTRA_TOPS
    product = third_party_imports(PRODUCT_ROOTS)
    missing = {m: f for m, f in product.items() if m not in listed}
    assert not missing, f"imported by the product but not in venv_check's lists: {missing}"
    listed_dev = listed | {m.name for m in venv_check.DEV}
    dev = third_party_imports(DEV_ROOTS)
    missing = {m: f for m, f in dev.items() if m not in listed_dev}
    assert not missing, f"imported by tests/tools/bench but not in venv_check's lists: {missing}"


def test_the_extras_lists_hold_the_parts_of_their_packages_the_product_imports():
    """pipecat's and livekit's subpackages need more than the extra installs (a transport, a plugin:
    another extra of theirs, another package): the product's imports of an extra's package stay
    within the modules the check loads (a listed one, a package above one, or a module under one)."""
    listed = [m.name for x in venv_check.EXTRAS for m in x.modules]
    imported = {name: f for name, f in imported_names(PRODUCT_ROOTS).items() if name.split(".")[0] in EXTRA_TOPS}
    outside = {name: f for name, f in imported.items()
               if not any(name == m or name.startswith(m + ".") or m.startswith(name + ".") for m in listed)}
    assert not outside, f"imported by the product, outside venv_check.EXTRAS' modules: {outside}; fix: add " \
                        f"them to the extra's list (and its requirement file what they need)"


def test_each_extra_is_one_pyproject_declares_from_its_requirement_file():
    """An extra's name is the one users install (``wan-s2v[NAME]``), and its distribution is what that
    extra's requirement file asks for (the check looks for it to tell the extra is installed)."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    dynamic = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["dynamic"]
    declared = dynamic["optional-dependencies"]
    for x in venv_check.EXTRAS:
        assert x.name in declared, f"pyproject.toml declares no extra {x.name!r}: {sorted(declared)}"
        asked = set()
        for file in declared[x.name]["file"]:
            for raw in (ROOT / file).read_text(encoding="utf-8").splitlines():
                line = raw.split(" #", 1)[0].strip()
                if line and not line.startswith("#"):
                    asked.add(Requirement(line).name)
        assert x.dist in asked, f"extra {x.name}: its files ask for {sorted(asked)}, not {x.dist}"


def test_an_extra_is_checked_where_installed_and_always_with_dev(monkeypatch):
    """Without ``--dev`` (a user's install, the doctor): an extra's modules where its distribution is
    installed; with it (the set-up's venv): every extra this Python installs (pipecat: 3.11+)."""
    monkeypatch.setattr(venv_check, "_version", lambda dist: None)
    assert venv_check.extras(dev=False) == ()
    every = ["livekit"] + (["pipecat"] if sys.version_info >= (3, 11) else [])
    assert [x.name for x in venv_check.extras(dev=True)] == every
    monkeypatch.setattr(venv_check, "_version", lambda dist: "1.14.0" if dist == "pipecat-ai" else None)
    assert [x.name for x in venv_check.extras(dev=False)] == ["pipecat"]
    names = [m.name for m in venv_check.modules(dev=False)]
    assert "pipecat.frames.frames" in names and not any(n.startswith("livekit") for n in names), names
    monkeypatch.setattr(sys, "version_info", (3, 10, 14))
    assert [x.name for x in venv_check.extras(dev=True)] == ["livekit", "pipecat"]  # installed: checked


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
    # the broken site's verdict is kept under its own fingerprint, beside the venv's (not over it,
    # nor evicting it: earlier runs' sites may go, the venv's own verdicts stay as they were)
    after = venv_check._kept()
    broken = [v for fp, v in after.items() if fp not in before and v["failures"]]
    assert [f["module"] for v in broken for f in v["failures"]] == ["soundfile"], after
    assert [v["foreign"][0] for v in broken] == [str((tmp_path / "site").resolve())], broken
    own = {fp: v for fp, v in before.items() if v.get("foreign") == []}
    assert all(after.get(fp) == v for fp, v in own.items()), "the venv's own verdict was replaced"


def test_verdicts_for_foreign_sites_never_evict_the_venvs_own(tmp_path, monkeypatch):
    """A test's fake site (a new directory each run) and a ``sys.path`` with extra entries (a test
    worker's) do not push the venv's own verdict out of its file: ``run``'s preflight finds it with
    no child check. In this process, the check stubbed (its imports are not the point)."""
    monkeypatch.setattr(venv_check, "_verdict_path", lambda: tmp_path / venv_check.VERDICT_FILE)
    monkeypatch.setattr(venv_check, "check", lambda mods: [])
    # the venv alone, as `run` sees it: a site another test of this worker left on sys.path goes
    left = {d for d, own, _ in venv_check.sites() if not own}
    monkeypatch.setattr(sys, "path", [p for p in sys.path if venv_check._real(p or os.getcwd()) not in left])
    assert all(own for _, own, _ in venv_check.sites())

    def no_child():
        raise AssertionError("a child check was started: the kept verdict was not found")

    venv_check.save(venv_check.verdict())
    own = venv_check.cached_verdict(no_child)
    assert own["fingerprint"] == venv_check.fingerprint()
    # entries without packages (a source tree, a worker's helpers) and the venv's own site-packages
    # listed again are the same environment
    import site as site_mod

    for extra in (tmp_path, tmp_path / "no-such-dir", *site_mod.getsitepackages()):
        with monkeypatch.context() as m:
            m.syspath_prepend(str(extra))
            assert venv_check.cached_verdict(no_child) == own, extra
    # more foreign sites than are kept, each one's verdict kept as it comes
    foreign = []
    for i in range(venv_check.KEEP + 2):
        with monkeypatch.context() as m:
            m.syspath_prepend(str(fake_site(tmp_path / f"run{i}")))
            v = venv_check.verdict()
            assert v["fingerprint"] != own["fingerprint"], v
            venv_check.save(v)
            assert venv_check.cached_verdict(no_child) == v
            foreign.append(v["fingerprint"])
    kept = venv_check._kept()
    assert kept.get(own["fingerprint"]) == own, "the venv's own verdict was evicted by foreign sites' verdicts"
    assert venv_check.cached_verdict(no_child) == own
    assert [fp for fp in foreign if fp in kept] == foreign[-venv_check.KEEP:]  # the newest foreign ones
    assert [kept[fp]["foreign"] for fp in foreign[-1:]] == [[str((tmp_path / f"run{venv_check.KEEP + 1}" / "site")
                                                               .resolve())]]


def test_installed_file_reads_the_url_else_the_wheel_tags():
    assert venv_check.installed_file("not-a-package-here") == ""
    got = venv_check.installed_file("numpy")
    assert got.startswith("numpy-") and got.endswith(".whl") or got.startswith("wheel cp3"), got
