"""``wan-s2v batch JOBS``: many videos from one load.

JOBS is a JSON Lines file (one object a line) or a CSV file (a header row): each line sets a job's
own fields (:data:`~wan_s2v_runner.shared.jobs.JOB_FIELDS`: ``image``, ``audio``, ``prompt``,
``seed``, ``size``/``max_area``, ``steps``, ..., any spelling the flags and TOML accept) and an
optional ``id`` (relative paths are taken from the jobs file's folder); the command's flags (and ``--config``, and
the environment) give every job's
defaults and the rank group's settings (checkpoint, mode, layout, LoRAs, device). A line that
sets a group setting differently is refused.

Every line is checked before anything is spawned, by the same rules as ``wan-s2v run``: the spec's
validation, then preflight (inputs, sizes, memory plan) for that job. A bad line is refused with
its cause and the batch goes on with the others. The accepted jobs go to one rank group: it
loads once and makes them in order. Each job writes ``OUTPUT_DIR/ID.mp4`` (or its own
``output``) and, beside it, ``ID.json``, its record (seed, stage seconds, output sha256, the
digests that identify its inputs).

Running the same command again after a crash skips every job whose record and mp4 are there and
match, and resumes the interrupted job from its last clip checkpoint (kept in
``OUTPUT_DIR/.work/ID/``, as ``wan-s2v resume`` does for a run). A job with seed -1 gets its seed
once, kept there too, so a resumed job keeps it. At the end a table says what became of each job.
"""
from __future__ import annotations

import csv
import json
import shutil
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.jobs import INPUT_FIELDS, JOB_FIELDS, Job, group_differences, job_id
from wan_s2v_runner.shared.spec import RunSpec, flag_name, format_validation_error, key_aliases

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


class JobsFileError(ValueError):
    """The jobs file cannot be read at all (one line: cause and fix)."""


def read_lines(path: Path) -> list[tuple[int, Any]]:
    """(line number, dict of values) per job; a line that does not parse gives its error text."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise JobsFileError(f"cannot read the jobs file {path} ({e}). Fix: pass a JSON Lines or CSV file.") from None
    if path.suffix.lower() == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
        return [(i + 2, {k.strip(): v for k, v in row.items() if k and v not in (None, "")})
                for i, row in enumerate(rows)]
    out: list[tuple[int, Any]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        try:
            value = json.loads(raw)
        except ValueError as e:
            out.append((number, f"not JSON ({e})"))
            continue
        out.append((number, value if isinstance(value, dict) else "not a JSON object"))
    return out


def normalized(values: dict) -> dict:
    """Keys as field names (flag and TOML spellings accepted: ``size``, ``sample_steps``, ...)."""
    names = key_aliases()
    return {names.get(k.replace("-", "_"), k.replace("-", "_")): v for k, v in values.items()}


def job_spec(values: dict[str, Any], base: dict[str, Any], output_dir: Path, jid: str,
             first: Optional[RunSpec] = None) -> tuple[Optional[RunSpec], str]:
    """A job's spec: its own values (field names, :func:`normalized`) over ``base`` (the command's
    values: the group's settings and every job's defaults), output ``output_dir/ID.mp4``, a seed
    of -1 resolved once and kept in its work folder. Returns (spec, "") or (None, the cause: one
    line) when the values set a group setting, do not validate, or differ from ``first``'s
    group settings."""
    fixed = sorted(k for k in values if k in RunSpec.model_fields and k not in JOB_FIELDS)
    if fixed:
        return None, (f"{', '.join(fixed)}: set once for the whole rank group, not per job. Fix: give "
                      f"{', '.join(flag_name(k) for k in fixed)} on the command line")
    work = output_dir / WORK_DIR / jid
    merged = {**base, "output": output_dir / f"{jid}.mp4", **values}
    if int(merged.get("seed", -1)) == -1 and (work / SEED_FILE).is_file():
        merged["seed"] = int((work / SEED_FILE).read_text())
    try:
        spec = RunSpec(**merged).with_resolved_seed()
    except (ValidationError, ValueError) as e:
        text = format_validation_error(e) if isinstance(e, ValidationError) else str(e)
        return None, text.splitlines()[0].removeprefix("error: ")
    differs = group_differences(first, spec) if first is not None else []
    if differs:
        return None, (f"{', '.join(differs)} differ from the first job's; one rank group runs one setting of "
                      "those")
    return spec, ""


def plan_lines(path: Path, base: dict[str, Any], output_dir: Path) -> list[Line]:
    """Every line validated into a job spec (or refused with its cause), ids unique, seeds kept."""
    lines: list[Line] = []
    first: Optional[RunSpec] = None
    seen: set[str] = set()
    for number, values in read_lines(path):
        if isinstance(values, str):
            lines.append(Line(number, f"line{number}", JobState.REFUSED, cause=values))
            continue
        values = normalized(values)
        jid = str(values.pop("id", "") or job_id(values))
        for key in PATH_FIELDS:  # a relative path in the file is relative to the file
            if isinstance(values.get(key), str) and not Path(values[key]).expanduser().is_absolute():
                values[key] = str(path.parent / values[key])
        if jid in seen:
            lines.append(Line(number, jid, JobState.REFUSED, cause=f"id {jid!r} is used by an earlier line"))
            continue
        seen.add(jid)
        spec, cause = job_spec(values, base, output_dir, jid, first)
        if spec is None:
            lines.append(Line(number, jid, JobState.REFUSED, cause=cause))
            continue
        first = first or spec
        lines.append(Line(number, jid, JobState.QUEUED, spec=spec))
    return lines


def mark_done_before(line: Line) -> None:
    """A job whose record says it finished, with its mp4 there and unchanged, is not run again."""
    from wan_s2v_runner.shared import media, resume

    try:
        record = json.loads(line.record.read_text(encoding="utf-8"))
        same = (record.get("status") == "ok" and record.get("identity") == resume.identity(line.spec)
                and media.sha256_file(line.spec.output) == record["output"]["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if same:
        line.state = JobState.DONE_BEFORE


def prepare_resume(line: Line, work: Path) -> None:
    """Continue from the job's clip checkpoints when they are this job's (else start over)."""
    from wan_s2v_runner.shared import resume

    try:
        progress = resume.read_progress(work)
        resume.check(progress, line.spec)
    except resume.ResumeError:
        shutil.rmtree(work / resume.CLIPS_DIR, ignore_errors=True)
        return
    if progress.next_clip > 0:
        line.spec = line.spec.model_copy(update={"resume_from": work})
        line.resume_at = progress.next_clip + 1


def refusal(report) -> str:
    """A refused preflight report's first failure, as one line: the check, the cause, the fix."""
    from wan_s2v_runner.preflight import Status

    fail = report.with_status(Status.FAIL)[0]
    return f"preflight {fail.id}: {fail.finding}" + (f". Fix: {fail.fix}" if fail.fix else "")


def preflight_lines(lines: list[Line], json_mode: bool) -> Optional[int]:
    """Preflight every queued job (the machine probed once); refuse the ones that fail. Returns
    the load waves the memory plan chose for the group, if any."""
    from wan_s2v_runner.preflight import GateReport, check_run, machine_facts
    from wan_s2v_runner.preflight.render import print_gate

    facts = machine_facts()
    waves = None
    shown = False
    for line in lines:
        if line.state is not JobState.QUEUED:
            continue
        report: GateReport = check_run(line.spec, facts)
        if report.refused:
            line.state = JobState.REFUSED
            line.cause = refusal(report)
            continue
        if not shown:  # the group's checks once, for the first job
            print_gate(report, json_mode)
            shown = True
            waves = report.data_of("memory.host").get("waves")
    return waves


def summary(lines: list[Line], records: dict[str, dict]) -> str:
    rows = [("line", "id", "state", "seconds", "output / cause")]
    for line in lines:
        rec = records.get(line.id) or {}
        secs = f"{rec['wall_s']:.1f}" if line.state is JobState.DONE and "wall_s" in rec else ""
        what = line.cause if line.state is JobState.REFUSED else (str(line.spec.output) if line.spec else "")
        state = line.state.value + (f" (resumed at clip {line.resume_at})" if line.resume_at and
                                    line.state is JobState.DONE else "")
        rows.append((str(line.number), line.id, state, secs, what))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)


def run_batch(path: Path, base: dict[str, Any], output_dir: Path, *, json_mode: bool = False,
              skip_preflight: bool = False, extra_env: Optional[dict] = None) -> int:
    """Plan, check and run the jobs of ``path``; print the summary. Returns the exit code."""
    from wan_s2v_runner.launcher import launch
    from wan_s2v_runner.launcher.console import Display

    try:
        lines = plan_lines(path, base, output_dir)
    except JobsFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    for line in lines:
        if line.state is JobState.QUEUED:
            mark_done_before(line)
    waves = None if skip_preflight else preflight_lines(lines, json_mode)
    jobs: list[Job] = []
    for line in lines:
        if line.state is not JobState.QUEUED:
            continue
        work = output_dir / WORK_DIR / line.id
        work.mkdir(parents=True, exist_ok=True)
        (work / SEED_FILE).write_text(str(line.spec.seed))
        line.record.unlink(missing_ok=True)  # a record says done only when this launch writes it
        prepare_resume(line, work)
        jobs.append(Job(id=line.id, spec=line.spec, work_dir=work, record=line.record))
    for line in lines:
        if line.state is JobState.REFUSED:
            print(f"batch: line {line.number} ({line.id}) refused: {line.cause}", file=sys.stderr)
        elif line.state is JobState.DONE_BEFORE:
            print(f"batch: line {line.number} ({line.id}) done before: {line.spec.output}", file=sys.stderr)
        elif line.resume_at:
            print(f"batch: line {line.number} ({line.id}) resumes at clip {line.resume_at}", file=sys.stderr)
    code = exit_codes.OK
    if jobs:
        spec = jobs[0].spec
        if spec.load_waves is None and waves and waves > 1:
            jobs = [job.model_copy(update={"spec": job.spec.model_copy(update={"load_waves": waves})})
                    for job in jobs]
            spec = jobs[0].spec
        code = launch.run(spec, display=Display.auto(json_mode=json_mode), extra_env=extra_env, jobs=jobs)
        if not spec.writes_output:  # another node: node 0's rank 0 makes node 0's list and writes it all
            return code
    records: dict[str, dict] = {}
    for line in lines:
        if line.state is not JobState.QUEUED:
            continue
        try:
            records[line.id] = json.loads(line.record.read_text(encoding="utf-8"))
            line.state = JobState.DONE if records[line.id].get("status") == "ok" else JobState.FAILED
        except (OSError, ValueError):
            line.state = JobState.FAILED
    print(summary(lines, records), file=sys.stderr if json_mode else sys.stdout)
    if code != exit_codes.OK:
        return code
    if any(line.state is JobState.FAILED for line in lines):
        return exit_codes.RANK_FAILED
    return exit_codes.PREFLIGHT if any(line.state is JobState.REFUSED for line in lines) else exit_codes.OK
