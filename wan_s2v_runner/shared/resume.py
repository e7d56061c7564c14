"""Clip checkpoints and resume: a long run survives a crash, an OOM, a full disk or a preempted VM.

A job's clips are in its growing video (``OUTPUT.partial.mp4``, :mod:`~wan_s2v_runner.rank.video_writer`):
no frames are kept anywhere else. After each clip's fragment is in that file (fsync), the decoding
rank (rank 0) commits the clip's checkpoint into ``<run_dir>/clips/`` (:class:`Checkpoint`): the
state the next clip needs (``state_0004.pt``: next clip index, motion latents, and the last 73
frames where a later clip reads them), then ``state.json`` naming it, the video file, its length
after the clip (:class:`~wan_s2v_runner.shared.fmp4.Position`) and the identity of what produced
it (a digest of the frame-deciding spec fields and input files, of the checkpoint files, and of
the engine's S2V sources). Each file appears by rename (``atomic``), ``state.json`` last, so it
always names a complete clip whose fragment is on disk; the earlier state files go after it.
What a clip costs on disk is its share of the video, plus one small state file.

``wan-s2v resume RUN_DIR`` reads that run's ``spec.json`` (layout flags may change: another
mode, rank count or ``--cfg-parallel``), refuses with a one-line cause when the inputs,
checkpoint or engine differ from what produced the clips, and runs the remaining clips in a new
run directory, continuing the video file from the committed length (whatever a crash appended
after it is cut off). The clip noise is seeded ``seed + clip``, the carried state is restored bit
for bit and every clip's fragment depends on its frames alone, so the final video equals an
uninterrupted run's, byte for byte.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared import cache_policy, precision
from wan_s2v_runner.shared.quant import Fp8Matmul

CLIPS_DIR = "clips"
STATE_JSON = "state.json"
#: 2: the clips are the growing video's fragments (1: each clip's float frames in clip_NNNN.pt)
FORMAT = 2
#: spec fields that decide the frames (layout, supervision and output fields do not)
FRAME_FIELDS = ("prompt", "negative_prompt", "max_area", "infer_frames", "num_clips", "steps", "shift",
                "guide_scale", "solver", "seed", "start_from_ref", "device", "lora", "dit_quant", "fp8_matmul",
                "cache", "dtype", "fp32_blocks")


class ResumeError(ValueError):
    """A run directory that cannot be resumed (one line: cause and fix)."""


def state_file(clip: int) -> str:
    """The carried state's file name after clip ``clip - 1`` (the next clip's index)."""
    return f"state_{clip:04d}.pt"


def spec_digest(spec) -> str:
    """The frame-deciding settings and the contents of the image, audio (and pose video) files."""
    from wan_s2v_runner.shared.media import sha256_file

    data = json.loads(spec.model_dump_json(include=set(FRAME_FIELDS)))
    if data.get("dit_quant") == "none":  # the default: digests made before --dit-quant existed still match
        data.pop("dit_quant")
    if data.get("fp8_matmul") == Fp8Matmul.DEQUANT.value:  # likewise: what every fp8 run did before the flag
        data.pop("fp8_matmul")
    if data.get("cache") == cache_policy.OFF.text:  # likewise: every run before --cache computed every step
        data.pop("cache")
    # likewise before --dtype: auto and the device's historical dtype record nothing (precision.recorded)
    dtype = precision.recorded(data.pop("dtype", "auto"), spec.device)
    if dtype is not None:
        data["dtype"] = dtype
    if not data.get("fp32_blocks"):
        data.pop("fp32_blocks", None)
    data["image_sha256"] = sha256_file(spec.image)
    # --tts-text: the speech it made (kept for a resume); a live session's arrives over time: none
    data["audio_sha256"] = sha256_file(spec.speech) if spec.speech is not None else None
    if spec.pose_video:
        data["pose_sha256"] = sha256_file(spec.pose_video)
    data["lora_sha256"] = [sha256_file(ref.path) for ref in spec.lora]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def checkpoint_digest(ckpt_dir: Path, dit_file: Optional[Path] = None, t5_file: Optional[Path] = None) -> str:
    """Names and sizes of every checkpoint file (and of ``dit_file``/``t5_file``, a ``--dit-file``
    or ``--t5-file``), and the DiT config's bytes (cheap: no weights read)."""
    from wan_s2v_runner.shared.ckpt_layout import DIT_CONFIG

    ckpt_dir = Path(ckpt_dir)
    rows = sorted((str(p.relative_to(ckpt_dir)), p.stat().st_size) for p in ckpt_dir.rglob("*") if p.is_file())
    if dit_file is not None:
        rows.append(["--dit-file", Path(dit_file).name, Path(dit_file).stat().st_size])
    if t5_file is not None:
        rows.append(["--t5-file", Path(t5_file).name, Path(t5_file).stat().st_size])
    h = hashlib.sha256(json.dumps(rows).encode())
    cfg = ckpt_dir / DIT_CONFIG
    if cfg.is_file():
        h.update(cfg.read_bytes())
    return h.hexdigest()


def engine_digest(wan_repo: Optional[Path]) -> str:
    from wan_s2v_runner.shared import engine_source
    return engine_source.s2v_fingerprint(engine_source.locate(wan_repo).package_dir)


def identity(spec) -> dict:
    return {"spec": spec_digest(spec), "checkpoint": checkpoint_digest(spec.ckpt_dir, spec.dit_file, spec.t5_file),
            "engine": engine_digest(spec.wan_repo)}


@dataclass(frozen=True)
class Progress:
    """What ``state.json`` says: clips ``0 .. next_clip - 1`` of ``num_clips`` are complete, in the
    video file ``video`` up to ``position`` (its clips ending at the frames ``ends``)."""

    run_dir: Path
    next_clip: int
    num_clips: int
    identity: dict
    video: Optional[Path] = None
    position: Optional[dict] = None
    ends: tuple[int, ...] = ()
    state: str = ""


class Checkpoint:
    """Rank 0's clip checkpoints of one job (:meth:`commit`, once the clip's fragment is in
    ``video``). A served job's ``gate`` decides each write: while the server is not sure it holds
    the job the commit is skipped (the next clip's names every clip before it), once lost
    nothing is written."""

    def __init__(self, run_dir: Path, ident: dict, video: Path):
        self.run_dir, self.ident, self.video = Path(run_dir), ident, Path(video)
        self.written: Optional[str] = None  # the state file state.json names now

    def commit(self, state, num_clips: int, position, ends: list[int], gate=None) -> bool:
        """The state after a clip (``state.clip``: the next one), the file's ``position`` after it:
        its state file, then ``state.json``. False: the gate held it back."""
        import torch

        from wan_s2v_runner.shared import atomic

        current = gate.current if gate is not None else None
        d = self.run_dir / CLIPS_DIR
        d.mkdir(parents=True, exist_ok=True)
        # after the last clip there is no next clip: no motion latents (not computed)
        motion = state.motion_latents.cpu() if state.motion_latents is not None else None
        last = state.videos_last_frames.cpu() if state.videos_last_frames is not None else None
        carried = {"format": FORMAT, "clip": state.clip, "motion_latents": motion, "videos_last_frames": last}
        name = state_file(state.clip)
        info = {"format": FORMAT, "next_clip": state.clip, "num_clips": num_clips, "identity": self.ident,
                "state": name, "video": {"path": str(self.video), "position": position.as_dict(), "ends": list(ends)}}
        try:
            atomic.atomic_write(d / name, lambda p: torch.save(carried, p), commit_if=current)
            atomic.write_text(d / STATE_JSON, json.dumps(info, indent=1), durable=True, commit_if=current)
        except atomic.NotCommitted:  # not sure now: the next clip's commit names this one too
            return False
        for old in d.glob("state_*.pt"):  # what state.json no longer names
            if old.name != name:
                old.unlink(missing_ok=True)
        self.written = name
        return True


def read_progress(run_dir: Path) -> Progress:
    path = Path(run_dir) / CLIPS_DIR / STATE_JSON
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResumeError(f"{run_dir} has no complete clip to resume from ({CLIPS_DIR}/{STATE_JSON} is "
                          "missing). Fix: start the run again with `wan-s2v run`.") from None
    except (OSError, ValueError) as e:
        raise ResumeError(f"{path} does not read ({e}). Fix: start the run again with `wan-s2v run`.") from None
    if info.get("format") != FORMAT:
        raise ResumeError(f"{path} has checkpoint format {info.get('format')} (its clips as float frames, from a "
                          f"wan-s2v before the streaming video writer), this wan-s2v reads {FORMAT}. Fix: resume "
                          "with the wan-s2v version that wrote it, or start the run again.")
    video = info.get("video") or {}
    return Progress(Path(run_dir), int(info["next_clip"]), int(info.get("num_clips") or 0), info["identity"],
                    Path(video["path"]) if video.get("path") else None, video.get("position"),
                    tuple(int(e) for e in video.get("ends") or ()), str(info.get("state") or ""))


def check(progress: Progress, spec) -> None:
    """Raise ResumeError (one line) if ``spec`` would not produce the clips already written."""
    speech = Path(spec.speech)
    if not speech.is_file():  # --tts-text: the speech the run made, kept beside its output for a resume
        made = " (--tts-text wrote it; a resume speaks with it again)" if spec.tts_text else ""
        raise ResumeError(f"cannot resume {progress.run_dir}: its speech {speech} is missing{made}. "
                          "Fix: put the file back, or start a new run with `wan-s2v run`.")
    now = identity(spec)
    what = {"spec": ("the inputs or frame settings (prompt, image, audio, size, steps, seed, LoRAs...)",
                     "resume with the original inputs, or start a new run"),
            "checkpoint": (f"the checkpoint files in {spec.ckpt_dir}", "point --ckpt-dir at the original checkpoint"),
            "engine": ("the Wan2.2 engine's S2V sources", "use the engine version that wrote the clips")}
    for key, (desc, fix) in what.items():
        if progress.identity.get(key) != now[key]:
            raise ResumeError(f"cannot resume {progress.run_dir}: {desc} differ from the run that wrote "
                              f"its clips. Fix: {fix}.")


def load(run_dir: Path, progress: Progress) -> dict:
    """The carried state a run directory's ``state.json`` names (on the CPU)."""
    import torch
    path = Path(run_dir) / CLIPS_DIR / progress.state
    try:
        carried = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as e:
        raise ResumeError(f"{path} does not read ({type(e).__name__}: {e}). Fix: start the run again.") from None
    if carried.get("clip") != progress.next_clip:
        raise ResumeError(f"{path} is for clip {carried.get('clip')}, {STATE_JSON} says "
                          f"{progress.next_clip}. Fix: start the run again.")
    return carried


@dataclass(frozen=True)
class Continued:
    """A resume's starting point: the growing video of the run it continues, where its last
    committed clip ends (:class:`~wan_s2v_runner.shared.fmp4.Position`) and the frame each clip in
    it ends at."""

    video: Path
    at: object  # fmp4.Position
    ends: tuple[int, ...]
    complete: bool = False  # every clip is in it: only finishing it is left


def continued(progress: Progress) -> Continued:
    """Where a resumed job's video continues."""
    from wan_s2v_runner.shared.fmp4 import Position

    if progress.video is None or progress.position is None:
        raise ResumeError(f"{progress.run_dir}: {STATE_JSON} names no video file. Fix: start the run again.")
    return Continued(progress.video, Position.from_dict(progress.position), progress.ends,
                     complete=bool(progress.num_clips) and progress.next_clip >= progress.num_clips)
