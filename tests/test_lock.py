"""``requirements.lock`` agrees with the requirement files, for every supported Python, and the
installer's walk of it (``tools/lockfile.needed``) installs what a CPU or a CUDA torch needs."""
from __future__ import annotations

import importlib.metadata as md

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from tests.conftest import ROOT, load_tool
from wan_s2v_runner.preflight.checks_python import supported_minors, supported_python

lockfile = load_tool("lockfile")
lock_tool = load_tool("lock")
LOCK = lockfile.parse((ROOT / "requirements.lock").read_text(encoding="utf-8"))
INPUTS = (*lock_tool.INPUTS, lock_tool.ENGINE)


def requirements(file: str) -> list:
    out = []
    for raw in (ROOT / file).read_text(encoding="utf-8").splitlines():
        line = raw.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "-")):
            out.append(Requirement(line))
    return out


def environment(minor: str) -> dict:
    """Marker values of a Linux x86-64 CPython ``minor`` (the lock's other platforms are uv's)."""
    env = default_environment()
    env.update(python_version=minor, python_full_version=f"{minor}.0", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", implementation_name="cpython",
               platform_python_implementation="CPython", os_name="posix")
    return env


def pinned(name: str, env: dict) -> list:
    return [e for e in LOCK if e.name == name and (e.marker is None or Requirement(f"x ; {e.marker}").marker
                                                   .evaluate(env))]


@pytest.mark.parametrize("minor", supported_minors(supported_python()))
def test_every_requirement_is_pinned_by_the_lock_within_its_range(minor):
    """Change a requirement file and this fails until ``make lock`` is run."""
    env = environment(minor)
    for file in INPUTS:
        for req in requirements(file):
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            got = pinned(lockfile.canonical(req.name), env)
            assert len(got) == 1, f"{file}: {req} has {len(got)} pins in requirements.lock for Python " \
                                  f"{minor}; fix: make lock"
            assert req.specifier.contains(got[0].version, prereleases=True), \
                f"{file} asks for {req}; requirements.lock pins {got[0].version} for Python {minor}; fix: make lock"
            assert f"-r {file}" in got[0].via, f"{req.name}: the lock does not say {file} asks for it; fix: make lock"


def test_the_extras_pyproject_reads_from_files_are_the_locks_inputs():
    """``pip install 'wan-s2v[livekit]'`` asks for what requirements-livekit.txt asks for, and the lock
    resolves that file with the rest (the set-up's venv has every extra; the gpu extra's flash-attn,
    a CUDA-only sdist built against the user's torch, is not locked)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "optional-dependencies" not in project["project"], "an extra outside [tool.setuptools.dynamic]"
    extras = project["tool"]["setuptools"]["dynamic"]["optional-dependencies"]
    locked = {f for name, spec in extras.items() if name != "gpu" for f in spec["file"]}
    assert locked == set(lock_tool.EXTRAS) <= set(lock_tool.INPUTS), (extras, lock_tool.EXTRAS)


# what decides the demo's bytes: the frames (torch, numpy's reductions) and the mp4 (PyAV's FFmpeg,
# imageio-ffmpeg's for the inputs). CI compares the demo's sha256 across the supported Pythons.
BYTES_DECIDING = ("torch", "numpy", "av", "imageio-ffmpeg")


@pytest.mark.parametrize("name", BYTES_DECIDING)
def test_what_decides_the_videos_bytes_has_one_version_on_every_python(name):
    """A package pinned per Python (e.g. the newest release for 3.11+ and an older one for 3.10)
    makes the same run write a different mp4 on 3.10: CI's last step fails after the whole suite."""
    versions = {minor: [e.version for e in pinned(name, environment(minor))]
                for minor in supported_minors(supported_python())}
    assert len({tuple(v) for v in versions.values()}) == 1 and all(len(v) == 1 for v in versions.values()), \
        f"{name} is locked as {versions}: one version must serve every supported Python; fix: pin it " \
        f"in requirements.txt to the newest release with wheels for all of them, then make lock"


def test_the_lock_holds_nothing_the_requirement_files_no_longer_ask_for():
    asked = {f: {lockfile.canonical(r.name) for r in requirements(f)} for f in INPUTS}
    names = {e.name for e in LOCK}
    for e in LOCK:
        assert e.via, f"{e.name}: no '# via' in requirements.lock"
        for parent in e.via:
            if parent.startswith("-r "):
                assert parent[3:] in asked and e.name in asked[parent[3:]], \
                    f"{e.name}: requirements.lock says {parent} asks for it, which it no longer does; fix: make lock"
            else:
                assert parent in names, f"{e.name}: its parent {parent} is not in requirements.lock; fix: make lock"


def test_every_pin_is_exact_and_carries_the_hashes_of_its_files():
    for e in LOCK:
        assert e.hashes and all(h.startswith("sha256:") and len(h) == 71 for h in e.hashes), e.name
        assert "*" not in e.version and "," not in e.version, e
    for (name, version), files in lock_tool.EXTRA_BUILDS.items():
        entry = [e for e in LOCK if e.name == name and e.version == version]
        assert entry and set(files.values()) <= entry[0].hashes, (name, version)
    engine = [e for e in LOCK if e.name == "wan22"]
    assert len(engine) == 1 and engine[0].via == [f"-r {lock_tool.ENGINE}"], engine


LOCK_TEXT = """\
app==1.0
    # via -r requirements.txt
torch==2.0 \\
    --hash=sha256:{h}
    # via
    #   -r requirements.txt
    #   app
sympy==1.0
    # via torch
nvidia-cublas==1.0 ; sys_platform == 'linux'
    # via
    #   nvidia-cudnn
    #   torch
nvidia-cudnn==1.0 ; sys_platform == 'linux'
    # via torch
jinja2==3.0
    # via
    #   app
    #   torch
""".format(h="0" * 64)


def test_a_cpu_torch_does_not_get_the_cuda_builds_packages():
    lock = lockfile.parse(LOCK_TEXT)
    assert [e.name for e in lock] == ["app", "torch", "sympy", "nvidia-cublas", "nvidia-cudnn", "jinja2"]
    assert lock[1].hashes == {"sha256:" + "0" * 64} and lock[3].marker == "sys_platform == 'linux'"
    app = ["torch>=2", "jinja2"]
    cpu = {"app": app, "torch": ["sympy>=1", "jinja2; extra == 'x'"], "sympy": [], "jinja2": [],
           "nvidia-cublas": [], "nvidia-cudnn": ["nvidia-cublas"]}
    assert lockfile.needed(cpu, lock) == {"app", "torch", "sympy", "jinja2"}
    cuda = dict(cpu, torch=["sympy", "nvidia-cudnn ; platform_system == 'Linux'", "nvidia-cublas"])
    assert lockfile.needed(cuda, lock) == {"app", "torch", "sympy", "jinja2", "nvidia-cudnn", "nvidia-cublas"}
    # a package whose markers do not hold here (not chosen) is not installed, whoever declares it
    del cuda["nvidia-cudnn"]
    assert "nvidia-cudnn" not in lockfile.needed(cuda, lock)


def test_the_walk_of_the_real_lock_is_this_venv():
    """What the installer computes from the lock and the installed files' ``Requires-Dist`` is what
    the suite's venv holds (it was installed by that walk; a CPU torch here leaves nvidia-* out)."""
    env = default_environment()
    chosen = {}
    for e in LOCK:
        if e.marker is None or Requirement(f"x ; {e.marker}").marker.evaluate(env):
            try:
                chosen[e.name] = md.requires(e.name) or []
            except md.PackageNotFoundError:
                chosen[e.name] = []
    need = lockfile.needed(chosen, LOCK)
    installed = {lockfile.canonical(d.metadata["Name"]) for d in md.distributions()}
    missing = need - installed
    assert not missing, f"the lock's walk needs these, which the venv lacks: {sorted(missing)}"
    locked_but_skipped = set(chosen) - need
    if md.version("torch").endswith("+cpu"):
        assert {n for n in locked_but_skipped if n.startswith("nvidia-")}, "a CPU torch kept the CUDA packages"
        assert not any(n.startswith("nvidia-") for n in installed)
