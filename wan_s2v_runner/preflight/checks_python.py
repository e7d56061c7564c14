"""Group ``python_torch``: Python, torch (build, CUDA runtime vs driver), torchvision pairing.

The supported Python range is pyproject.toml's ``requires-python``, read from the installed
distribution's metadata (or from pyproject.toml in a source checkout): the Makefile
(``tools/find_python``), pip and this check all answer from that one line.
All versions are compared with ``packaging.version``. torchvision pairs with torch as
``0.(minor + 15)`` (torch 2.13 <-> torchvision 0.28, 2.5 <-> 0.20); a CUDA torchvision build on a
CPU torch is expected here and is handled by ``patches.torchvision_cpu``. Whether every module the
engine and the runner import loads (native libraries above all) is the venv check's verdict
(:mod:`wan_s2v_runner.loading.venv_check`), which the probe records as ``venv``.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from wan_s2v_runner.loading.venv_check import Failure

from .core import fail, ok, skip, warn

MIN_TORCH = Version("2.4")  # torch.amp.autocast('cuda'), FSDP1 use_orig_params paths the engine uses


def V(s):
    try:
        return Version(str(s))
    except (InvalidVersion, TypeError):
        return None


@lru_cache(maxsize=1)
def supported_python() -> SpecifierSet:
    """wan-s2v's ``requires-python``: installed metadata first, else the checkout's pyproject."""
    from importlib import metadata

    try:
        spec = metadata.metadata("wan-s2v").get("Requires-Python")
    except metadata.PackageNotFoundError:
        spec = None
    if not spec:
        text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
        spec = re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.MULTILINE).group(1)
    return SpecifierSet(spec)


def supported_minors(spec: SpecifierSet) -> list:
    """The 3.x minor versions ``spec`` admits, oldest first (e.g. ['3.10', '3.11', '3.12'])."""
    return [f"3.{m}" for m in range(6, 30) if spec.contains(f"3.{m}.0")]


def check_python(ctx):
    py = ctx.facts.raw.get("python")
    v = V(py)
    if v is None:
        return warn("python.version", f"Python version unknown ({py!r})", "re-run the probe")
    spec = supported_python()
    if not spec.contains(v.base_version):
        minors = supported_minors(spec)
        return fail("python.version", f"Python {py} is outside wan-s2v's supported {spec}",
                    f"use Python {', '.join(minors[:-1])} or {minors[-1]}: "
                    f"make PYTHON=python{minors[-1]} (the Makefile also finds pyenv installs)",
                    python=py)
    return ok("python.version", f"Python {py} (supported: {spec})", python=py)


def check_torch(ctx):
    t = ctx.facts.torch
    tv = V(t.get("version"))
    if tv is None:
        return fail("torch.version", "torch is not installed or its version is unreadable",
                    "pip install torch (see requirements.txt for the pinned version)")
    build = f"CUDA {t['cuda']}" if t.get("cuda") else ("ROCm " + t["hip"] if t.get("hip") else "CPU-only")
    if tv < MIN_TORCH:
        return fail("torch.version", f"torch {t['version']} < {MIN_TORCH}",
                    "install torch >= 2.4 (the engine uses torch.amp.autocast('cuda') and FSDP1)")
    if ctx.on_cuda and not t.get("cuda"):
        return fail("torch.version", f"torch {t['version']} is a {build} build but --device cuda",
                    "install a CUDA build of torch (pip install torch --index-url "
                    "https://download.pytorch.org/whl/cu128), or --device cpu for the demo")
    return ok("torch.version", f"torch {t['version']} ({build}, cuDNN {t.get('cudnn') or '-'})",
              torch=t["version"], cuda=t.get("cuda"))


def check_cuda_driver(ctx):
    t, drv = ctx.facts.torch, ctx.facts.driver
    if not ctx.on_cuda:
        return skip("torch.cuda_driver", "--device cpu")
    rt = V(t.get("cuda"))
    if rt is None:
        return skip("torch.cuda_driver", "torch has no CUDA runtime (see torch.version)")
    dv = V(drv.get("cuda"))
    if dv is None:
        if ctx.facts.gpu_count:
            return ok("torch.cuda_driver", f"CUDA runtime {rt}; driver version unknown (pynvml not "
                      "installed) but torch sees the GPUs", "pip install nvidia-ml-py for driver details")
        return skip("torch.cuda_driver", f"CUDA runtime {rt}; no driver found (no GPU)")
    if dv.major < rt.major:
        return fail("torch.cuda_driver", f"driver {drv.get('version')} supports CUDA {dv} but torch "
                    f"needs CUDA {rt} (major version newer than the driver)",
                    f"update the NVIDIA driver, or install torch built for CUDA {dv.major}.x")
    if (dv.major, dv.minor) < (rt.major, rt.minor):
        return warn("torch.cuda_driver", f"driver {drv.get('version')} supports CUDA {dv}, torch "
                    f"was built for {rt}: runs via CUDA minor-version compatibility",
                    "if kernels fail with 'unsupported toolchain'/'PTX' errors, update the driver")
    return ok("torch.cuda_driver", f"driver {drv.get('version')} (CUDA {dv}) >= torch's CUDA {rt}")


def check_torchvision(ctx):
    tv_s, t_s = ctx.facts.package("torchvision"), ctx.facts.torch.get("version")
    tv, t = V(tv_s), V(t_s)
    if tv is None:
        return fail("torchvision.match", "torchvision is not installed (wan imports it)",
                    f"pip install torchvision==0.{(t.minor + 15) if t else 'N'}.* matching torch {t_s}")
    if t is None:
        return skip("torchvision.match", f"torchvision {tv_s}; torch version unknown")
    want = Version(f"0.{t.minor + 15}") if t.major == 2 else None
    if want is not None and (tv.major, tv.minor) != (want.major, want.minor):
        return fail("torchvision.match", f"torchvision {tv_s} does not match torch {t_s} "
                    f"(expects torchvision {want.major}.{want.minor}.x)",
                    f"pip install torchvision=={want.major}.{want.minor}.* (same index/CUDA build as torch)")
    local_tv, local_t = tv.local or "", t.local or ""
    note = ""
    if local_t.startswith("cpu") and local_tv and not local_tv.startswith("cpu"):
        note = "; CUDA torchvision build on a CPU torch: patched by patches.torchvision_cpu"
    return ok("torchvision.match", f"torchvision {tv_s} matches torch {t_s}{note}")


def check_packages(ctx):
    """One failing result for each module that does not load, with the package, the file it was
    installed from and the fix; ok when all load; skip on recorded facts without the verdict."""
    v = ctx.facts.raw.get("venv")
    if not v:
        return skip("python.packages", "not measured (facts recorded without the venv check)")
    failures = v.get("failures") or []
    if not failures:
        return ok("python.packages", f"{v.get('checked')} modules the engine and the runner import load "
                  "(torch, torchvision's operators, soundfile's libsndfile, decord, cv2, psycopg, ffmpeg)")
    return [fail("python.packages", f.finding(), f.fix, module=f.module, dist=f.dist, version=f.version, file=f.file)
            for f in (Failure(**d) for d in failures)]
