"""Jobs: what one video needs beyond what the rank group holds for its whole life.

A rank group (one launch of its nodes' agents) loads the checkpoint once, in one mode and
layout, with its LoRAs, device and attention backend (its
:class:`~wan_s2v_runner.shared.spec.GroupSpec`), then makes one or more videos. Each video is a
:class:`Job`: its :class:`~wan_s2v_runner.shared.spec.JobSpec` (inputs, sampling, outputs), the
directory its clip checkpoints go to, and where rank 0 writes its record. A rank makes it from
``RunSpec.of(group, job.spec)``. ``wan-s2v run`` is a group of one job; ``wan-s2v batch`` a group
of many; ``wan-s2v serve`` a group that takes jobs as they come.

The launcher writes the group's jobs to ``jobs.jsonl`` in the run directory (:func:`write_jobs`);
rank 0 reads them (:func:`read_jobs`) and hands each to every rank in turn. A job's frames depend
on its group and job specs alone: the same as ``wan-s2v run`` with that spec.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict

from wan_s2v_runner.shared import atomic
from wan_s2v_runner.shared.spec import AbsPath, FlagGroup, GroupSpec, JobSpec, RunSpec, flag_of

#: the fields a job sets for itself (:class:`JobSpec`'s)
JOB_FIELDS: tuple[str, ...] = tuple(JobSpec.model_fields)
#: the fields the rank group fixes for its life (:class:`GroupSpec`'s)
GROUP_FIELDS: tuple[str, ...] = tuple(GroupSpec.model_fields)
#: the job fields that are input files (a server takes each as an upload or a path under --allow-dir)
INPUT_FIELDS: tuple[str, ...] = ("image", "audio", "pose_video", "tts_prompt_audio")
#: the job fields that say where a job's results go (a server decides them, never a client)
OUTPUT_FIELDS: tuple[str, ...] = tuple(k for k in JOB_FIELDS if flag_of(k).group is FlagGroup.OUTPUTS)
#: the job fields a client of ``wan-s2v serve`` sets besides the input files
#: the job fields only the server's live sessions set (``POST /v1/videos/sessions``), never a submission
SESSION_FIELDS: tuple[str, ...] = ("session",)
SUBMIT_FIELDS: tuple[str, ...] = tuple(k for k in JOB_FIELDS if k not in (*INPUT_FIELDS, *OUTPUT_FIELDS,
                                                                             *SESSION_FIELDS))
JOBS_FILE = "jobs.jsonl"


class Job(BaseModel):
    """One video of a rank group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    spec: JobSpec  # the video's own settings; its group's are the run's spec.json
    work_dir: AbsPath  # clip checkpoints go to work_dir/clips (resume reads them there)
    record: Optional[AbsPath] = None  # rank 0 writes the job's record here (JSON) when it is done
    #: a live session's: where its server posts its speech events (shared.inbox.post_speech)
    speech_dir: Optional[AbsPath] = None

    def run_spec(self, group: GroupSpec) -> RunSpec:
        """The whole spec of this video on ``group``."""
        return RunSpec.of(group, self.spec)


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
