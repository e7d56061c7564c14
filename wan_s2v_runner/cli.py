"""Command line: ``wan-s2v run|demo|doctor`` (``run_s2v_multi_gpu.py`` is ``wan-s2v run``).

Builds the :class:`~wan_s2v_runner.spec.RunSpec` from ``--config run.toml``, the cluster
environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE = nodes, RANK = node rank) and flags (flags
win), runs preflight, and hands the spec to the mode's runner. Bad input exits with code 2 and a
one-line cause and fix before anything is spawned.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from wan_s2v_runner import exit_codes
from wan_s2v_runner.spec import RunSpec, build_spec, load_toml, parse_size

#: flag dest -> spec field, for flags that map 1:1
SPEC_FLAGS = ("wan_repo", "ckpt_dir", "image", "audio", "prompt", "negative_prompt", "infer_frames",
              "num_clips", "steps", "shift", "guide_scale", "solver", "seed", "start_from_ref",
              "offload_model", "mode", "nproc", "nnodes", "node_rank", "master_addr", "master_port",
              "device", "attention", "threads", "pg_timeout_s", "watchdog_load_s", "watchdog_step_s",
              "output", "frames_out", "runs_root")


def add_spec_flags(p: argparse.ArgumentParser, for_doctor: bool = False) -> None:
    g = p.add_argument_group("inputs")
    g.add_argument("--config", type=Path, help="run.toml with spec fields (flags override it)")
    g.add_argument("--ckpt-dir", dest="ckpt_dir", type=Path, help="Wan2.2-S2V-14B checkpoint directory")
    g.add_argument("--wan-repo", dest="wan_repo", type=Path,
                   help="use this Wan2.2 checkout (repo root) instead of the installed wan package [$WAN_REPO]")
    g.add_argument("--image", type=Path, help="reference image")
    g.add_argument("--audio", type=Path, help="speech audio (wav, mp3, ...)")
    g.add_argument("--prompt", help="text prompt")
    g.add_argument("--negative-prompt", dest="negative_prompt", help="negative prompt (default: the engine's)")
    g = p.add_argument_group("sampling")
    g.add_argument("--size", help="target area as WIDTH*HEIGHT, e.g. 1024*704 (the image's aspect is kept)")
    g.add_argument("--max-area", dest="max_area", type=int, help="target area in pixels (instead of --size)")
    g.add_argument("--infer-frames", dest="infer_frames", type=int, help="frames per clip, multiple of 4 (default 80)")
    g.add_argument("--num-clips", dest="num_clips", type=int, help="clips to generate (default: enough for the audio)")
    g.add_argument("--steps", "--sample-steps", dest="steps", type=int, help="sampling steps (default 40)")
    g.add_argument("--shift", "--sample-shift", dest="shift", type=float, help="noise schedule shift (default 3)")
    g.add_argument("--guide-scale", "--sample-guide-scale", dest="guide_scale", type=float, help="CFG scale (default 4.5)")
    g.add_argument("--solver", choices=["unipc", "dpm++"], help="sampler (default unipc)")
    g.add_argument("--seed", type=int, help="seed; -1 = random, chosen once and recorded (default -1)")
    g.add_argument("--start-from-ref", dest="start_from_ref", action="store_true", default=None,
                   help="use the reference image as the first frame")
    g.add_argument("--offload-model", dest="offload_model", action=argparse.BooleanOptionalAction, default=None,
                   help="offload the DiT to CPU between uses (default: only with one GPU)")
    g = p.add_argument_group("parallel layout")
    g.add_argument("--mode", choices=["ulysses", "fsdp-fixed", "hybrid", "auto"],
                   help="parallel mode (default ulysses; auto = doctor's recommendation)")
    g.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, help="ranks on this node (default 1)")
    g.add_argument("--nnodes", type=int, help="number of nodes [$WORLD_SIZE]")
    g.add_argument("--node-rank", dest="node_rank", type=int, help="this node's rank [$RANK]")
    g.add_argument("--master-addr", dest="master_addr", help="rendezvous host [$MASTER_ADDR]")
    g.add_argument("--master-port", dest="master_port", type=int, help="rendezvous port [$MASTER_PORT]")
    g.add_argument("--device", choices=["cuda", "cpu"], help="cuda (nccl) or cpu (gloo); default cuda")
    g.add_argument("--attention", choices=["auto", "fa3", "fa2", "sdpa"], help="attention backend (default auto)")
    g.add_argument("--threads", type=int, help="torch threads per rank on CPU (default 1)")
    g = p.add_argument_group("supervision and output")
    g.add_argument("--pg-timeout", dest="pg_timeout_s", type=float, help="collective timeout, s (default 3600)")
    g.add_argument("--watchdog-load", dest="watchdog_load_s", type=float, help="hang limit while loading, s (0=off; default 1800)")
    g.add_argument("--watchdog-step", dest="watchdog_step_s", type=float, help="hang limit per step/encode/decode/save, s (0=off; default 600)")
    g.add_argument("--output", "--save-file", dest="output", type=Path, help="output .mp4 (default outputs/s2v.mp4)")
    g.add_argument("--frames-out", dest="frames_out", type=Path, help="also save the raw frames tensor (.pt)")
    g.add_argument("--runs-root", dest="runs_root", type=Path, help="where run directories go (default runs/)")
    g.add_argument("--json", action="store_true", help="print the result as JSON (machines)")
    if not for_doctor:
        g.add_argument("--skip-preflight", action="store_true", help="spawn without preflight checks (not recommended)")


def env_defaults(env=os.environ) -> dict[str, Any]:
    """Values a cluster launcher may have set (PyTorchJob-style: WORLD_SIZE = nodes, RANK = node)."""
    out: dict[str, Any] = {}
    if env.get("MASTER_ADDR"):
        out["master_addr"] = env["MASTER_ADDR"]
    for key, field in (("MASTER_PORT", "master_port"), ("WORLD_SIZE", "nnodes"), ("RANK", "node_rank")):
        if env.get(key, "").strip().isdigit():
            out[field] = int(env[key])
    return out


def spec_values(args: argparse.Namespace) -> tuple[dict, dict]:
    """(file+env values, flag values) for build_spec."""
    base = env_defaults()
    if getattr(args, "config", None):
        base.update(load_toml(args.config))
    cli = {k: getattr(args, k, None) for k in SPEC_FLAGS}
    if args.size:
        cli["max_area"] = parse_size(args.size)
    elif args.max_area:
        cli["max_area"] = args.max_area
    if "size" in base:
        base["max_area"] = parse_size(str(base.pop("size")))
    return base, cli


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "spec"
        flag = "--" + loc.replace("_", "-") if loc != "spec" else ""
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            lines.append(f"error: {flag} is required. Fix: pass {flag} (or set {loc} in --config).")
        else:
            lines.append(f"error: {flag or 'spec'}: {msg}. Fix: correct {flag or 'the flags'}.")
    return "\n".join(lines)


def make_spec(args, defaults: Optional[dict] = None) -> RunSpec:
    base, cli = spec_values(args)
    merged = dict(defaults or {})
    merged.update(base)
    mode_auto = (cli.get("mode") or merged.get("mode")) == "auto"
    if mode_auto:
        cli["mode"] = None
        merged.pop("mode", None)
    spec = build_spec(merged, cli)
    if mode_auto:
        from wan_s2v_runner.preflight import recommend_mode
        rec = recommend_mode(spec)
        spec = spec.model_copy(update={"mode": rec.mode})
        print(f"--mode auto: {rec.mode.value} ({rec.reason})", file=sys.stderr)
    return spec


def cmd_run(args, defaults: Optional[dict] = None, extra_env=None) -> int:
    import runners
    from wan_s2v_runner.console import Display

    try:
        spec = make_spec(args, defaults)
    except ValidationError as e:
        print(format_validation_error(e), file=sys.stderr)
        return exit_codes.USAGE
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    runner = runners.get(spec.mode)
    if args.skip_preflight:
        print(f"WARNING: --skip-preflight: NOT checking {', '.join(runner.checks)}; "
              "a job known to fail may be spawned.", file=sys.stderr)
    else:
        from wan_s2v_runner import preflight
        refused = preflight.gate(spec, runner, json_mode=args.json)
        if refused is not None:
            return refused
    return runner.launch(spec, display=Display.auto(json_mode=args.json), extra_env=extra_env)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wan-s2v"


def cmd_demo(args) -> int:
    from wan_s2v_runner.tiny_checkpoint import ensure_demo_assets

    cache = args.cache_dir or default_cache_dir()
    print(f"demo: tiny random-weight checkpoint + inputs in {cache / 'demo'} (built once, then reused)")
    assets = ensure_demo_assets(cache / "demo")
    defaults = dict(ckpt_dir=assets.ckpt_dir, image=assets.image, audio=assets.audio,
                    prompt="a person talking to the camera", device="cpu", nproc=2, mode="ulysses",
                    max_area=64 * 64, infer_frames=8, steps=2, seed=42, output=Path("outputs/demo.mp4"))
    return cmd_run(args, defaults)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wan-s2v", description="Run Wan2.2 S2V-14B on one or many GPUs (or CPU).")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="generate a talking video", description="Generate a talking video.")
    add_spec_flags(r)
    d = sub.add_parser("demo", help="CPU demo on a tiny random checkpoint (2 ranks)")
    add_spec_flags(d)
    d.add_argument("--cache-dir", type=Path, help="where the tiny checkpoint is cached (default ~/.cache/wan-s2v)")
    doc = sub.add_parser("doctor", help="check this machine (and a run's inputs) before running")
    add_spec_flags(doc, for_doctor=True)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return cmd_run(args, dict(output=Path("outputs/s2v.mp4")))
    if args.command == "demo":
        return cmd_demo(args)
    from wan_s2v_runner.preflight import cmd_doctor
    return cmd_doctor(args)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
