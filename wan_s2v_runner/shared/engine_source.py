"""Where the official Wan2.2 engine (the ``wan`` package) is and which one it is, without
importing it.

The engine comes from the installed PyPI package (``wan22==2.2.11``) or from a user's Wan2.2
checkout (``--wan-repo PATH`` or ``$WAN_REPO``). :func:`locate` finds it, :func:`s2v_fingerprint`
identifies its S2V sources (preflight reports a mismatch, ``run.json`` and clip checkpoints record
it), :func:`engine_version` names it. Importing it is :mod:`wan_s2v_runner.loading.engine`'s job.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
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
