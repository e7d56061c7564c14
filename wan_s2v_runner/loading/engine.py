"""Finding and importing the official Wan2.2 engine (the ``wan`` package), unmodified.

The engine comes from the installed PyPI package (``wan22==2.2.11``) or from a user's Wan2.2
checkout (``--wan-repo PATH`` or ``$WAN_REPO``). Two things must happen *before* ``import wan``
on a machine without CUDA; they live in ``patches/`` and are applied from here:
``patches.torchvision_cpu`` (a CUDA torchvision build on a CPU torch) and
``patches.t5_import_device`` (wan/modules/t5.py calls ``torch.cuda.current_device()`` at import).
``patches.attention.guard_flash_attn_imports`` also runs first, so a flash-attn built for another
torch ("undefined symbol") counts as absent instead of crashing ``import wan``.
Everything else is patched after import, per run, by ``patches.apply_for_run``.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Optional

#: Files of the S2V path, relative to the ``wan`` package dir, and their sha256 at upstream
#: Wan-Video/Wan2.2 HEAD 42bf4cf (== PyPI wan22 2.2.11). A mismatch is reported, not refused:
#: our patches were written and tested against these.
S2V_FILES: tuple[str, ...] = (
    "speech2video.py",
    "distributed/fsdp.py",
    "distributed/sequence_parallel.py",
    "distributed/ulysses.py",
    "distributed/util.py",
    "modules/attention.py",
    "modules/model.py",
    "modules/t5.py",
    "modules/tokenizers.py",
    "modules/vae2_1.py",
    "modules/s2v/audio_encoder.py",
    "modules/s2v/audio_utils.py",
    "modules/s2v/auxi_blocks.py",
    "modules/s2v/model_s2v.py",
    "modules/s2v/motioner.py",
    "modules/s2v/s2v_utils.py",
    "configs/wan_s2v_14B.py",
    "configs/shared_config.py",
)
KNOWN_S2V_FINGERPRINT = "51b82894a24ff7b912860438676ad4565d869f56710aace0f30cebaee11e8d62"


@dataclass(frozen=True)
class EngineLocation:
    source: str  # "package" | "checkout"
    package_dir: Path  # the directory of the `wan` package
    repo_root: Optional[Path]


class EngineNotFound(RuntimeError):
    pass


def locate(wan_repo: Optional[Path] = None) -> EngineLocation:
    """Where `wan` would come from, without importing it."""
    repo = wan_repo or (Path(os.environ["WAN_REPO"]) if os.environ.get("WAN_REPO") else None)
    if repo is not None:
        repo = Path(repo).expanduser().absolute()
        pkg = repo / "wan"
        if not (pkg / "speech2video.py").is_file():
            raise EngineNotFound(
                f"{repo} is not a Wan2.2 checkout (no wan/speech2video.py). "
                "Fix: pass the repository root of a Wan2.2 clone to --wan-repo, or unset WAN_REPO.")
        return EngineLocation("checkout", pkg, repo)
    spec = importlib.util.find_spec("wan")
    if spec is None or not spec.submodule_search_locations:
        raise EngineNotFound(
            "the Wan2.2 engine is not installed. Fix: pip install --no-deps wan22==2.2.11 "
            "(see requirements.txt), or pass --wan-repo PATH to a Wan2.2 checkout.")
    pkg = Path(list(spec.submodule_search_locations)[0])
    if not (pkg / "speech2video.py").is_file():
        raise EngineNotFound(f"the installed `wan` at {pkg} has no speech2video.py (not Wan2.2?). "
                             "Fix: pip install --no-deps wan22==2.2.11, or --wan-repo PATH.")
    return EngineLocation("package", pkg, None)


def s2v_file_hashes(package_dir: Path) -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for rel in S2V_FILES:
        p = package_dir / rel
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
    return out


def s2v_fingerprint(package_dir: Path) -> str:
    """One sha256 over the S2V files' hashes (order fixed by S2V_FILES)."""
    h = hashlib.sha256()
    for rel, digest in s2v_file_hashes(package_dir).items():
        h.update(f"{rel}:{digest}\n".encode())
    return h.hexdigest()


def engine_version(loc: EngineLocation) -> str:
    if loc.source == "package":
        try:
            from importlib.metadata import version
            return version("wan22")
        except Exception:
            return "unknown"
    head = loc.repo_root / ".git" / "HEAD" if loc.repo_root else None
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref = (loc.repo_root / ".git" / ref[5:]).read_text().strip()
        return f"checkout@{ref[:12]}"
    except Exception:
        return "checkout"


def import_wan(wan_repo: Optional[Path] = None) -> ModuleType:
    """Import the engine with the pre-import fixes this machine needs. Idempotent."""
    if "wan" in sys.modules and hasattr(sys.modules["wan"], "WanS2V"):
        return sys.modules["wan"]
    loc = locate(wan_repo)
    if loc.source == "checkout" and str(loc.repo_root) not in sys.path:
        sys.path.insert(0, str(loc.repo_root))
    from patches import attention, t5_import_device, torchvision_cpu

    torchvision_cpu.apply()
    attention.guard_flash_attn_imports()  # a broken flash-attn must not crash `import wan`
    with t5_import_device.applied(), warnings.catch_warnings():
        # upstream decorates with the deprecated torch.cuda.amp.autocast; say it once in docs, not per import
        warnings.filterwarnings("ignore", message=r".*torch\.cuda\.amp\.autocast", category=FutureWarning)
        wan = importlib.import_module("wan")
    got = Path(wan.__file__).parent.resolve()
    if got != loc.package_dir.resolve():
        raise EngineNotFound(f"imported `wan` from {got}, expected {loc.package_dir}. "
                             "Fix: remove the other copy from PYTHONPATH or pass --wan-repo.")
    return wan
