"""Write ``requirements.lock`` from the requirement files (``make lock``; standard library only).

    .venv/bin/python tools/lock.py              # keep every pin the inputs still allow
    .venv/bin/python tools/lock.py --upgrade    # take the newest versions the inputs allow
    .venv/bin/python tools/lock.py --upgrade-package soxr   # that package anew (repeatable)

**What it is.** One universal lock for Python 3.10, 3.11 and 3.12 (``uv pip compile --universal``:
where a package needs another version on one Python, both lines are there under exclusive
markers), every package pinned, direct and transitive, each with the sha256 of every file PyPI
serves for that version. Resolved against PyPI alone (``--no-config --index-url``): the lock is the
public record, the same whatever indexes the maintainer's pip is configured with. uv's compile was
chosen over pip-tools because it resolves for every Python at once in one run (pip-tools resolves
for the interpreter it runs on, one lock a version) and writes the ``# via`` annotations the
installer walks; the output is a plain requirements file, so pip reads it too.

**Inputs.** ``requirements.txt`` (the product), ``requirements-dev.txt`` (tests, lint, the
set-up's tools) and the optional extras' files, :data:`EXTRAS` (``wan-s2v[livekit]``,
``wan-s2v[pipecat]``: pyproject.toml reads each extra from its file), resolved together into one
lock: the set-up's venv has the extras (the tests use them), and a package they share with the
product takes one version for both (pipecat-ai's ``soundfile~=0.13.1`` and ``soxr~=1.0.0`` hold for
the whole lock). ``requirements-engine.txt`` (the engine, ``wan22``) with ``--no-deps``, appended
(its declared dependencies are not installed: see that file). And :data:`EXTRA_BUILDS`: builds of
a locked version that PyPI does not serve, accepted by hash.

**Refresh.** Change a requirement file, run ``make lock``, commit both; ``tests/test_lock.py``
fails while the two disagree. uv keeps the pins already in the lock wherever the inputs allow
(an unrelated package does not move); ``make lock ARGS=--upgrade`` takes the newest of everything.
``--upgrade-package NAME`` resolves that one package anew: where a new input constrains it on some
Pythons only (pipecat-ai, 3.11+), the kept pin would stay on the others and the lock would hold two
versions; resolved anew it takes one that serves every Python where the inputs allow (how
soundfile 0.13.1 and soxr 1.0.0 came to hold on 3.10 too).
Exit status: uv's (nothing is written unless both compiles succeed).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import lockfile  # tools/, beside this script

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
#: the optional extras' requirement files (pyproject.toml's optional-dependencies; the gpu extra's
#: flash-attn, a CUDA-only sdist built against the user's torch, is not locked)
EXTRAS = ("requirements-livekit.txt", "requirements-pipecat.txt")
INPUTS = ("requirements.txt", "requirements-dev.txt", *EXTRAS)
ENGINE = "requirements-engine.txt"
#: the public index the lock is resolved against
INDEX = "https://pypi.org/simple"
#: the oldest supported Python (pyproject's requires-python); the universal lock covers it and every
#: newer one
PYTHON_VERSION = "3.10"
#: builds of a locked version that PyPI does not serve, accepted by their sha256 (added to that
#: version's hashes): PyTorch's CPU build of torch 2.13.0 for CPython 3.11 on x86-64 Linux, which
#: pip takes from this project's machines' find-links (2.13.0+cpu satisfies ==2.13.0; a CPU build
#: has none of the CUDA build's nvidia-* dependencies). Another machine's CPU build of the same
#: version is refused by the installer with its hash and this place named.
EXTRA_BUILDS = {
    ("torch", "2.13.0"): {
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl":
            "sha256:6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b",
    },
}
HEADER = """\
# requirements.lock: every package wan-s2v's set-up installs, for Python 3.10-3.12, with the sha256 of
# every file each version may install. Written by `make lock` (tools/lock.py) from requirements.txt,
# requirements-dev.txt, the extras' requirements-livekit.txt and requirements-pipecat.txt, and
# requirements-engine.txt: do not edit by hand. tests/test_lock.py fails while it and the requirement
# files disagree. The set-up (tools/venv_install.py) installs what this machine needs of it: pip picks
# each version's file, its hash is checked against these.
"""


def uv_binary() -> str:
    """The uv beside this Python (the venv's, which the set-up installs), else the one on PATH."""
    here = Path(sys.executable).parent / "uv"
    found = str(here) if here.exists() else shutil.which("uv")
    if not found:
        sys.exit("lock: no uv beside this Python nor on PATH; fix: make install (it puts the locked uv "
                 "into .venv), then make lock")
    return found


def compile_lock(uv: str, inputs: list, out: Path, extra: list) -> None:
    """``uv pip compile`` of ``inputs`` into ``out`` (pins already in ``out`` are kept)."""
    argv = [uv, "pip", "compile", "--no-config", "--index-url", INDEX, "--universal", "--generate-hashes",
            "--python-version", PYTHON_VERSION, "--no-header", "--quiet", *inputs, "-o", str(out), *extra]
    proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, "UV_NO_CONFIG": "1"})
    if proc.returncode:
        sys.exit(proc.returncode)


def add_extra_builds(text: str) -> str:
    """The lock's text with :data:`EXTRA_BUILDS`' hashes under their versions' lines."""
    lines = text.splitlines()
    for (name, version), files in EXTRA_BUILDS.items():
        head = next((i for i, ln in enumerate(lines) if ln.startswith(f"{name}=={version}")), None)
        if head is None:
            sys.exit(f"lock: EXTRA_BUILDS names {name}=={version}, which the lock does not pin; "
                     "fix: update EXTRA_BUILDS in tools/lock.py")
        end = head + 1
        while end < len(lines) and lines[end].lstrip().startswith("--hash="):
            end += 1
        hashes = sorted({ln.strip().rstrip(" \\") for ln in lines[head + 1:end]}
                        | {f"--hash={h}" for h in files.values()})
        lines[head + 1:end] = [f"    {h} \\" for h in hashes[:-1]] + [f"    {hashes[-1]}"]
    return "\n".join(lines) + "\n"


def main(argv: list) -> int:
    uv = uv_binary()
    extra = ["--upgrade"] if "--upgrade" in argv else []
    for i, arg in enumerate(argv[:-1]):
        if arg == "--upgrade-package":
            extra += ["--upgrade-package", argv[i + 1]]
    old = LOCK.read_text(encoding="utf-8") if LOCK.exists() else ""
    with tempfile.TemporaryDirectory() as tmp:
        main_out, engine_out = Path(tmp, "main.lock"), Path(tmp, "engine.lock")
        # uv keeps the pins of an existing output file: start both from the current lock
        for out in (main_out, engine_out):
            out.write_text(old, encoding="utf-8")
        compile_lock(uv, list(INPUTS), main_out, extra)
        compile_lock(uv, [ENGINE], engine_out, extra + ["--no-deps"])
        text = HEADER + add_extra_builds(main_out.read_text(encoding="utf-8")) + \
            "# the engine, installed without its declared dependencies (requirements-engine.txt)\n" + \
            engine_out.read_text(encoding="utf-8")
    tmp_lock = LOCK.with_suffix(".lock.tmp")
    tmp_lock.write_text(text, encoding="utf-8")
    os.replace(tmp_lock, LOCK)
    entries = lockfile.parse(text)
    print(f"lock: wrote {LOCK.name}: {len(entries)} pins of {len({e.name for e in entries})} packages, "
          f"{sum(len(e.hashes) for e in entries)} file hashes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
