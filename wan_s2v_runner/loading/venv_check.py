"""Does this environment load? Every third-party module the engine, the product (and with
``--dev`` the tests) import, imported in one short process, the native ones exercised.

    python -m wan_s2v_runner.loading.venv_check [--dev] [--json]

Each run keeps its verdict in the environment (:func:`save`).

The optional extras' modules (:data:`EXTRAS`: ``wan-s2v[livekit]``, ``wan-s2v[pipecat]``, the
voice-agent integrations) are checked where the extra's distribution is installed, and always with
``--dev`` (the set-up's venv has both, the tests use them; pipecat only on Python 3.11+, where it
installs).

A module that does not load gives one line: which package, which file was installed (the URL the
set-up installed it from, else its wheel's tags), the error, and the fix. The set-up runs this
right after installing (``make install``: a venv that fails is not stamped installed); the probe
reads its verdict for ``wan-s2v doctor`` and ``run``'s preflight (check ``python.packages``),
re-checking in a child process whenever the installed distributions changed since (the verdict is
kept in the venv with a fingerprint of them: :func:`cached_verdict`). The venv's own verdict (its
own site directories alone) is never evicted by one for a ``PYTHONPATH`` that adds packages
(:func:`save`).

Native libraries are where a venv breaks while every version is right: soundfile's generic wheel
loads the system's libsndfile (absent on a fresh machine), decord's and cv2's shared objects,
torch's, torchvision's registered operators (a CUDA build on a CPU torch: the product defines two
schemas first, ``patches.torchvision_cpu``, as here), psycopg's binary build (else it looks for a
system libpq), imageio-ffmpeg's ffmpeg (it is run), livekit's FFI library (loaded, not started).
``tests/test_venv_check.py`` holds the lists to what the code imports. Standard library only at
import.

Exit status: 0 every module loads, 1 one or more do not.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata as md
import json
import os
import site
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

#: where the verdict is kept: in the environment itself
VERDICT_FILE = "wan-s2v-venv-check.json"
#: verdicts kept of each kind, the venv's own and those with foreign site directories (one an
#: environment: a fingerprint of its installed distributions); a foreign one never evicts the venv's
KEEP = 4
#: a fix that holds for any package: the file pip picks for the locked version
REINSTALL = "make install (it installs the file pip picks for the locked version; pip alone: WAN_S2V_INSTALLER=pip)"


@dataclass(frozen=True)
class Module:
    """One import name, the distribution that provides it, and the fix when it does not load."""

    name: str
    dist: str
    fix: str = REINSTALL


#: what ``import wan`` imports (the engine's modules; decord, cv2 and peft for its animate path)
ENGINE = (
    Module("torch", "torch"),
    Module("torchvision", "torchvision", "install the torchvision build that matches torch (requirements.lock): "
           + REINSTALL),
    Module("numpy", "numpy"), Module("scipy", "scipy"), Module("PIL", "pillow"),
    Module("soundfile", "soundfile", "install soundfile's manylinux wheel, which carries libsndfile: " + REINSTALL
           + "; or the system's: apt-get install libsndfile1"),
    Module("librosa", "librosa"), Module("decord", "decord"), Module("cv2", "opencv-python-headless"),
    Module("imageio", "imageio"), Module("imageio_ffmpeg", "imageio-ffmpeg"),
    Module("transformers", "transformers"), Module("diffusers", "diffusers"), Module("tokenizers", "tokenizers"),
    Module("safetensors", "safetensors"), Module("huggingface_hub", "huggingface-hub"),
    Module("accelerate", "accelerate"), Module("peft", "peft"), Module("einops", "einops"),
    Module("easydict", "easydict"), Module("ftfy", "ftfy"), Module("regex", "regex"), Module("tqdm", "tqdm"),
)
#: what the runner itself imports (beyond the engine's)
PRODUCT = (
    Module("packaging", "packaging"), Module("pydantic", "pydantic"), Module("rich", "rich"),
    Module("setproctitle", "setproctitle"), Module("threadpoolctl", "threadpoolctl"),
    Module("fastapi", "fastapi"), Module("starlette", "starlette"), Module("uvicorn", "uvicorn"),
    Module("httpx", "httpx"), Module("prometheus_client", "prometheus-client"),
    Module("psycopg", "psycopg", "install psycopg's binary build, which carries libpq: " + REINSTALL),
    Module("psycopg_pool", "psycopg-pool"),
    Module("av", "av", "install PyAV's manylinux wheel, which carries FFmpeg with libx264: " + REINSTALL),
    Module("soxr", "soxr"),  # a live session's speech at another rate, to 16 kHz (serve/sessions.py)
    Module("aiortc", "aiortc"),  # a live session's viewers over WebRTC (serve/whep.py)
) + ((Module("tomli", "tomli"),) if sys.version_info < (3, 11) else ())
#: what the tests, tools and benchmarks import (beyond the above)
DEV = (
    Module("pytest", "pytest"), Module("xdist", "pytest-xdist"), Module("hypothesis", "hypothesis"),
    Module("selenium", "selenium"), Module("openai", "openai"), Module("schemathesis", "schemathesis"),
)


@dataclass(frozen=True)
class Extra:
    """An optional extra of wan-s2v (``pip install 'wan-s2v[NAME]'``): its modules are checked where
    its distribution ``dist`` is installed, and always with ``--dev`` on the Pythons it installs on
    (``python`` and newer: the set-up's venv has every extra, the tests use them)."""

    name: str
    dist: str
    modules: tuple
    python: tuple = (3, 10)


#: the fixes for an extra that does not load
LIVEKIT_FIX = f"pip install 'wan-s2v[livekit]'; in a checkout: {REINSTALL}"
PIPECAT_FIX = f"pip install 'wan-s2v[pipecat]' (Python 3.11+); in a checkout: {REINSTALL}"
#: the voice-agent integrations' extras (``wan_s2v_runner/integrations``, docs/voice-agents.md):
#: requirements-livekit.txt and requirements-pipecat.txt, locked with the rest
EXTRAS = (
    Extra("livekit", "livekit-agents", (
        Module("livekit.rtc", "livekit", LIVEKIT_FIX),  # its native FFI library loaded (not started)
        Module("livekit.api", "livekit-api", LIVEKIT_FIX), Module("livekit.agents", "livekit-agents", LIVEKIT_FIX),
        Module("livekit.agents.voice.avatar", "livekit-agents", LIVEKIT_FIX),
    )),
    Extra("pipecat", "pipecat-ai", (
        Module("loguru", "loguru", PIPECAT_FIX),  # pipecat's logger (the check quiets pipecat's banner with it)
        *(Module(f"pipecat.{name}", "pipecat-ai", PIPECAT_FIX)
          for name in ("frames.frames", "processors.frame_processor", "pipeline.pipeline", "pipeline.task",
                       "pipeline.runner", "metrics.metrics"))), python=(3, 11)),
)
#: imported only where present (GPU kernels, NVML, TTS), or checked elsewhere (``wan``: the
#: doctor's ``engine.*`` checks and the set-up's preload import it)
OPTIONAL = frozenset({"flash_attn", "flash_attn_interface", "pynvml", "cosyvoice", "wan", "triton", "xfuser",
                      "yunchang", "cutlass", "flash_attn_4", "nvidia"})


def _torchvision_ops() -> None:
    import torch

    torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")


def _psycopg_binary() -> None:
    import psycopg

    if psycopg.pq.__impl__ != "binary":
        raise ImportError(f"psycopg uses its {psycopg.pq.__impl__} implementation, not the binary build")


def _ffmpeg_runs() -> None:
    import imageio_ffmpeg

    exe = imageio_ffmpeg.get_ffmpeg_exe()
    proc = subprocess.run([exe, "-hide_banner", "-version"], capture_output=True, timeout=60)
    if proc.returncode:
        raise OSError(f"{exe} -version exited {proc.returncode}")


def _av_encodes() -> None:
    import av

    missing = {"libx264", "aac"} - set(av.codecs_available)
    if missing:
        raise ImportError(f"PyAV's FFmpeg has no {', '.join(sorted(missing))} encoder (the video writer needs both)")


def _livekit_ffi_loads() -> None:
    from livekit.rtc._ffi_client import get_ffi_lib

    get_ffi_lib()  # the library loaded as the client loads it (LIVEKIT_LIB_PATH, else the wheel's), not started


def _torch_computes() -> None:
    import torch

    if float((torch.ones(2) + 1).sum()) != 4.0:
        raise RuntimeError("torch computed 1+1 wrong")


#: beyond the import: what loading means for a native module
EXERCISE: dict = {"torch": _torch_computes, "torchvision": _torchvision_ops, "psycopg": _psycopg_binary,
                  "imageio_ffmpeg": _ffmpeg_runs, "av": _av_encodes, "livekit.rtc": _livekit_ffi_loads}


def _before(name: str) -> None:
    """What the product does before importing ``name`` (the CPU torch's torchvision schemas)."""
    if name == "torchvision":
        try:
            from patches import torchvision_cpu
        except ImportError:  # outside a checkout or an install of the project: nothing to apply
            return
        torchvision_cpu.apply()
    elif name.startswith("pipecat.") and "pipecat" not in sys.modules:
        # pipecat logs a banner when first imported (loguru, to stderr), where the check's findings go
        from loguru import logger

        logger.disable("pipecat")
        try:
            importlib.import_module("pipecat")
        finally:
            logger.enable("pipecat")


@dataclass
class Failure:
    module: str
    dist: str
    version: Optional[str]
    file: str
    error: str
    fix: str

    def finding(self) -> str:
        have = f"{self.dist} {self.version}" if self.version else f"{self.dist} (not installed)"
        where = f" ({self.file})" if self.file else ""
        return f"{have}{where}: import {self.module} fails: {self.error}"

    def line(self) -> str:
        return f"venv check: {self.finding()}; fix: {self.fix}"


def installed_file(dist: str) -> str:
    """Which file ``dist`` was installed from: the URL's file name where the installer recorded one
    (``direct_url.json``), else ``wheel <tags>`` from its ``WHEEL``; "" when unknown."""
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError:
        return ""
    direct = d.read_text("direct_url.json")
    if direct:
        try:
            return json.loads(direct)["url"].rsplit("/", 1)[-1].replace("%2B", "+")
        except (ValueError, KeyError):
            pass
    tags = [ln.split(":", 1)[1].strip() for ln in (d.read_text("WHEEL") or "").splitlines() if ln.startswith("Tag:")]
    return f"wheel {'.'.join(tags)}" if tags else ""


def _version(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _through(e: BaseException, failed: list) -> bool:
    """Whether ``e`` was raised inside a module that already failed (librosa's import fails where
    soundfile's does: one line, the root's, says it)."""
    files = [Path(f.filename) for f in traceback.extract_tb(e.__traceback__)]
    return any(p.stem == name or name in p.parts for name in failed for p in files)


def check(modules) -> list:
    """Import each module (in order, in this process) and exercise the native ones; a module that
    fails only because one before it did (or with the same error from the same package: an
    extra's modules under one broken package) is not named again."""
    failures = []
    for m in modules:
        try:
            _before(m.name)
            importlib.import_module(m.name)
            EXERCISE.get(m.name, lambda: None)()
        except Exception as e:  # noqa: BLE001 - any failure to load is the finding
            if _through(e, [f.module for f in failures]):
                continue
            first = (str(e).strip().splitlines() or [""])[0][:300]
            error = f"{type(e).__name__}: {first}"
            if any(f.dist == m.dist and f.error == error for f in failures):
                continue
            failures.append(Failure(m.name, m.dist, _version(m.dist), installed_file(m.dist), error, m.fix))
    return failures


def extras(dev: bool) -> tuple:
    """The extras checked here: those installed, and with ``dev`` every one this Python installs."""
    return tuple(x for x in EXTRAS if (dev and sys.version_info >= x.python) or _version(x.dist) is not None)


def modules(dev: bool) -> tuple:
    return ENGINE + PRODUCT + (DEV if dev else ()) + tuple(m for x in extras(dev) for m in x.modules)


def _real(path) -> str:
    try:
        return os.path.realpath(path)
    except (TypeError, ValueError, OSError):
        return str(path)


def own_sites() -> set:
    """The site directories the environment itself sets up (its site-packages; the user's where
    the interpreter enables it), as real paths: what a ``PYTHONPATH``, a test's ``sys.path`` entry
    or a ``.pth`` file adds elsewhere is foreign."""
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return {_real(d) for d in dirs}


def sites() -> list:
    """The directories that hold installed distributions, in the order imports search them (the
    order of ``sys.path``; a shadowing one comes first): ``[(dir, own, [(name, mtime_ns), ...])]``.
    A directory listed twice, or under another spelling, counts once; one without distributions
    (a source tree, a test's helpers) not at all."""
    order: dict = {}
    for i, entry in enumerate(sys.path):
        order.setdefault(_real(entry or os.getcwd()), i)
    found: dict = {}
    for d in md.distributions():
        path = getattr(d, "_path", None)
        if path is None:  # not from a directory (another finder's): named by what it is
            found.setdefault("?", set()).add((f"{d.metadata['Name']} {d.version}", None))
            continue
        try:
            stamp = os.stat(path).st_mtime_ns
        except (OSError, TypeError, ValueError):
            stamp = None
        text = str(path).rstrip("/" + os.sep)
        found.setdefault(_real(os.path.dirname(text)), set()).add((os.path.basename(text), stamp))
    own = own_sites()
    return [(where, where in own, sorted(dists, key=str))
            for where, dists in sorted(found.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))]


def fingerprint(where: Optional[list] = None) -> str:
    """The installed distributions as they are now (each site directory, in search order, with its
    distributions' metadata directories and their mtimes): any install, upgrade or removal changes
    it, and so does a directory of packages added to the path; one without packages does not."""
    h = hashlib.sha256()
    for d, _own, dists in sites() if where is None else where:
        h.update(f"{d}\n".encode())
        for name, stamp in dists:
            h.update(f"  {name}:{stamp}\n".encode())
    return h.hexdigest()


def verdict(dev: bool = False) -> dict:
    """Run the check here: ``{"checked": N, "failures": [...], "seconds": s, "fingerprint": ...,
    "foreign": [...]}`` (foreign: the site directories with packages beyond the venv's own)."""
    t0 = time.monotonic()
    mods = modules(dev)
    failures = check(mods)
    where = sites()
    return {"checked": len(mods), "failures": [asdict(f) for f in failures],
            "seconds": round(time.monotonic() - t0, 2), "fingerprint": fingerprint(where),
            "foreign": [d for d, own, _ in where if not own], "python": sys.executable, "at": time.time()}


def _verdict_path() -> Path:
    return Path(sys.prefix) / VERDICT_FILE


def _kept() -> dict:
    try:
        kept = json.loads(_verdict_path().read_text(encoding="utf-8"))
        return kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):
        return {}


def _own(v: dict) -> bool:
    """Whether a kept verdict is the venv's own (no foreign site directory; one kept before the
    verdicts said so counts as foreign: the first to go)."""
    return v.get("foreign") == []


def save(result: dict) -> None:
    """Keep ``result`` in the environment under its fingerprint, beside the newest others: at most
    :data:`KEEP` of the venv's own and :data:`KEEP` with foreign site directories (a ``PYTHONPATH``
    that adds packages is another environment, and a test's site is new each run: however many
    there are, they never evict the venv's own verdict, which ``run``'s preflight reads). By
    temporary name then rename; where the environment is not writable, nothing is kept. Two
    writers at once lose one entry at worst: it is checked again when next asked."""
    path = _verdict_path()
    kept = {fp: v for fp, v in _kept().items() if isinstance(v, dict) and fp != result["fingerprint"]}
    kept[result["fingerprint"]] = result
    keep: dict = {}
    for own in (True, False):
        pool = sorted(((fp, v) for fp, v in kept.items() if _own(v) == own), key=lambda kv: kv[1].get("at", 0))
        keep.update(pool[-KEEP:])
    try:
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(keep, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def cached_verdict(run_child: Optional[Callable[[], Optional[dict]]] = None) -> Optional[dict]:
    """The verdict for the environment as it is now: a kept one under its fingerprint, else a
    fresh one from a child process (which keeps it); None when the child could not say."""
    kept = _kept().get(fingerprint())  # the fingerprint names the site directories: the environment
    if isinstance(kept, dict):
        return kept
    return (run_child or _child)()


def _child() -> Optional[dict]:
    proc = subprocess.run([sys.executable, "-m", "wan_s2v_runner.loading.venv_check", "--json"],
                          capture_output=True, text=True, timeout=600)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        return None


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result = verdict(dev="--dev" in argv)
    save(result)
    if "--json" in argv:
        print(json.dumps(result))
    else:
        for f in result["failures"]:
            print(Failure(**f).line(), file=sys.stderr)
        if not result["failures"]:
            livekit = ", livekit's FFI library" if any(x.name == "livekit" for x in extras("--dev" in argv)) else ""
            print(f"venv check: {result['checked']} modules load (native: torch, torchvision's operators, "
                  f"soundfile's libsndfile, decord, cv2, psycopg's binary, imageio-ffmpeg's ffmpeg, PyAV's encoders"
                  f"{livekit}) in {result['seconds']:.1f} s")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
