"""A run that met a full disk: a job error, said in one line under its own exit code.

A full disk (ENOSPC, or a spent quota) loses nothing a run committed: the clips whose checkpoints
are on disk stay in the video so far, and ``wan-s2v resume RUN_DIR`` finishes it byte for byte once
there is room. So the launcher turns it into :data:`~wan_s2v_runner.shared.exit_codes.DISK_FULL`
with one line (:func:`line`): the filesystem (its mount point, and the file whose write failed),
what it has free and what the rest needs when known, what was kept, and the fix. Whoever saw it
first: a rank (its ``error`` or ``job_failed`` event: a ``disk`` field,
:func:`wan_s2v_runner.shared.disk.describe`, else its error's text), or the launcher itself
writing ``run.json`` (:func:`written_by_launcher`).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from wan_s2v_runner.launcher.supervisor import Outcome
from wan_s2v_runner.shared import exit_codes, resume
from wan_s2v_runner.shared.disk import (
    DiskError,
    free_bytes,
    full_error,
    mount_point,
    path_in,
    says_full,
    size_text,
    why,
)
from wan_s2v_runner.shared.spec import RunSpec


def facts_of(outcome: Outcome, ranks: dict) -> Optional[dict[str, Any]]:
    """A failed run's full-disk facts (``path``, ``need_bytes``, where known), or None when its
    failure was not a full disk: the failing rank's ``disk`` field first, then its error's text,
    then a job's own error (``job_failed``) on any rank."""
    if outcome.code != exit_codes.RANK_FAILED:
        return None
    order = sorted(ranks.values(), key=lambda st: st.rank != outcome.failed_rank)  # the failing rank first
    # a rank's own error, else the job it failed (a rank that raised says why itself: an earlier job's
    # full disk, which the group outlived, is not a later crash's cause)
    said = [st.error if st.error else st.job_failed for st in order]
    for ev in said:
        if ev and isinstance(ev.get("disk"), dict):
            return dict(ev["disk"])
    texts = [outcome.error, outcome.reason] + [str((ev or {}).get(k) or "") for ev in said
                                               for k in ("message", "error")]
    for text in texts:
        if says_full(text):
            return {"path": str(path_in(text)) if path_in(text) else None, "need_bytes": None, "why": why(text)}
    return None


def written_by_launcher(e: OSError) -> Optional[dict[str, Any]]:
    """The facts of the launcher's own write that met a full disk (None: not a full disk)."""
    if full_error(e) is None:
        return None
    path = e.path if isinstance(e, DiskError) else (Path(e.filename) if isinstance(e.filename, str) else None)
    return {"path": str(path) if path else None, "need_bytes": e.need if isinstance(e, DiskError) else None,
            "why": why(full_error(e))}


def outcome(was: Outcome, facts: dict[str, Any], run_dir: Path, own_job: Optional[RunSpec],
            served: bool = False) -> Outcome:
    """``was`` (a failure, or a run whose manifest could not be written) as a full disk: the one
    line, the exit code; the failing rank, its stage and error kept for ``run.json``, no traceback
    or hint printed."""
    return replace(was, code=exit_codes.DISK_FULL, reason=line(facts, run_dir, own_job, served), hint=None)


def line(facts: dict[str, Any], run_dir: Path, own_job: Optional[RunSpec], served: bool = False) -> str:
    """``the disk is full (No space left on device): the filesystem at M (writing F) has 0 B free;
    the 2 clips left need about 1.2 MB; kept: clip 1 of 3 in OUT.partial.mp4. Fix: free space on
    M, then `wan-s2v resume RUN_DIR```."""
    where = Path(facts["path"]) if facts.get("path") else (own_job.output if own_job else Path(run_dir))
    mount = Path(facts["mount"]) if facts.get("mount") else mount_point(where)
    writing = f" (writing {where})" if facts.get("path") else ""
    free = free_bytes(mount)
    text = f"the disk is full ({facts.get('why') or why(None)}): the filesystem at {mount}{writing} has " \
           f"{size_text(free)} free"
    need = facts.get("need_bytes")
    kept, then, left = _kept(run_dir, own_job, served)
    if left is not None:
        text += (f"; the {left[0]} clips left need about {size_text(left[1])}" if left[0] != 1
                 else f"; the clip left needs about {size_text(left[1])}")
    elif need:
        text += f"; the write needed {size_text(need)}"
    return f"{text}; kept: {kept}. Fix: free space on {mount}, then {then}"


def _kept(run_dir: Path, own_job: Optional[RunSpec], served: bool) -> tuple[str, str, Optional[tuple]]:
    """What the run kept, the command that continues it, and (clips left, about the bytes they need)
    when the video so far tells (its clips' bytes so far, a clip each)."""
    if served:  # a server's group: its keeper puts the job back in the queue, or fails it
        return ("the running job's finished clips", "the server goes on (delete videos, or set --keep-videos / "
                "--keep-hours)", None)
    if own_job is None:
        return ("each job's finished clips (in the output directory's .work/)",
                "run the same `wan-s2v batch` command again (it resumes the interrupted job)", None)
    for d in (Path(run_dir), own_job.resume_from):
        if d is None:
            continue
        try:
            p = resume.read_progress(Path(d))
        except (resume.ResumeError, OSError, ValueError, KeyError):
            continue
        if p.next_clip <= 0:
            continue
        clips = f"clip 1 of {p.num_clips}" if p.next_clip == 1 else f"clips 1-{p.next_clip} of {p.num_clips}"
        kept = f"{clips} in {p.video}" if p.video else clips
        size = (p.position or {}).get("size")
        left = p.num_clips - p.next_clip
        estimate = (left, size / p.next_clip * left) if size and left > 0 else None
        return kept, f"`wan-s2v resume {d}`", estimate
    return "no complete clip yet", "run the same command again", None
