"""``wan-s2v batch JOBS``: many videos from one load.

JOBS is a JSON Lines file (one object a line) or a CSV file (a header row): each line sets a job's
own fields (a :class:`~wan_s2v_runner.shared.spec.JobSpec`: ``image``, ``audio``, ``prompt``,
``seed``, ``size``/``max_area``, ``steps``, ..., any spelling the flags and TOML accept) and an
optional ``id`` (relative paths are taken from the jobs file's folder); the command's flags (and
``--config``, and the environment) give every job's defaults and the rank group's settings (a
:class:`~wan_s2v_runner.shared.spec.GroupSpec`: checkpoint, mode, layout, LoRAs, device), checked
once before any line. A line that sets a group setting is refused. The bookkeeping shared with
``wan-s2v serve`` (job specs, records, resume) is
:mod:`wan_s2v_runner.launcher.job_book`.

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
import sys
from pathlib import Path
from typing import Any, Optional

from wan_s2v_runner.launcher.job_book import (
    PATH_FIELDS,
    SEED_FILE,
    WORK_DIR,
    JobState,
    Line,
    job_spec,
    mark_done_before,
    normalized,
    prepare_resume,
    refusal,
)
from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.jobs import Job, job_id
from wan_s2v_runner.shared.spec import GroupSpec


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


def plan_lines(path: Path, base: dict[str, Any], group: GroupSpec, output_dir: Path) -> list[Line]:
    """Every line validated into a job spec on ``group`` (or refused with its cause), ids unique,
    seeds kept (``base``: the command's values, every job's defaults)."""
    lines: list[Line] = []
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
        spec, cause = job_spec(values, base, group, output_dir, jid)
        if spec is None:
            lines.append(Line(number, jid, JobState.REFUSED, cause=cause))
            continue
        lines.append(Line(number, jid, JobState.QUEUED, spec=spec))
    return lines


def preflight_lines(lines: list[Line], json_mode: bool) -> dict:
    """Preflight every queued job (the machine probed once); refuse the ones that fail. Returns
    what the memory plan fills in for the group (:meth:`GateReport.settled`): the most load waves
    and the fewest resident blocks any job's plan asks for (one group runs them all)."""
    from wan_s2v_runner.preflight import GateReport, check_run, machine_facts
    from wan_s2v_runner.preflight.render import print_gate

    facts = machine_facts()
    settled: dict = {}
    shown = False
    # one group runs every job: with several, a new prompt builds released encoders again beside
    # the DiT (the plan counts them as a server's group, served)
    several = sum(line.state is JobState.QUEUED for line in lines) > 1
    for line in lines:
        if line.state is not JobState.QUEUED:
            continue
        report: GateReport = check_run(line.spec, facts, served=several)
        if report.refused:
            line.state = JobState.REFUSED
            line.cause = refusal(report)
            continue
        if not shown:  # the group's checks once, for the first job
            print_gate(report, json_mode)
            shown = True
        for key, value in report.settled(line.spec).items():
            settled[key] = (max if key == "load_waves" else min)(settled.get(key, value), value)
    return settled


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


def run_batch(path: Path, base: dict[str, Any], group: GroupSpec, output_dir: Path, *, json_mode: bool = False,
              skip_preflight: bool = False, extra_env: Optional[dict] = None) -> int:
    """Plan, check and run the jobs of ``path`` on ``group`` (``base``: the command's values, every
    job's defaults); print the summary. Returns the exit code."""
    from wan_s2v_runner.launcher import launch
    from wan_s2v_runner.launcher.console import Display

    try:
        lines = plan_lines(path, base, group, output_dir)
    except JobsFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    for line in lines:
        if line.state is JobState.QUEUED:
            mark_done_before(line)
    settled = {} if skip_preflight else preflight_lines(lines, json_mode)
    jobs: list[Job] = []
    for line in lines:
        if line.state is not JobState.QUEUED:
            continue
        work = output_dir / WORK_DIR / line.id
        work.mkdir(parents=True, exist_ok=True)
        (work / SEED_FILE).write_text(str(line.spec.seed))
        line.record.unlink(missing_ok=True)  # a record says done only when this launch writes it
        prepare_resume(line, work)
        jobs.append(Job(id=line.id, spec=line.spec.job, work_dir=work, record=line.record))
    for line in lines:
        if line.state is JobState.REFUSED:
            print(f"batch: line {line.number} ({line.id}) refused: {line.cause}", file=sys.stderr)
        elif line.state is JobState.DONE_BEFORE:
            print(f"batch: line {line.number} ({line.id}) done before: {line.spec.output}", file=sys.stderr)
        elif line.resume_at:
            print(f"batch: line {line.number} ({line.id}) resumes at clip {line.resume_at}", file=sys.stderr)
    code = exit_codes.OK
    if jobs:
        group = group.model_copy(update={k: v for k, v in settled.items() if getattr(group, k) is None})
        code = launch.run_batch(group, jobs, observers=[Display.auto(json_mode=json_mode)], extra_env=extra_env)
        if not group.writes_output:  # another node: node 0's rank 0 makes node 0's list and writes it all
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
