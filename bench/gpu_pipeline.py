"""The whole pipeline at real size on a GPU, and the memory plan against it (issue #29, parts 2-3).

1. Writes (once) a random checkpoint at the real Wan2.2-S2V-14B sizes and layout
   (:mod:`wan_s2v_runner.demo.real_checkpoint`, ~46 GB, tensors made on the GPU), a 1024x704
   reference image and 5 s of synthetic speech: a 5-second video, two 80-frame clips (the second
   one has the motion tokens and the motion re-encode the first lacks; ``--num-clips 1`` for one).
2. Asks ``wan-s2v doctor --json`` for the memory plan of the layout (per-GPU peak by phase,
   host per rank) -- before anything runs, as a user would.
3. Runs ``wan-s2v run --device cuda`` (``--nproc 1`` by default) at 1024x704, two steps per clip,
   and reads its ``run.json``: seconds per stage, what loading read (bytes per component, the
   strategy), the peaks per stage (host RSS, ``torch.cuda.max_memory_allocated``: ``stage_peak_mb``)
   and the whole-run GPU peak (allocated / reserved) of every rank.
4. Prints the stage table and measured vs predicted memory -- each GPU phase of the plan (encode,
   denoise, decode) against the peak of its stages, the whole-run GPU and host peaks -- flagging
   where the plan is off by more than 10% (``docs/memory-plan.md`` is what to fix then).

    python bench/gpu_pipeline.py --ckpt /scratch/s2v-random          # builds it the first time
    python bench/gpu_pipeline.py --ckpt DIR --nproc 1 --mode ulysses --steps 2 --json out.json
    python bench/gpu_pipeline.py --device cpu --small --ckpt /tmp/s2v-small --size 256*256  # smoke test

``--small`` writes the checkpoint at ``real_checkpoint.SMALL`` sizes (a CPU check of this script). A run that fails
(for example ``save`` without imageio-ffmpeg) still has
its stages and memory read from ``run.json``; its exit code is shown.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MiB, GiB = 2**20, 2**30


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "wan_s2v_runner", *args]


def predicted(doctor: dict, mode: str) -> dict:
    """The doctor's plan for ``mode``: GPU phases and peak, host per rank (bytes)."""
    m = doctor["memory_plan"]["modes"][mode]
    return {"gpu_phases": m.get("gpu_phases") or {}, "gpu_peak": m.get("gpu_peak"),
            "host_peak": m.get("host_peak"), "host_others": m.get("host_others")}


#: the memory plan's GPU phases and the stages each covers (docs/memory-plan.md)
PHASES = {"encode": ("audio_encode", "ref_encode", "text_encode"), "denoise": ("denoise",),
          "decode": ("decode", "motion_encode")}


def measured(run_json: dict) -> dict:
    """Rank 0's stages, load and peaks per stage, and every rank's whole-run peaks, from run.json."""
    ranks = run_json.get("ranks") or {}
    r0 = ranks.get("0") or {}
    return {"stage_seconds": run_json.get("stage_seconds") or {}, "load": r0.get("load"),
            "clips": (r0.get("progress") or {}).get("clips"),
            "stage_peak_mb": r0.get("stage_peak_mb") or {},
            "wall_s": run_json.get("wall_s"), "exit": run_json.get("exit", {}),
            "gpu_peak_mb": {r: v.get("gpu_peak_allocated_mb") for r, v in ranks.items()},
            "gpu_reserved_mb": {r: v.get("gpu_peak_reserved_mb") for r, v in ranks.items()},
            "host_peak_mb": {r: v.get("host_peak_rss_mb") for r, v in ranks.items()}}


def _phase_peak(stage_peaks: dict, stages, key: str):
    got = [stage_peaks[s][key] for s in stages if key in stage_peaks.get(s, {})]
    return max(got) if got else None


def _row(what: str, p_bytes, m_mb):
    p_gib = p_bytes / GiB if p_bytes else None
    m_gib = m_mb * MiB / GiB if m_mb is not None else None
    if p_gib and m_gib:
        off = p_gib / m_gib - 1
        verdict = f"{off * 100:+.0f}%" + (" -> fix the plan (> 10%)" if abs(off) > 0.10 else " (within 10%)")
    else:
        verdict = "not measured"
    return (what, p_gib, m_gib, verdict)


def compare(pred: dict, meas: dict) -> list[tuple[str, float | None, float | None, str]]:
    """(what, predicted GiB, measured GiB, verdict) rows: each GPU phase of rank 0 (the plan's
    phase, without its 1 GiB CUDA runtime, against the allocator's peak in that phase's stages),
    the whole-run GPU peak of the busiest rank (the plan's peak includes the runtime; the
    allocator's does not: reserved is shown beside it), and rank 0's host peak."""
    peaks = meas["stage_peak_mb"]
    rows = [_row(f"GPU {phase} (stages {', '.join(stages)}), allocated", pred["gpu_phases"].get(phase),
                 _phase_peak(peaks, stages, "gpu_peak_allocated_mb")) for phase, stages in PHASES.items()]
    gpu = max((v for v in meas["gpu_peak_mb"].values() if v is not None), default=None)
    reserved = max((v for v in meas["gpu_reserved_mb"].values() if v is not None), default=None)
    rows.append(_row("GPU peak per rank, allocated (plan: + runtime)", pred["gpu_peak"], gpu))
    rows.append(_row("GPU peak per rank, reserved (plan: + runtime)", pred["gpu_peak"], reserved))
    rows.append(_row("host peak, rank 0", pred["host_peak"], meas["host_peak_mb"].get("0")))
    return rows


def render(out: dict) -> str:
    meas, pred = out["measured"], out["predicted"]
    lines = [f"pipeline: {out['args']}", f"exit: {meas['exit'].get('code')} {meas['exit'].get('status')} "
             f"{meas['exit'].get('reason') or ''}".rstrip(), "",
             "| stage (rank 0) | seconds | peak host RSS MiB | peak GPU allocated MiB |", "|---|---|---|---|"]
    peaks = meas.get("stage_peak_mb") or {}
    lines += [f"| {k} | {v} | {peaks.get(k, {}).get('host_peak_rss_mb', '-')} | "
              f"{peaks.get(k, {}).get('gpu_peak_allocated_mb', '-')} |" for k, v in meas["stage_seconds"].items()]
    lines.append(f"| wall (run.json) | {meas['wall_s']} | | |")
    lines.append(f"| from the command to the first denoising step | {meas.get('to_step_s')} | | |")
    load = meas.get("load") or {}
    if load:
        lines += ["", f"loading: strategy {load.get('strategy')}; read "
                      + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in (load.get('bytes_read') or {}).items()),
                  f"the DiT read while encoding: {load.get('dit_overlap')}"]
    lines += [
        "",
        "predicted GPU phases (GiB): " + ", ".join(f"{k} {v / GiB:.1f}" for k, v in pred["gpu_phases"].items()),
        "",
        "| memory | predicted GiB | measured GiB | plan vs measured |",
        "|---|---|---|---|",
    ]
    fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
    lines += [f"| {w} | {fmt(p)} | {fmt(m)} | {v} |" for w, p, m, v in out["comparison"]]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, required=True, help="the random checkpoint (written if absent)")
    ap.add_argument("--small", action="store_true", help="write it at the small test sizes (CPU smoke test)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--mode", default="ulysses", choices=["ulysses", "fsdp-fixed", "hybrid"])
    ap.add_argument("--size", default="1024*704")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0, help="speech length (5 s: two 80-frame clips)")
    ap.add_argument("--num-clips", type=int, help="at most this many clips (default: as the speech needs)")
    ap.add_argument("--out", type=Path, default=Path("gpu-pipeline"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-preflight", action="store_true",
                    help="pass --skip-preflight to `run` (not to doctor): a machine without imageio-ffmpeg then "
                         "runs every stage and stops in save")
    ap.add_argument("--overlap-probe", action="store_true",
                    help="read the DiT while the encoders run on a GPU too (bench/overlap_probe: the CPU's rule)")
    ap.add_argument("run_args", nargs="*", help="more flags for `wan-s2v doctor` and `run` (after --)")
    a = ap.parse_args(argv)

    from wan_s2v_runner.demo.real_checkpoint import REAL, SMALL, build_real_checkpoint
    from wan_s2v_runner.demo.synthetic_inputs import make_reference_image, make_speech_audio
    from wan_s2v_runner.demo.tiny_checkpoint import dir_bytes
    from wan_s2v_runner.shared.spec import size_pair

    a.out.mkdir(parents=True, exist_ok=True)
    out: dict = {"args": " ".join(sys.argv[1:] if argv is None else argv)}
    if not (a.ckpt / "config.json").is_file():
        t0 = time.perf_counter()
        build_real_checkpoint(a.ckpt, device=a.device, sizes=SMALL if a.small else REAL)
        out["checkpoint_build_s"] = round(time.perf_counter() - t0, 1)
    out["checkpoint_gb"] = round(dir_bytes(a.ckpt) / 1e9, 2)
    w, h = size_pair(a.size)
    image = make_reference_image(a.out / "ref.png", width=w, height=h)
    audio = make_speech_audio(a.out / "speech.wav", seconds=a.seconds)
    common = ["--device", a.device, "--nproc", str(a.nproc), "--mode", a.mode, "--ckpt-dir", str(a.ckpt),
              "--image", str(image), "--audio", str(audio), "--size", a.size,
              *(["--num-clips", str(a.num_clips)] if a.num_clips else []), *a.run_args]
    env = None
    if a.overlap_probe:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "bench" / "overlap_probe"), str(ROOT), os.environ.get("PYTHONPATH")]))}
    doc = subprocess.run(cli("doctor", *common, "--json"), capture_output=True, text=True, env=env)
    if not doc.stdout.strip():
        raise SystemExit(f"wan-s2v doctor said nothing (exit {doc.returncode}): {doc.stderr[-2000:]}")
    out["predicted"] = predicted(json.loads(doc.stdout), a.mode)
    runs = a.out / "runs"
    t0, started = time.perf_counter(), time.time()
    run = subprocess.run(cli("run", *common, "--prompt", "a person talking to the camera", "--steps", str(a.steps),
                             "--output", str(a.out / "out.mp4"), "--runs-root", str(runs),
                             "--frames-out", str(a.out / "frames.pt"),
                             *(["--skip-preflight"] if a.skip_preflight else [])),
                         capture_output=True, text=True, env=env)
    out["run_wall_s"] = round(time.perf_counter() - t0, 1)
    out["run_exit"] = run.returncode
    (a.out / "run.log").write_text(run.stdout + "\n" + run.stderr)  # the run's own lines, kept for a failure
    if run.returncode:
        print(f"wan-s2v run: exit {run.returncode}; its last lines:", run.stderr[-3000:], sep="\n")
    newest = max(runs.glob("*/run.json"), key=lambda p: p.stat().st_mtime, default=None)
    if newest is None:
        print(run.stdout[-4000:], run.stderr[-4000:], sep="\n")
        raise SystemExit(f"no run.json under {runs} (exit {run.returncode})")
    out["run_json"] = str(newest)
    out["measured"] = measured(json.loads(newest.read_text()))
    from bench_startup import first_event_t

    step = first_event_t(newest.parent, "stage", "denoise")
    out["measured"]["to_step_s"] = round(step - started, 1) if step else None
    out["comparison"] = compare(out["predicted"], out["measured"])
    print(render(out))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
