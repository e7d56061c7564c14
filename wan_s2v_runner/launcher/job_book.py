"""The job bookkeeping ``wan-s2v batch`` and ``wan-s2v serve`` share: from a job's values to a
:class:`Line` ready for the ranks, and what is known of it on disk.

- :func:`job_spec`: a job's values (a batch line, a server submission) validated as a
  :class:`~wan_s2v_runner.shared.spec.JobSpec` over the command's job defaults, joined to the
  rank group's :class:`~wan_s2v_runner.shared.spec.GroupSpec` (the rules across the two), its
  seed resolved once and kept in its work folder;
- :func:`mark_done_before`: a job whose record and mp4 are already there is not made again;
- :func:`prepare_resume`: a job with clip checkpoints of its own continues from them;
- :func:`refusal`: a failed preflight as one line (the check, the cause, the fix).

The launcher side only: nothing here spawns or serves.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from wan_s2v_runner.shared.config import format_validation_error, key_aliases
from wan_s2v_runner.shared.jobs import GROUP_FIELDS, INPUT_FIELDS, JOB_FIELDS
from wan_s2v_runner.shared.spec import GroupSpec, JobSpec, RunSpec, flag_name

#: a job's clip checkpoints and kept seed: OUTPUT_DIR/.work/ID/
WORK_DIR = ".work"
SEED_FILE = "seed"
#: job fields that name files: relative paths in a jobs file are taken from the file's folder
PATH_FIELDS = (*INPUT_FIELDS, "output", "frames_out")


class JobState(str, Enum):
    """What became of a line of the jobs file."""

    REFUSED = "refused"  # never reached the ranks: the cause is said
    DONE_BEFORE = "done before"  # its record and mp4 were already there
    QUEUED = "queued"  # sent to the rank group
    DONE = "done"
    FAILED = "failed"  # the rank group failed before it was done


@dataclass
class Line:
    """One line of the jobs file and what the launcher made of it."""

    number: int
    id: str
    state: JobState
    spec: Optional[RunSpec] = None
    cause: str = ""
    resume_at: Optional[int] = None  # 1-based clip a resumed job continues at

    @property
    def record(self) -> Optional[Path]:
        return self.spec.output.with_suffix(".json") if self.spec else None


def normalized(values: dict) -> dict:
    """Keys as field names (flag and TOML spellings accepted: ``size``, ``sample_steps``, ...)."""
    names = key_aliases()
    return {names.get(k.replace("-", "_"), k.replace("-", "_")): v for k, v in values.items()}


def job_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """The job fields among the command's values (every job's defaults)."""
    return {k: v for k, v in values.items() if k in JOB_FIELDS}


def group_values(values: dict[str, Any]) -> dict[str, Any]:
    """The rank group's fields among the command's values."""
    return {k: v for k, v in values.items() if k in GROUP_FIELDS}


def job_spec(values: dict[str, Any], defaults: dict[str, Any], group: GroupSpec, output_dir: Path,
             jid: str) -> tuple[Optional[RunSpec], str]:
    """A job's spec on ``group``: its own values (field names, :func:`normalized`) validated as a
    :class:`JobSpec` over ``defaults`` (the command's job values), output ``output_dir/ID.mp4``
    unless it sets one, a seed of -1 resolved once and kept in its work folder, then joined to
    the group (:meth:`RunSpec.of`). Returns (spec, "") or (None, the cause: one line) when the
    values set a group setting or do not validate."""
    fixed = sorted(k for k in values if k in GROUP_FIELDS)
    if fixed:
        return None, (f"{', '.join(fixed)}: set once for the whole rank group, not per job. Fix: give "
                      f"{', '.join(flag_name(k) for k in fixed)} on the command line")
    work = output_dir / WORK_DIR / jid
    merged = {**job_defaults(defaults), "output": output_dir / f"{jid}.mp4", **values}
    if int(merged.get("seed", -1)) == -1 and (work / SEED_FILE).is_file():
        merged["seed"] = int((work / SEED_FILE).read_text())
    try:
        spec = RunSpec.of(group, JobSpec(**merged).with_resolved_seed())
    except (ValidationError, ValueError) as e:
        text = format_validation_error(e) if isinstance(e, ValidationError) else str(e)
        return None, text.splitlines()[0].removeprefix("error: ")
    return spec, ""


def done_before(spec: RunSpec, record: Path, video: Path) -> Optional[dict]:
    """The record of a job made before: it says it finished, for this spec's inputs, checkpoint
    and engine, with ``video`` there and unchanged (None: it was not)."""
    from wan_s2v_runner.shared import media, resume

    try:
        made = json.loads(record.read_text(encoding="utf-8"))
        same = (made.get("status") == "ok" and made.get("identity") == resume.identity(spec)
                and media.sha256_file(video) == made["output"]["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return made if same else None


def mark_done_before(line: Line) -> None:
    """A job whose record says it finished, with its mp4 there and unchanged, is not run again."""
    if done_before(line.spec, line.record, line.spec.output) is not None:
        line.state = JobState.DONE_BEFORE


def resume_point(spec: RunSpec, candidates: list[Path], into: Path) -> Optional[Path]:
    """The folder among ``candidates`` with this job's newest complete clip checkpoint (its clips
    made by this spec's inputs, checkpoint and engine), None when none has one. A ``--tts-text``
    job's speech comes along into ``into`` (its spec's speech path): the clips were made with it."""
    from wan_s2v_runner.shared import resume

    best: Optional[resume.Progress] = None
    for folder in candidates:
        try:
            progress = resume.read_progress(folder)
        except resume.ResumeError:
            continue
        if progress.next_clip == 0 or (best is not None and progress.next_clip <= best.next_clip):
            continue
        if spec.tts_text:
            speech = Path(folder) / spec.tts_speech_path.name
            if Path(folder) != Path(into) and speech.is_file():
                _link(speech, spec.tts_speech_path)
        try:
            resume.check(progress, spec)
        except resume.ResumeError:
            continue
        best = progress
    if best is not None and spec.tts_text and Path(best.run_dir) != Path(into):
        _link(Path(best.run_dir) / spec.tts_speech_path.name, spec.tts_speech_path)
    return Path(best.run_dir) if best is not None else None


def _link(src: Path, dest: Path) -> None:
    """``dest`` as a hard link of ``src`` (a copy where links are not possible)."""
    import os

    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def prepare_resume(line: Line, work: Path) -> None:
    """Continue from the job's clip checkpoints when they are this job's (else start over)."""
    from wan_s2v_runner.shared import resume

    point = resume_point(line.spec, [work], work)
    if point is None:
        shutil.rmtree(work / resume.CLIPS_DIR, ignore_errors=True)
        return
    progress = resume.read_progress(point)
    line.spec = line.spec.model_copy(update={"resume_from": work})
    line.resume_at = progress.next_clip + 1


def refusal(report) -> str:
    """A refused preflight report's first failure, as one line: the check, the cause, the fix."""
    from wan_s2v_runner.preflight import Status

    fail = report.with_status(Status.FAIL)[0]
    return f"preflight {fail.id}: {fail.finding}" + (f". Fix: {fail.fix}" if fail.fix else "")


