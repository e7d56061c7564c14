"""Jobs: what one video needs beyond what the rank group holds for its whole life.

A rank group (one ``torch.distributed.run`` launch) loads the checkpoint once, in one mode and
layout, with its LoRAs, device and attention backend, then makes one or more videos. Each video
is a :class:`Job`: the complete :class:`~wan_s2v_runner.shared.spec.RunSpec` of that video (its
:data:`JOB_FIELDS` are the job's own: inputs, sampling settings, outputs; every other field is the
group's, equal in every job), the directory its clip checkpoints go to, and where rank 0 writes
its record. ``wan-s2v run`` is a group of one job; ``wan-s2v batch`` a group of many.

The launcher writes the group's jobs to ``jobs.jsonl`` in the run directory (:func:`write_jobs`);
rank 0 reads them (:func:`read_jobs`) and hands each to every rank in turn. A job's frames depend
on its spec alone: the same as ``wan-s2v run`` with that spec.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict

from wan_s2v_runner.shared import atomic
from wan_s2v_runner.shared.spec import AbsPath, RunSpec

#: the RunSpec fields a job sets for itself; the rest belong to the rank group
JOB_FIELDS: tuple[str, ...] = ("image", "audio", "pose_video", "tts_text", "tts_prompt_audio", "tts_prompt_text",
                               "prompt", "negative_prompt", "max_area", "infer_frames", "num_clips", "steps", "shift",
                               "guide_scale", "solver", "seed", "start_from_ref", "output", "frames_out", "resume_from")
#: the job fields that are input files (a server takes each as an upload or a path under --allow-dir)
INPUT_FIELDS: tuple[str, ...] = ("image", "audio", "pose_video", "tts_prompt_audio")
#: the job fields that say where a job's results go (a server decides them, never a client)
OUTPUT_FIELDS: tuple[str, ...] = ("output", "frames_out", "resume_from")
#: the job fields a client of ``wan-s2v serve`` sets besides the input files
SUBMIT_FIELDS: tuple[str, ...] = tuple(k for k in JOB_FIELDS if k not in (*INPUT_FIELDS, *OUTPUT_FIELDS))
JOBS_FILE = "jobs.jsonl"


class Job(BaseModel):
    """One video of a rank group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    spec: RunSpec  # the whole spec of this video (the group's fields and the job's own)
    work_dir: AbsPath  # clip checkpoints go to work_dir/clips (resume reads them there)
    record: Optional[AbsPath] = None  # rank 0 writes the job's record here (JSON) when it is done


def group_fields() -> tuple[str, ...]:
    """The RunSpec fields the rank group fixes for its life (every field but :data:`JOB_FIELDS`)."""
    return tuple(k for k in RunSpec.model_fields if k not in JOB_FIELDS)


def group_differences(a: RunSpec, b: RunSpec) -> list[str]:
    """The group fields in which two specs differ (two jobs of one group differ in none)."""
    return [k for k in group_fields() if getattr(a, k) != getattr(b, k)]


def job_id(values: dict[str, Any]) -> str:
    """A stable id for a job's settings (the same line gives the same id in every launch)."""
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def write_jobs(run_dir: Path, jobs: list[Job]) -> Path:
    path = Path(run_dir) / JOBS_FILE
    atomic.write_text(path, "".join(job.model_dump_json() + "\n" for job in jobs))
    return path


def read_jobs(run_dir: Path) -> Optional[list[Job]]:
    """The run's jobs, or None when the launcher wrote none (a run of the spec alone)."""
    path = Path(run_dir) / JOBS_FILE
    if not path.is_file():
        return None
    return [Job.model_validate_json(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
