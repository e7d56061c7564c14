"""Benchmark for our generation loop (issues #8 and #13): every layout side by side with one
rank, on a compute-bound preset, in one invocation.

The tiny demo checkpoint does almost no arithmetic, so splitting its DiT only measures gloo
latency (docs/bench.md, first section). This bench builds (once, cached under ``--cache``) a
random checkpoint with the tiny-checkpoint builder but a bigger DiT (preset ``compute``: dim
1536, 12 heads, 10 layers -- the builder's maximum depth; VAE width 4), a 256x256 reference
image and 1 s of synthetic speech, then runs, one after another, ``python -m wan_s2v_runner run
... --json`` for each layout:

    1               --nproc 1
    ulysses         --nproc 2 --mode ulysses
    ulysses+cfg     --nproc 2 --mode ulysses --cfg-parallel
    fsdp-fixed      --nproc 2 --mode fsdp-fixed
    fsdp-fixed+cfg  --nproc 2 --mode fsdp-fixed --cfg-parallel
    hybrid          --nproc 2 --mode hybrid
    hybrid+cfg      --nproc 2 --mode hybrid --cfg-parallel
    ulysses/vae0, ulysses+cfg/vae0, ...   the same with --no-vae-parallel (rank 0 runs the VAE)
    1/pin, ulysses+cfg/pin, ...           the same with --pin-cpus (each rank bound to its own CPU)

(the 2-rank layouts split the VAE over both ranks unless named ``/vae0``), all with ``--device
cpu --threads 1 --size 256*256 --infer-frames 8 --num-clips C --steps N --seed 42``, and prints
one table: rank 0's ``denoise`` seconds and its ratio to 1 rank; the input-encoding + VAE work
stages (audio_encode, ref_encode, text_encode, decode, motion_encode) summed over ranks and their
ratio to 1 rank; the VAE stages (ref_encode, decode, motion_encode) of the slowest rank and their
ratio to 1 rank; peak host RSS of rank 0 and the max of the other ranks; the run's wall time and
its ratio; the CPU seconds the launcher and torchrun's agent used (run.json ``launcher.cpu_s``:
on 2 cores with 2 ranks they are taken from a rank; torchrun's include its start); and whether
the frames (``--frames-out``) equal the 1-rank run's. ``--num-clips 2`` (default 1) includes a motion re-encode.
Each row's
ratios are to the latest 1-rank row before it: ``--layouts 1,ulysses+cfg --repeat 3`` runs three
side-by-side pairs and ends with each layout's median ratio (this machine's speed drifts 10-25%
between runs, so one pair is not a measurement).

    .venv/bin/python bench/bench_loop.py                         # everything, compute preset
    .venv/bin/python bench/bench_loop.py --preset tiny --layouts 1,ulysses --steps 1  # smoke test
    .venv/bin/python bench/bench_loop.py --markdown              # table for docs/bench.md
    .venv/bin/python bench/bench_loop.py --markdown --num-clips 2 --steps 2 --layouts 1,ulysses+cfg --repeat 3

Each rank runs with one torch thread, so a 2-rank layout wants 2 idle cores: the footer records
the 1-minute load average before and after (anything else running skews the ratios).

A failed run prints the tail of its output and the bench goes on with the next layout.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: checkpoint presets: keyword arguments of tiny_checkpoint.build_tiny_checkpoint (the builder
#: allows 1..10 DiT layers: the audio injector matches blocks by substring) + input image size
PRESETS: dict[str, dict[str, Any]] = {
    # a DiT (~410M parameters) that costs ~13 s per step (CFG: two passes) on one CPU thread at
    # 256x256, so gloo latency is noise and 4 steps outweigh the VAE; VAE width 4 (demo: 8) halves
    # the VAE's share (its 73-frame motion encodes at 256x256 cost tens of seconds at width 8)
    "compute": {"ckpt": {"seed": 0, "dit_dim": 1536, "dit_heads": 12, "dit_layers": 10, "vae_dim": 4},
                "image": [256, 256], "size": "256*256"},
    # the demo's dimensions: a smoke test of the bench itself (seconds per run)
    "tiny": {"ckpt": {"seed": 0}, "image": [64, 64], "size": "64*64"},
}
AUDIO_SECONDS = 1.0
SAMPLE_RATE = 16000
CACHE_FORMAT = 1  # bump to invalidate cached presets

#: layout name -> (nproc, mode, cfg_parallel, vae_parallel, pin_cpus)
LAYOUTS: dict[str, tuple[int, str, bool, bool, bool]] = {
    "1": (1, "ulysses", False, False, False),
    "ulysses": (2, "ulysses", False, True, False),
    "ulysses+cfg": (2, "ulysses", True, True, False),
    "fsdp-fixed": (2, "fsdp-fixed", False, True, False),
    "fsdp-fixed+cfg": (2, "fsdp-fixed", True, True, False),
    "hybrid": (2, "hybrid", False, True, False),
    "hybrid+cfg": (2, "hybrid", True, True, False),
}
_BASE = list(LAYOUTS.items())
LAYOUTS.update({f"{name}/vae0": (n, mode, cfg, False, False) for name, (n, mode, cfg, _, _) in _BASE if n > 1})
LAYOUTS.update({f"{name}/pin": (n, mode, cfg, vae, True) for name, (n, mode, cfg, vae, _) in _BASE})
DEFAULT_LAYOUTS = [n for n in LAYOUTS if "/" not in n]
#: the stages that do input-encoding / VAE work (not the receive_* waits of the other ranks)
WORK_STAGES = ("audio_encode", "ref_encode", "text_encode", "decode", "motion_encode")
VAE_STAGES = ("ref_encode", "decode", "motion_encode")


# --------------------------------------------------------------------------- assets
def checkout_env(extra: Optional[dict] = None) -> dict[str, str]:
    """This process's environment (with ``extra``) and this checkout first on PYTHONPATH: what a
    spawned ``python -m wan_s2v_runner`` needs to run this checkout's code."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@contextmanager
def served(flags: list[str], server_dir: Path, log_path: Path, cwd: Path, extra_env: Optional[dict] = None,
           start_s: float = 600.0) -> Iterator[tuple[subprocess.Popen, str]]:
    """``wan-s2v serve FLAGS --server-dir SERVER_DIR`` on a free loopback port for the with-block:
    (its process, its URL) once it listens (the bench exits, naming its log, when it does not
    within ``start_s``); stopped after with SIGTERM, as a service manager stops it (SIGKILL 120 s later)."""
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "serve", *flags, "--server-dir",
                             str(server_dir), "--port", "0"], cwd=cwd, env=checkout_env(extra_env),
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + start_s
        while not (server_dir / "server.json").is_file():
            if proc.poll() is not None or time.time() > deadline:
                sys.exit(f"the server did not start (see {log_path})")
            time.sleep(0.2)
        yield proc, json.loads((server_dir / "server.json").read_text())["url"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def ensure_assets(cache: Path, preset: str, overrides: Optional[dict] = None) -> tuple[Path, Path, Path]:
    """(ckpt_dir, image, audio) of ``preset`` (with builder ``overrides``) under ``cache``, built
    once. A marker with the parameters is written last; a missing or different marker rebuilds."""
    from wan_s2v_runner.demo.assets import dir_lock
    from wan_s2v_runner.demo.tiny_checkpoint import TINY_FORMAT_VERSION, build_tiny_checkpoint, checkpoint_is_complete
    from wan_s2v_runner.shared.atomic import atomic_write, write_text
    p = PRESETS[preset]
    if overrides:
        p = {**p, "ckpt": {**p["ckpt"], **overrides}}
        preset = preset + "-" + "-".join(f"{k.replace('_', '')}{v}" for k, v in sorted(overrides.items()))
    want = {"cache_format": CACHE_FORMAT, "tiny_format": TINY_FORMAT_VERSION, "preset": p,
            "audio_seconds": AUDIO_SECONDS, "sample_rate": SAMPLE_RATE}
    d = cache.expanduser().absolute() / preset
    ckpt, image, audio = d / "ckpt", d / "reference.png", d / "speech.wav"
    marker = d / ".bench_assets_ok"

    def valid() -> bool:
        try:
            return (json.loads(marker.read_text()) == want and checkpoint_is_complete(ckpt)
                    and image.is_file() and audio.is_file())
        except (OSError, ValueError):
            return False

    if valid():
        return ckpt, image, audio
    d.mkdir(parents=True, exist_ok=True)
    with dir_lock(d / ".lock"):
        if not valid():
            from wan_s2v_runner.demo.synthetic_inputs import make_reference_image, make_speech_audio
            marker.unlink(missing_ok=True)
            t0 = time.perf_counter()
            print(f"building the {preset!r} preset in {d} ({p['ckpt']}) ...", file=sys.stderr, flush=True)
            build_tiny_checkpoint(ckpt, **p["ckpt"])
            w, h = p["image"]
            seed = p["ckpt"].get("seed", 0)
            atomic_write(image, lambda q: make_reference_image(q, width=w, height=h, seed=seed))
            atomic_write(audio, lambda q: make_speech_audio(q, seconds=AUDIO_SECONDS,
                                                            sample_rate=SAMPLE_RATE, seed=seed))
            write_text(marker, json.dumps(want, sort_keys=True))
            print(f"built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return ckpt, image, audio


# --------------------------------------------------------------------------- one run
def run_argv(a, name: str, ckpt: Path, image: Path, audio: Path, work: Path, tag: str) -> list[str]:
    nproc, mode, cfg, vae, pin = LAYOUTS[name]
    argv = [sys.executable, "-m", "wan_s2v_runner", "run",
            "--ckpt-dir", str(ckpt), "--image", str(image), "--audio", str(audio),
            "--prompt", "a person talking",
            "--device", "cpu", "--threads", str(a.threads),
            "--size", a.size, "--infer-frames", str(a.infer_frames), "--num-clips", str(a.num_clips),
            "--steps", str(a.steps), "--seed", str(a.seed),
            "--nproc", str(nproc), "--mode", mode,
            "--output", str(work / f"{tag}.mp4"), "--frames-out", str(work / f"{tag}.pt"),
            "--runs-root", str(work / "runs" / tag), "--json"]
    if cfg:
        argv.append("--cfg-parallel")
    if nproc > 1:
        argv.append("--vae-parallel" if vae else "--no-vae-parallel")
    if pin:
        argv.append("--pin-cpus")
    if a.skip_preflight:
        argv.append("--skip-preflight")
    return argv


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _manifest(stdout: str, runs_root: Path) -> Optional[dict]:
    """The run manifest: the JSON ``--json`` printed on stdout, else the run's run.json."""
    start = stdout.find("{")
    if start >= 0:
        try:
            return json.loads(stdout[start:])
        except ValueError:
            pass
    found = sorted(runs_root.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    if found:
        try:
            return json.loads(found[-1].read_text())
        except (OSError, ValueError):
            return None
    return None


def one(a, name: str, assets, work: Path, repeat: int = 0) -> dict:
    tag = name.replace("+", "-").replace("/", "-") + (f"-{repeat + 1}" if repeat else "")
    argv = run_argv(a, name, *assets, work, tag)
    print(f"== {name}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    env = checkout_env()
    out_path, err_path = work / f"{tag}.stdout.txt", work / f"{tag}.stderr.txt"
    t0 = time.perf_counter()
    with open(out_path, "w") as fo, open(err_path, "w") as fe:
        proc = subprocess.Popen(argv, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL,
                                stdout=fo, stderr=fe)
        try:
            rc: Optional[int] = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM: the launcher stops every rank of the run and writes run.json; then kill
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = None
            fe.write(f"\n(bench: stopped after --timeout {a.timeout:g} s)\n")
        except BaseException:  # Ctrl-C: the launcher got it too (same process group); wait for it
            try:
                proc.wait(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
            raise
    elapsed = time.perf_counter() - t0
    out = out_path.read_text(errors="replace")
    err = err_path.read_text(errors="replace")
    nproc = LAYOUTS[name][0]
    row: dict[str, Any] = {"layout": name, "ranks": nproc, "ok": False, "rc": rc,
                           "elapsed_s": round(elapsed, 2), "frames": work / f"{tag}.pt"}
    m = _manifest(out, work / "runs" / tag)
    if rc != 0 or m is None or (m.get("exit") or {}).get("code") != 0:
        ex = (m or {}).get("exit") or {}
        reason = ex.get("reason")
        # stdout is the manifest's JSON when there is one: show the run's own log (stderr) and
        # the failing rank's traceback instead
        lines = [f"!! {name} failed (rc {rc}){': ' + reason if reason else ''}"]
        if ex.get("hint"):
            lines.append(f"!! hint: {ex['hint']}")
        lines.append(f"!! last lines of its output ({work / (tag + '.stderr.txt')}):")
        lines.append(_tail(err if m is not None else err + out, 25))
        tb_last = _tail(str(ex.get("traceback") or ""), 1)
        if tb_last and tb_last not in err:  # the run's log usually shows it already
            lines += ["!! traceback (tail):", _tail(str(ex["traceback"]), 12)]
        lines.append("!! continuing with the next layout")
        print("\n".join(lines), file=sys.stderr, flush=True)
        row["error"] = reason or f"rc {rc}"
        return row
    ranks = m["ranks"]
    r0 = ranks.get("0") or ranks[min(ranks, key=int)]
    others = [r for k, r in ranks.items() if r is not r0]
    row.update(
        ok=True,
        run_dir=m.get("run_dir"),
        wall_s=m["wall_s"],
        denoise_s=r0["stage_seconds"].get("denoise", 0.0),
        load_s=r0["stage_seconds"].get("load", 0.0),
        work_s=round(sum(r["stage_seconds"].get(s, 0.0) for r in ranks.values() for s in WORK_STAGES), 3),
        work_by_stage={s: round(sum(r["stage_seconds"].get(s, 0.0) for r in ranks.values()), 3)
                       for s in WORK_STAGES},
        vae_max_s=round(max(sum(r["stage_seconds"].get(s, 0.0) for s in VAE_STAGES) for r in ranks.values()), 3),
        rss0_mb=r0["host_peak_rss_mb"],
        rss_others_mb=max((r["host_peak_rss_mb"] or 0.0) for r in others) if others else None,
        stage_seconds={k: r["stage_seconds"] for k, r in ranks.items()},
        torch=(m.get("versions") or {}).get("torch"),
        supervision_cpu_s=_supervision_cpu(m),
    )
    print(f"   {name}: wall {row['wall_s']:.1f} s, denoise {row['denoise_s']:.1f} s, "
          f"enc+VAE {row['work_s']:.1f} s, VAE max rank {row['vae_max_s']:.1f} s", file=sys.stderr, flush=True)
    return row


def _supervision_cpu(m: dict) -> dict:
    """CPU seconds the launcher and torchrun's agent used (run.json ``launcher.cpu_s``; torchrun's
    include its own start, mostly importing torch, before any rank runs)."""
    return dict((m.get("launcher") or {}).get("cpu_s") or {})


def _cpu_cell(cpu: dict) -> str:
    return " / ".join(_f(cpu.get(k), ".2f") for k in ("launcher", "torchrun")) if cpu else "-"


def compare_frames(ref: Path, other: Path) -> str:
    import torch
    try:
        x = torch.load(ref, map_location="cpu")
        y = torch.load(other, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a report cell, not a crash
        return f"unreadable ({type(e).__name__})"
    if x.shape != y.shape:
        return f"shape {tuple(y.shape)} != {tuple(x.shape)}"
    if torch.equal(x, y):
        return "exact"
    return f"max |diff| {float((x.double() - y.double()).abs().max()):.3g}"


# --------------------------------------------------------------------------- table
COLUMNS = ["layout", "ranks", "denoise s", "denoise x", "enc+VAE s (sum ranks)", "enc+VAE x",
           "VAE s (max rank)", "VAE x", "RSS r0 MB", "RSS others max MB", "wall s", "wall x",
           "launcher / torchrun CPU s", "frames vs 1 rank"]
#: the ratios the repeat summary reports (row key, column name)
RATIOS = (("denoise_s", "denoise x"), ("vae_max_s", "VAE x"), ("wall_s", "wall x"))


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def reference_rows(rows: list[dict]) -> list[Optional[dict]]:
    """For each row, the 1-rank row its ratios are taken against: the latest successful one
    before it (so ``--repeat`` gives side-by-side pairs on a machine whose speed drifts), or the
    first one when none came before."""
    first = next((r for r in rows if r["layout"] == "1" and r["ok"]), None)
    refs, last = [], None
    for r in rows:
        if r["layout"] == "1" and r["ok"]:
            last = r
        refs.append(last or first)
    return refs


def ratio(row: dict, ref: Optional[dict], key: str) -> Optional[float]:
    return row[key] / ref[key] if row.get("ok") and ref and ref[key] else None


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r, ref in zip(rows, reference_rows(rows)):
        if not r["ok"]:
            out.append([r["layout"], str(r["ranks"]), "FAILED"] + [""] * (len(COLUMNS) - 4)
                       + [str(r.get("error", ""))[:100]])
            continue
        out.append([r["layout"], str(r["ranks"]), _f(r["denoise_s"], ".2f"), _f(ratio(r, ref, "denoise_s"), ".2f"),
                    _f(r["work_s"], ".2f"), _f(ratio(r, ref, "work_s"), ".2f"),
                    _f(r["vae_max_s"], ".2f"), _f(ratio(r, ref, "vae_max_s"), ".2f"), _f(r["rss0_mb"], ".0f"),
                    _f(r["rss_others_mb"], ".0f"), _f(r["wall_s"], ".2f"), _f(ratio(r, ref, "wall_s"), ".2f"),
                    _cpu_cell(r.get("supervision_cpu_s") or {}), r.get("frames_check", "-")])
    return out


def summary(rows: list[dict]) -> list[tuple[str, int, dict[str, tuple[float, float, float]]]]:
    """Per layout other than 1 rank, over its successful rows: (layout, n, {ratio column:
    (median, min, max)}) of each row's ratio to its own 1-rank row (:func:`reference_rows`)."""
    import statistics
    by_layout: dict[str, list[tuple[dict, dict]]] = {}
    for r, ref in zip(rows, reference_rows(rows)):
        if r["ok"] and r["layout"] != "1" and ref is not None:
            by_layout.setdefault(r["layout"], []).append((r, ref))
    out = []
    for name, pairs in by_layout.items():
        stats = {}
        for key, col in RATIOS:
            xs = [x for x in (ratio(r, ref, key) for r, ref in pairs) if x is not None]
            if xs:
                stats[col] = (statistics.median(xs), min(xs), max(xs))
        out.append((name, len(pairs), stats))
    return out


def render_summary(rows: list[dict], markdown: bool) -> str:
    lines = []
    for name, n, stats in summary(rows):
        cells = ", ".join(f"{col} {med:.2f} (min {lo:.2f}, max {hi:.2f})" for col, (med, lo, hi) in stats.items())
        lines.append(
            f"{'- ' if markdown else ''}{name}: median of {n} row(s), each against its own 1-rank row: {cells}"
        )
    return "\n".join(lines)


def render(rows: list[dict], markdown: bool) -> str:
    body = table_rows(rows)
    if markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(COLUMNS[i]), *(len(r[i]) for r in body)) for i in range(len(COLUMNS))]
    last = len(COLUMNS) - 1
    fmt = lambda cells: "  ".join(c.ljust(w) if i in (0, last) else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(COLUMNS)] + [fmt(r) for r in body])


# --------------------------------------------------------------------------- main
def _load1() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="compute",
                    help="checkpoint preset (default: compute; tiny: smoke test)")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/wan-s2v/bench"),
                    help="where presets are built once and reused (default: ~/.cache/wan-s2v/bench)")
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                    help=f"comma-separated subset of {','.join(LAYOUTS)} (default: {','.join(DEFAULT_LAYOUTS)})")
    for dim in ("dit_dim", "dit_heads", "dit_layers", "vae_dim"):
        ap.add_argument("--" + dim.replace("_", "-"), type=int,
                        help="override the preset's checkpoint dimension (own cache entry)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--infer-frames", type=int, default=8)
    ap.add_argument("--num-clips", type=int, default=1, help="clips (2+: includes a motion re-encode)")
    ap.add_argument("--size", default=None, help="WIDTH*HEIGHT (default: the preset's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the --layouts sequence this many times, in order (e.g. --layouts "
                         "1,ulysses+cfg --repeat 3: three pairs); a summary gives each layout's "
                         "median ratio to its own 1-rank row")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    ap.add_argument("--skip-preflight", action="store_true", help="pass --skip-preflight to each run")
    ap.add_argument("--no-frames-check", action="store_true", help="skip the frames comparison")
    ap.add_argument("--work", type=Path, help="keep runs/outputs here (default: a temporary directory)")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.layouts.split(",") if n.strip()]
    names = [n.replace(" --cfg-parallel", "+cfg").replace("-cfg", "+cfg") if n not in LAYOUTS else n
             for n in names]
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        ap.error(f"unknown layout(s) {', '.join(bad)}; choose from {', '.join(LAYOUTS)}")
    a.size = a.size or PRESETS[a.preset]["size"]
    work = (a.work or Path(tempfile.mkdtemp(prefix="wan-s2v-bench-loop-"))).absolute()
    work.mkdir(parents=True, exist_ok=True)
    overrides = {k: getattr(a, k) for k in ("dit_dim", "dit_heads", "dit_layers", "vae_dim")
                 if getattr(a, k) is not None}
    ckpt_desc = {**PRESETS[a.preset]["ckpt"], **overrides}
    assets = ensure_assets(a.cache, a.preset, overrides)
    print(f"work directory: {work}", file=sys.stderr, flush=True)
    load_before = _load1()
    t0 = time.perf_counter()
    rows = [one(a, n, assets, work, i) for i in range(max(1, a.repeat)) for n in names]
    total = time.perf_counter() - t0
    load_after = _load1()
    ref = next((r for r in rows if r["layout"] == "1" and r["ok"]), None)
    for r in rows:
        if not r["ok"]:
            continue
        if a.no_frames_check or ref is None:
            r["frames_check"] = "-"
        elif r is ref:
            r["frames_check"] = "(reference)"
        else:
            r["frames_check"] = compare_frames(ref["frames"], r["frames"])
    if a.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0 if all(r["ok"] for r in rows) else 1
    print(render(rows, a.markdown))
    if a.repeat > 1 or len(rows) > len({r["layout"] for r in rows}):
        print(("\n" if a.markdown else "") + render_summary(rows, a.markdown))
    torch_v = next((r["torch"] for r in rows if r.get("torch")), "?")
    note = (
        f"preset {a.preset} ({ckpt_desc}), size {a.size}, {a.infer_frames} frames, "
        f"{a.num_clips} clip(s), {a.steps} steps, seed {a.seed}, cpu/gloo, "
        f"{a.threads} thread(s)/rank, torch {torch_v}; "
        f"ratios to the latest 1-rank row before each row; bench total {total:.0f} s; "
        f"1-min load average {load_before} before, {load_after} after"
    )
    print(f"\n{note}" if a.markdown else f"({note})")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())


def live_inputs(cache: str, preset: str, size: str, seconds: float, prefix: str) -> tuple[Path, Path, Path, Path]:
    """A live bench's inputs: (ckpt_dir of ``preset``, a fresh work folder, a reference image of
    ``size`` (W*H), ``seconds`` of synthetic speech at 16 kHz)."""
    import tempfile

    from wan_s2v_runner.demo.synthetic_inputs import make_reference_image, make_speech_audio

    ckpt, _, _ = ensure_assets(Path(cache), preset)
    w, h = (int(v) for v in size.split("*"))
    work = Path(tempfile.mkdtemp(prefix=prefix))
    image = make_reference_image(work / "in" / "ref.png", width=w, height=h, seed=0)
    audio = make_speech_audio(work / "in" / "speech.wav", seconds=seconds, seed=0)
    return ckpt, work, image, audio
