"""Clip checkpoints and resume: a long run survives a crash, an OOM or a preempted VM.

After each clip the decoding rank (rank 0) writes, into ``<run_dir>/clips/``, the clip's frames
(``clip_0003.pt``), then the state the next clip needs (``state.pt``: next clip index, motion
latents, the last 73 frames), then ``state.json`` (which clip is complete, and the identity of
what produced it: a digest of the frame-deciding spec fields and input files, of the checkpoint
files, and of the engine's S2V sources). Each file appears by rename (``atomic``), in that
order, so ``state.json`` always names a complete clip.

``wan-s2v resume RUN_DIR`` reads that run's ``spec.json`` (layout flags may change: another
mode, rank count or ``--cfg-parallel``), refuses with a one-line cause when the inputs,
checkpoint or engine differ from what produced the clips, and runs the remaining clips in a new
run directory. The clip noise is seeded ``seed + clip`` and the carried state is restored bit
for bit, so the final video equals an uninterrupted run's.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared import cache_policy
from wan_s2v_runner.shared.quant import Fp8Matmul

CLIPS_DIR = "clips"
STATE_JSON = "state.json"
STATE_PT = "state.pt"
FORMAT = 1
#: spec fields that decide the frames (layout, supervision and output fields do not)
FRAME_FIELDS = ("prompt", "negative_prompt", "max_area", "infer_frames", "num_clips", "steps", "shift",
                "guide_scale", "solver", "seed", "start_from_ref", "device", "lora", "dit_quant", "fp8_matmul",
                "cache")


class ResumeError(ValueError):
    """A run directory that cannot be resumed (one line: cause and fix)."""


def clip_file(run_dir: Path, clip: int) -> Path:
    return Path(run_dir) / CLIPS_DIR / f"clip_{clip:04d}.pt"


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
    data["image_sha256"] = sha256_file(spec.image)
    data["audio_sha256"] = sha256_file(spec.speech)  # --tts-text: the speech it made (kept for a resume)
    if spec.pose_video:
        data["pose_sha256"] = sha256_file(spec.pose_video)
    data["lora_sha256"] = [sha256_file(ref.path) for ref in spec.lora]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def checkpoint_digest(ckpt_dir: Path, dit_file: Optional[Path] = None) -> str:
    """Names and sizes of every checkpoint file (and of ``dit_file``, a ``--dit-file``), and the
    DiT config's bytes (cheap: no weights read)."""
    from wan_s2v_runner.shared.ckpt_layout import DIT_CONFIG

    ckpt_dir = Path(ckpt_dir)
    rows = sorted((str(p.relative_to(ckpt_dir)), p.stat().st_size) for p in ckpt_dir.rglob("*") if p.is_file())
    if dit_file is not None:
        rows.append(["--dit-file", Path(dit_file).name, Path(dit_file).stat().st_size])
    h = hashlib.sha256(json.dumps(rows).encode())
    cfg = ckpt_dir / DIT_CONFIG
    if cfg.is_file():
        h.update(cfg.read_bytes())
    return h.hexdigest()


def engine_digest(wan_repo: Optional[Path]) -> str:
    from wan_s2v_runner.shared import engine_source
    return engine_source.s2v_fingerprint(engine_source.locate(wan_repo).package_dir)


def identity(spec) -> dict:
    return {"spec": spec_digest(spec), "checkpoint": checkpoint_digest(spec.ckpt_dir, spec.dit_file),
            "engine": engine_digest(spec.wan_repo)}


@dataclass(frozen=True)
class Progress:
    """What ``state.json`` says: clips ``0 .. next_clip - 1`` of ``num_clips`` are complete."""

    run_dir: Path
    next_clip: int
    num_clips: int
    identity: dict


class ClipWriter:
    """Rank 0's per-clip checkpoint writer (``Hooks.clip_done``). ``gate`` (a served job's lease,
    :class:`~wan_s2v_runner.rank.lease.LeaseGate`; None: always current) decides each write: while
    its verdict is ``unknown`` the clips are kept (the frames are rank 0's anyway until the video
    is written; the carried state is replaced, never changed, by the next clip) and written, in
    order, at the first clip whose verdict is ``current``; once ``lost``, nothing more is written."""

    def __init__(self, run_dir: Path, ident: dict, gate=None):
        self.run_dir, self.ident, self.gate = Path(run_dir), ident, gate
        self.pending: list[tuple[int, object]] = []  # (clip, frames) owed to the directory
        self.latest: Optional[tuple[object, int]] = None  # (state, num_clips) of the newest clip
        self.adopting: Optional[tuple[Path, int]] = None  # a resume's earlier clips, linked in first
        self.lost = False

    def adopt(self, source: Path, next_clip: int) -> None:
        """A resume: the clips ``source`` made before (0 .. next_clip - 1) belong in this folder
        too (so it can be resumed in turn); linked now if the gate says so, else before the
        first clip written."""
        from wan_s2v_runner.shared.inbox import Verdict

        self.adopting = (Path(source), next_clip)
        if self.gate is None or self.gate.verdict() is Verdict.CURRENT:
            self.flush()

    def __call__(self, clip: int, frames, state, num_clips: int) -> None:
        from wan_s2v_runner.shared.inbox import Verdict

        if self.lost:
            return
        self.pending.append((clip, frames))
        self.latest = (state, num_clips)
        verdict = self.gate.verdict() if self.gate is not None else Verdict.CURRENT
        if verdict is Verdict.LOST:
            self.lost, self.pending, self.latest, self.adopting = True, [], None, None
        elif verdict is Verdict.CURRENT:
            self.flush()

    def _current(self) -> bool:
        from wan_s2v_runner.shared.inbox import Verdict

        return self.gate is None or self.gate.verdict() is Verdict.CURRENT

    def flush(self) -> None:
        """Write the clips owed, then the newest clip's carried state and ``state.json``, the gate
        asked before each rename: what it stops stays owed (``state.json`` last, so it names only
        clips on disk)."""
        import torch

        from wan_s2v_runner.shared import atomic
        if not self._current():
            return
        (self.run_dir / CLIPS_DIR).mkdir(parents=True, exist_ok=True)
        if self.adopting is not None:
            adopt(*self.adopting, self.run_dir)
            self.adopting = None
        try:
            while self.pending:
                clip, frames = self.pending[0]
                frames = frames.contiguous()
                atomic.atomic_write(clip_file(self.run_dir, clip), lambda p, f=frames: torch.save(f, p),
                                    commit_if=self._current)
                self.pending.pop(0)
            if self.latest is None:
                return
            state, num_clips = self.latest
            # after the last clip there is no next clip: no motion latents (not computed)
            motion = state.motion_latents.cpu() if state.motion_latents is not None else None
            carried = {"format": FORMAT, "clip": state.clip, "motion_latents": motion,
                       "videos_last_frames": state.videos_last_frames.cpu()}
            atomic.atomic_write(self.run_dir / CLIPS_DIR / STATE_PT, lambda p: torch.save(carried, p),
                                commit_if=self._current)
            info = {"format": FORMAT, "next_clip": state.clip, "num_clips": num_clips,
                    "identity": self.ident}
            atomic.write_text(self.run_dir / CLIPS_DIR / STATE_JSON, json.dumps(info, indent=1),
                              commit_if=self._current)
            self.latest = None
        except atomic.NotCommitted:  # not sure now: the rest is written at a later clip, if the lease is renewed
            pass


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
        raise ResumeError(f"{path} has checkpoint format {info.get('format')}, this wan-s2v reads {FORMAT}. "
                          "Fix: resume with the wan-s2v version that wrote it.")
    return Progress(Path(run_dir), int(info["next_clip"]), int(info.get("num_clips") or 0), info["identity"])


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


def load(run_dir: Path, progress: Progress):
    """(state dict, frames of clips 0 .. next_clip - 1) of a run directory."""
    import torch
    carried = torch.load(Path(run_dir) / CLIPS_DIR / STATE_PT, map_location="cpu", weights_only=True)
    if carried.get("clip") != progress.next_clip:
        raise ResumeError(f"{run_dir}: {STATE_PT} is for clip {carried.get('clip')}, {STATE_JSON} says "
                          f"{progress.next_clip}. Fix: start the run again.")
    frames = [torch.load(clip_file(run_dir, r), map_location="cpu", weights_only=True)
              for r in range(progress.next_clip)]
    return carried, frames


def adopt(old_run_dir: Path, next_clip: int, new_run_dir: Path) -> None:
    """Link (or copy) the finished clips into the new run directory, so it can be resumed too."""
    (Path(new_run_dir) / CLIPS_DIR).mkdir(parents=True, exist_ok=True)
    for r in range(next_clip):
        src, dst = clip_file(old_run_dir, r), clip_file(new_run_dir, r)
        if dst.exists():
            continue
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
