"""Command line: ``wan-s2v run|demo|doctor|resume|batch|serve|submit|jobs|warm|cache``
(``run_s2v_multi_gpu.py`` is ``wan-s2v run``).

Owns argv and what a person reads when it is wrong. The flags are generated from the run spec
(:mod:`wan_s2v_runner.launcher.flags`); values are layered defaults < environment (MASTER_ADDR,
MASTER_PORT, WORLD_SIZE = nodes, RANK = node rank, WAN_REPO) < ``--config run.toml`` < flags.
``run`` validates a :class:`~wan_s2v_runner.shared.spec.RunSpec`, runs preflight and hands the spec
to the mode's runner; ``doctor`` builds a preflight report from the same (partial) values and
prints it. Bad input exits with code 2 and a one-line cause and fix before anything is spawned.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from wan_s2v_runner.launcher.flags import Command, add_spec_flags, base_values, flag_values
from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.config import format_validation_error, merge_values
from wan_s2v_runner.shared.disk import DiskError, is_disk_full, mount_point
from wan_s2v_runner.shared.spec import GroupSpec, RunSpec, flag_name


def spec_values(args: argparse.Namespace, defaults: Optional[dict] = None) -> dict[str, Any]:
    """Every layer merged: command defaults < environment < config file < flags."""
    return merge_values(defaults, base_values(args), flag_values(args))


def settle(model, values: dict[str, Any], recommend):
    """The spec of ``model`` (:class:`RunSpec` for a run, :class:`GroupSpec` for a batch's or a
    server's group) from the command's ``values``; under ``--mode auto``, the doctor's choice:
    ``recommend(spec, values)`` is asked once on the spec made without a mode, and the spec is made
    again with its layout (validated again: the layout changed), said on stderr. The one place
    ``--mode auto`` is resolved, for run, batch and serve (the plan's load waves and resident
    blocks are settled by the preflight's gate: ``GateReport.settled``)."""
    values = dict(values)
    auto = values.get("mode") == "auto"
    if auto:
        values.pop("mode")
    spec = model(**values)
    if auto:
        rec = recommend(spec, values)
        # the plan's CFG split and streaming, unless --[no-]cfg-parallel / --dit-offload was given
        spec = model(**{**values, **rec.updates(values)})
        print(f"--mode auto: {rec.flags(spec.cfg_parallel)} ({rec.text})", file=sys.stderr)
    return spec


def make_spec(args, defaults: Optional[dict] = None) -> RunSpec:
    def recommend(spec, values):
        from wan_s2v_runner.preflight import recommend_mode
        return recommend_mode(spec, dit_offload_given="dit_offload" in values)

    return settle(RunSpec, spec_values(args, defaults), recommend)


def make_group(values: dict[str, Any]) -> GroupSpec:
    """A rank group's spec from the command's values (``--mode auto``: the doctor's choice, at
    the jobs' default size)."""
    from wan_s2v_runner.launcher.job_book import group_values

    def recommend(group, given):  # at the jobs' default size: every value of the command, the mode aside
        from wan_s2v_runner.preflight import group_context, recommend_mode
        return recommend_mode(group_context(group, {k: v for k, v in values.items() if k != "mode"}))

    return settle(GroupSpec, group_values(values), recommend)


def _usage_error(e: Exception) -> int:
    text = format_validation_error(e) if isinstance(e, ValidationError) else f"error: {e}"
    print(text, file=sys.stderr)
    return exit_codes.USAGE


def cmd_run(args, defaults: Optional[dict] = None, extra_env=None) -> int:
    try:
        spec = make_spec(args, defaults)
    except (ValidationError, ValueError, OSError) as e:
        return _usage_error(e)
    return _check_and_launch(spec, args, extra_env)


def _check_and_launch(spec: RunSpec, args, extra_env=None) -> int:
    """Preflight, then the run. Where the machine's probe takes seconds (it measures GPUs, or imports
    a CUDA/ROCm torch: :func:`~wan_s2v_runner.preflight.probe.probes_quickly`), the run's agent is
    spawned first and imports torch and the engine meanwhile (:func:`launch.prepare`), and a
    refusal ends it before any rank; elsewhere the checks take a fraction of a second without
    torch, so they come first and a refused run starts no process at all."""
    from wan_s2v_runner.launcher import launch
    from wan_s2v_runner.launcher.console import Display
    from wan_s2v_runner.preflight.probe import probes_quickly

    prepared = launch.prepare(spec, extra_env) if not args.skip_preflight and not probes_quickly() else None
    settled = prepared.spec if prepared else spec  # what the ranks will read, with what the checks change
    plan_clip_s = None  # the plan's seconds a clip (job.time): the ETA until the first clip is done
    try:
        if args.skip_preflight:
            from wan_s2v_runner.preflight import groups_for
            print(f"WARNING: --skip-preflight: NOT checking {', '.join(g.value for g in groups_for(spec.mode))}; "
                  "a job known to fail may be spawned.", file=sys.stderr)
        else:
            from wan_s2v_runner import preflight
            report = preflight.gate_report(spec, json_mode=args.json)
            if report.refused:
                if prepared:
                    prepared.abandon()
                return exit_codes.PREFLIGHT
            settled = settled.model_copy(update=report.settled(spec))  # waves, resident blocks
            plan_clip_s = report.data_of("job.time").get("clip_s")
    except BaseException:
        if prepared:
            prepared.abandon()
        raise
    return launch.run(settled, observers=[Display.auto(json_mode=args.json, plan_clip_s=plan_clip_s)],
                      extra_env=extra_env, prepared=prepared)


def cmd_resume(args, extra_env=None) -> int:
    """Continue RUN_DIR's run from its last complete clip; layout flags may change, the inputs
    and frame settings may not (they decide the frames already written)."""
    from wan_s2v_runner.shared import job_source, resume

    run_dir = Path(args.run_dir).expanduser().absolute()
    try:
        original = json.loads((run_dir / "spec.json").read_text(encoding="utf-8"))
        source = job_source.source_of(original, run_dir)
    except (OSError, ValueError) as e:
        print(f"error: {run_dir} is not a wan-s2v run directory ({e}). Fix: pass a directory under runs/.",
              file=sys.stderr)
        return exit_codes.USAGE
    original.pop(job_source.SPEC_KEY, None)
    if source is not job_source.JobSource.RUN:  # a group's: a batch's or a server's
        print(f"error: {run_dir} is a rank group of several jobs (wan-s2v batch or serve), not one run. Fix: run "
              "the same `wan-s2v batch` command again (it resumes its interrupted job), or restart the server",
              file=sys.stderr)
        return exit_codes.USAGE
    given = flag_values(args)
    try:
        before = RunSpec(**original)
        spec = RunSpec(**{**original, **given, "resume_from": run_dir})
        fixed = [k for k in resume.FRAME_FIELDS if getattr(spec, k) != getattr(before, k)]
        if fixed:
            print(f"error: resume keeps the run's frame settings; {', '.join(flag_name(k) for k in fixed)} "
                  "cannot change. Fix: drop those flags (or start a new run).", file=sys.stderr)
            return exit_codes.USAGE
        progress = resume.read_progress(run_dir)
        resume.check(progress, spec)
    except (ValidationError, ValueError, OSError) as e:
        return _usage_error(e)
    print(f"resuming {run_dir} at clip {progress.next_clip + 1}/{progress.num_clips or '?'} "
          f"({progress.next_clip} done)", file=sys.stderr)
    return _check_and_launch(spec, args, extra_env)


def cmd_batch(args, extra_env=None) -> int:
    """Every job of the jobs file from one load (:mod:`wan_s2v_runner.launcher.batch`)."""
    from wan_s2v_runner.launcher.batch import run_batch

    try:
        base = spec_values(args)
        group = make_group(base)  # checked once, before any line (--mode auto: the doctor's choice)
    except (ValidationError, ValueError, OSError) as e:
        return _usage_error(e)
    jobs = Path(args.jobs).expanduser().absolute()
    output_dir = (args.output_dir or Path("outputs") / jobs.stem).expanduser().absolute()
    return run_batch(jobs, base, group, output_dir, json_mode=args.json, skip_preflight=args.skip_preflight,
                     extra_env=extra_env)


def cmd_serve(args, extra_env=None) -> int:
    """The resident rank group behind the HTTP API (:mod:`wan_s2v_runner.serve`); on a
    node other than 0: only its ranks, relaunched whenever node 0 relaunches the group."""
    from wan_s2v_runner.serve import start
    from wan_s2v_runner.serve.settings import ServerSettings, SettingsError

    try:
        settings = ServerSettings.from_args(args)
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    try:
        settings.server_dir.mkdir(parents=True, exist_ok=True)
        base = spec_values(args, start.group_defaults(settings.server_dir))
        group = make_group(base)
    except (ValidationError, ValueError, OSError) as e:
        return _usage_error(e)
    return start.serve(settings, group, base, extra_env)


def cmd_demo(args) -> int:
    from wan_s2v_runner.demo.assets import ensure_demo_assets
    from wan_s2v_runner.shared.cache_dirs import CacheKind, directory

    try:  # the caches' root: --cache-dir, TOML cache_dir, $WAN_S2V_CACHE_DIR, XDG's
        cache = directory(CacheKind.DEMO, spec_values(args).get("cache_dir"))
    except (ValidationError, ValueError, OSError) as e:
        return _usage_error(e)
    print(f"demo: tiny random-weight checkpoint + inputs in {cache} (built once, then reused)")
    assets = ensure_demo_assets(cache)
    defaults = dict(ckpt_dir=assets.ckpt_dir, image=assets.image, audio=assets.audio,
                    prompt="a person talking to the camera", device="cpu", nproc=2, mode="ulysses",
                    max_area=64 * 64, infer_frames=8, steps=2, seed=42, output=Path("outputs/demo.mp4"))
    if args.pose:  # the body follows the demo's skeleton video
        defaults.update(pose_video=assets.pose_video, output=Path("outputs/demo-pose.mp4"))
    return cmd_run(args, defaults)


def cmd_warm(args) -> int:
    """Become the node's warm agent (:mod:`wan_s2v_runner.rank.warm_agent`): this process, in the
    environment every node agent gets, until stopped."""
    from wan_s2v_runner.launcher.spawn import agent_env

    try:
        wan_repo = spec_values(args).get("wan_repo")
    except (ValidationError, ValueError, OSError) as e:
        return _usage_error(e)
    argv = [sys.executable, "-m", "wan_s2v_runner.rank.warm_agent",
            *(["--socket", str(Path(args.socket).expanduser().absolute())] if args.socket else []),
            *(["--wan-repo", str(wan_repo)] if wan_repo else []),
            *(["--idle-exit", str(args.idle_exit)] if args.idle_exit else [])]
    sys.stdout.flush()
    os.execve(sys.executable, argv, agent_env())
    return exit_codes.OK  # not reached


def recorded_machine(path: Path):
    """``doctor --machine``'s facts, or a ValueError naming the cause and the fix."""
    from wan_s2v_runner.preflight.facts import SCHEMA, MachineFacts
    try:
        facts = MachineFacts.load(path)
    except OSError as e:
        raise ValueError(f"--machine {path}: cannot read it ({e.strerror or e}). Fix: pass a facts JSON "
                         "(tests/data/machines/ has recorded ones)") from None
    except ValueError as e:
        raise ValueError(f"--machine {path}: not JSON ({e}). Fix: pass a facts JSON "
                         "(python -m wan_s2v_runner.preflight.probe writes one)") from None
    if not isinstance(facts.raw, dict) or facts.raw.get("schema") != SCHEMA:
        raise ValueError(f"--machine {path}: not a machine-facts document of schema {SCHEMA}. Fix: pass a facts "
                         "JSON (python -m wan_s2v_runner.preflight.probe writes one; tests/data/machines/ has "
                         "recorded ones)")
    return facts


def cmd_doctor(args) -> int:
    from wan_s2v_runner.preflight import doctor
    from wan_s2v_runner.preflight.render import render_doctor

    try:
        values = spec_values(args)
        facts = recorded_machine(args.machine) if args.machine else None
    except (ValueError, OSError) as e:
        return _usage_error(e)
    report = doctor(values, facts=facts, queue_depth=args.queue_depth)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        render_doctor(report)
    return report.exit_code


#: each command's help line, its description (empty: none) and its positional argument (add_argument's
#: keywords, the first its name)
SUBCOMMANDS: dict[Command, tuple[str, str, Optional[dict[str, Any]]]] = {
    Command.RUN: ("generate a talking video", "Generate a talking video.", None),
    Command.DEMO: ("CPU demo on a tiny random checkpoint (2 ranks)", "", None),
    Command.DOCTOR: ("check this machine (and a run's inputs) before running", "", None),
    Command.RESUME: ("continue a run from its last complete clip",
                     "Continue RUN_DIR's run from its last complete clip (layout flags may change: --mode, "
                     "--nproc, --cfg-parallel, ...).",
                     {"dest": "run_dir", "metavar": "RUN_DIR", "type": Path,
                      "help": "the run directory (runs/<time>-<mode>)"}),
    Command.BATCH: ("make every video of a jobs file from one load",
                    "Make every job of JOBS (JSON Lines or CSV: one job a line) with one rank group that loads "
                    "once. Flags give every job's defaults and the group's settings; a line sets its own inputs "
                    "and sampling fields.",
                    {"dest": "jobs", "metavar": "JOBS", "type": Path,
                     "help": "the jobs file (.jsonl, or .csv with a header row)"}),
    Command.SERVE: ("keep the model loaded and make videos for HTTP clients",
                    "Load once, then make the videos clients submit to POST /v1/videos (OpenAI-style routes; "
                    "see the README's serve section). Flags give the rank group's settings and every job's "
                    "defaults.", None),
    Command.SUBMIT: ("send a job to a server, follow it, download the mp4",
                     "Submit one video to a `wan-s2v serve` server (--url), follow its progress and download "
                     "the mp4 to --output (default ID.mp4). Flags not given take the server's defaults.", None),
    Command.WARM: ("keep a node agent warm: later runs here start theirs ~5 s sooner",
                   "Import torch and the engine once and keep them: every later run on this node (run, batch, "
                   "serve, demo) forks its node agent from this process instead of starting one that imports "
                   "them again. Runs find it by its socket ($WAN_S2V_WARM_AGENT; off: never). Stop it with "
                   "Ctrl-C or SIGTERM.", None),
    Command.JOBS: ("list, show or cancel a server's jobs", "List a `wan-s2v serve` server's jobs, show the ones "
                   "named, or cancel them with --cancel.",
                   {"dest": "ids", "metavar": "ID", "nargs": "*", "help": "job ids (default: every job)"}),
    Command.CACHE: ("list or clear the caches wan-s2v keeps (the DiT's page-cache files, the demo's, ...)",
                    "List every cache wan-s2v keeps (path, size, last use, what it is for) or clear some: `wan-s2v "
                    "cache clear dit` (a kind), `clear PATH|NAME|KEY` (one), `clear all` (docs/caches.md).",
                    {"dest": "words", "metavar": "list|clear", "nargs": "*",
                     "help": "list (the default), or clear and what: all, a kind (dit, demo, inductor, tests, "
                             "bench), a path, a DiT file's name or key"}),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wan-s2v", description="Run Wan2.2 S2V-14B on one or many GPUs (or CPU).")
    sub = p.add_subparsers(dest="command", required=True)
    for command, (help_, description, positional) in SUBCOMMANDS.items():
        s = sub.add_parser(command.value, help=help_, description=description or None)
        if positional:
            s.add_argument(positional["dest"], **{k: v for k, v in positional.items() if k != "dest"})
        add_spec_flags(s, command)
    return p


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {o for sp in subs.choices.values() for a in sp._actions for o in a.option_strings}


def main(argv: Optional[list[str]] = None) -> int:
    from wan_s2v_runner.launcher.upstream_flags import UpstreamFlagError, translate

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # upstream generate.py's spellings (docs/upstream-flags.md)
        argv = argv[:1] + translate(argv[1:], _option_strings(parser))
    except UpstreamFlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except OSError as e:  # a full disk where no run could say it (its run directory, a batch's list, ...)
        if not is_disk_full(e):
            raise
        said = e.strerror if isinstance(e, DiskError) and e.strerror else str(e)
        where = e.path if isinstance(e, DiskError) else e.filename
        fix = "" if "Fix:" in said else f". Fix: free space on {mount_point(where) if where else 'that disk'}"
        print(f"wan-s2v: FAILED ({exit_codes.NAMES[exit_codes.DISK_FULL]}, exit {exit_codes.DISK_FULL}): the disk is "
              f"full: {said}{fix}, then run the same command again", file=sys.stderr)
        return exit_codes.DISK_FULL


def _dispatch(args) -> int:
    command = Command(args.command)
    if command is Command.RUN:
        return cmd_run(args)
    if command is Command.DEMO:
        return cmd_demo(args)
    if command is Command.RESUME:
        return cmd_resume(args)
    if command is Command.BATCH:
        return cmd_batch(args)
    if command is Command.SERVE:
        return cmd_serve(args)
    if command is Command.WARM:
        return cmd_warm(args)
    if command is Command.CACHE:
        from wan_s2v_runner.cli.cache import cmd_cache
        return cmd_cache(args, spec_values)
    if command in (Command.SUBMIT, Command.JOBS):
        from wan_s2v_runner.serve import client
        return client.cmd_submit(args) if command is Command.SUBMIT else client.cmd_jobs(args)
    return cmd_doctor(args)


def entry() -> None:
    from wan_s2v_runner.shared.prompt_exit import exit_now

    exit_now(main())


if __name__ == "__main__":
    entry()
