"""The demo's asset cache: tiny checkpoint + reference image + speech audio, built once.

``ensure_demo_assets(cache_dir)`` builds the set (``tiny_checkpoint.build_tiny_checkpoint``,
``synthetic_inputs.make_reference_image`` / ``make_speech_audio``) into ``cache_dir`` and reuses
it afterwards. A marker file, written last, records the spec the set was built with; a missing
or stale marker means "rebuild everything". Concurrent callers (e.g. several ranks, or tests and
the CLI at once) are serialized by a lock file next to the assets.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from wan_s2v_runner.demo.synthetic_inputs import make_pose_video, make_reference_image, make_speech_audio
from wan_s2v_runner.demo.tiny_checkpoint import (
    TINY_FORMAT_VERSION,
    build_tiny_checkpoint,
    checkpoint_is_complete,
    dir_bytes,
)
from wan_s2v_runner.shared.atomic import atomic_write, write_text

__all__ = ["DemoAssets", "ensure_demo_assets"]


@dataclass(frozen=True)
class DemoAssets:
    """Where the demo's tiny checkpoint, reference image and speech audio are."""

    ckpt_dir: Path
    image: Path
    audio: Path
    pose_video: Path  # a skeleton's moves (wan-s2v demo --pose)


_DEMO_MARKER = ".demo_assets_ok"
_DEMO_SPEC = {"format_version": TINY_FORMAT_VERSION, "seed": 0, "image": [64, 64],
              "audio_seconds": 1.0, "sample_rate": 16000, "pose": {"size": [84, 80], "frames": 30, "fps": 25}}


@contextlib.contextmanager
def dir_lock(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock, builds are still atomic
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _demo_paths(cache_dir: Path) -> DemoAssets:
    return DemoAssets(ckpt_dir=cache_dir / "tiny-s2v-ckpt", image=cache_dir / "reference.png",
                      audio=cache_dir / "speech.wav", pose_video=cache_dir / "pose.mp4")


def _demo_valid(cache_dir: Path, assets: DemoAssets) -> bool:
    marker = cache_dir / _DEMO_MARKER
    try:
        spec = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return (spec == _DEMO_SPEC and checkpoint_is_complete(assets.ckpt_dir)
            and assets.image.is_file() and assets.audio.is_file() and assets.pose_video.is_file())


def ensure_demo_assets(cache_dir: Path) -> DemoAssets:
    """Tiny checkpoint + reference image + speech audio in ``cache_dir``, built once.

    A marker file written last (after everything else is in place) says the set is complete and
    of the current format; if it is missing or stale, everything is rebuilt. Concurrent callers
    (e.g. several ranks) are serialized by a lock file in ``cache_dir``.
    """
    cache_dir = Path(cache_dir).absolute()
    assets = _demo_paths(cache_dir)
    if _demo_valid(cache_dir, assets):
        return assets
    cache_dir.mkdir(parents=True, exist_ok=True)
    with dir_lock(cache_dir / ".demo_assets.lock"):
        if _demo_valid(cache_dir, assets):  # another process built it meanwhile
            return assets
        marker = cache_dir / _DEMO_MARKER
        marker.unlink(missing_ok=True)
        seed = _DEMO_SPEC["seed"]
        build_tiny_checkpoint(assets.ckpt_dir, seed=seed)
        w, h = _DEMO_SPEC["image"]
        atomic_write(assets.image, lambda p: make_reference_image(p, width=w, height=h,
                                                                   seed=seed))
        atomic_write(assets.audio, lambda p: make_speech_audio(
            p, seconds=_DEMO_SPEC["audio_seconds"], sample_rate=_DEMO_SPEC["sample_rate"],
            seed=seed))
        pose = _DEMO_SPEC["pose"]
        atomic_write(assets.pose_video, lambda p: make_pose_video(
            p, width=pose["size"][0], height=pose["size"][1], frames=pose["frames"], fps=pose["fps"], seed=seed))
        write_text(marker, json.dumps(_DEMO_SPEC, sort_keys=True))
    return assets


if __name__ == "__main__":  # python -m wan_s2v_runner.demo.assets CACHE_DIR
    import sys
    import time

    t0 = time.perf_counter()
    got = ensure_demo_assets(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-demo"))
    size = dir_bytes(got.ckpt_dir)
    print(f"{got} ({size / 1e6:.1f} MB checkpoint, {time.perf_counter() - t0:.1f} s)")
