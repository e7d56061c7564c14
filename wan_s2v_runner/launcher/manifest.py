"""``run.json``: the record of one run (spec, engine, versions, layout, timings, memory, result)."""
from __future__ import annotations

import platform
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from wan_s2v_runner.loading import lora
from wan_s2v_runner.shared import cache_policy, engine_source, exit_codes
from wan_s2v_runner.shared.events import EventReader, stage_durations
from wan_s2v_runner.shared.spec import RunSpec

VERSIONED = ("torch", "torchvision", "wan22", "transformers", "diffusers", "huggingface-hub",
             "accelerate", "peft", "librosa", "decord", "imageio-ffmpeg", "flash-attn", "pydantic")


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def engine_info(spec) -> dict:
    try:
        loc = engine_source.locate(spec.wan_repo)
    except engine_source.EngineNotFound as e:
        return {"error": str(e)}
    fp = engine_source.s2v_fingerprint(loc.package_dir)
    return {"source": loc.source, "path": str(loc.package_dir), "version": engine_source.engine_version(loc),
            "s2v_fingerprint": fp, "matches_known_upstream": fp == engine_source.KNOWN_S2V_FINGERPRINT}


def _mem(st, key: str, launcher_seen: dict):
    """A peak-memory figure: the rank's own ``end`` record, else its last heartbeat, else (host
    RSS only) the largest of the launcher's readings of /proc/<pid>/status VmHWM while the rank
    ran (the rank resets VmHWM at each stage, so a spike between two readings can be missed)."""
    end = st.end or {}
    if end.get(key) is not None:
        return end[key], "end"
    found = []
    if st.mem.get(key) is not None:
        found.append((st.mem[key], "heartbeat"))
    if key == "host_peak_rss_mb" and launcher_seen.get(str(st.rank)) is not None:
        found.append((launcher_seen[str(st.rank)], "launcher"))
    return max(found) if found else (None, None)


def _resume_info(spec):
    """Where a resumed run took over: the source run directory and the first clip it generated."""
    if not spec.resume_from:
        return None
    from wan_s2v_runner.shared import resume
    try:
        p = resume.read_progress(spec.resume_from)
    except resume.ResumeError:
        return {"from": str(spec.resume_from), "at_clip": None}
    return {"from": str(spec.resume_from), "at_clip": p.next_clip + 1, "clips": p.num_clips}


def build(spec, run_dir: Path, reader: EventReader, outcome, started: float, ended: float,
          launcher: dict | None = None) -> dict:
    from wan_s2v_runner.shared import media

    launcher = launcher or {}
    seen = launcher.get("host_peak_rss_mb_seen") or {}
    ranks = {}
    for r, st in sorted(reader.ranks.items()):
        end = st.end or {}
        host, src = _mem(st, "host_peak_rss_mb", seen)
        gpu_alloc, _ = _mem(st, "gpu_peak_allocated_mb", seen)
        gpu_res, _ = _mem(st, "gpu_peak_reserved_mb", seen)
        ranks[str(r)] = {
            "pid": st.pid, "host": st.host, "local_rank": st.local_rank, "cpus": st.cpus, "last_stage": st.stage,
            "progress": st.progress or None,
            "finished": bool(st.end) and not st.error,
            "stage_seconds": stage_durations(st),
            # peak memory while each stage ran (its largest over clips and jobs), MiB
            "stage_peak_mb": {str(k): v for k, v in st.stage_peaks.items()},
            "host_peak_rss_mb": host, "memory_source": src,
            "gpu_peak_allocated_mb": gpu_alloc,
            "gpu_peak_reserved_mb": gpu_res,
            "wall_s": end.get("wall_s"),
            "load": st.loaded,
            "error": st.error and {k: st.error.get(k) for k in ("error_type", "message", "stage")},
        }
    r0 = reader.ranks.get(min(reader.ranks)) if reader.ranks else None
    stacks = sorted(str(p.relative_to(run_dir)) for p in (Path(run_dir) / "stacks").glob("*.txt")) \
        if (Path(run_dir) / "stacks").is_dir() else []
    job = spec if isinstance(spec, RunSpec) else None  # a run's one job; a batch's jobs have their records
    output = None
    if job is not None and outcome.code == exit_codes.OK and spec.output.is_file():
        info = media.probe(spec.output)
        output = {"path": str(spec.output), "sha256": media.sha256_file(spec.output),
                  "bytes": spec.output.stat().st_size, "video_codec": info.video_codec,
                  "audio_codec": info.audio_codec, "frames": info.n_frames,
                  "width": info.width, "height": info.height}
    return {
        "schema": 1,
        "run_dir": str(run_dir),
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(),
        "ended": datetime.fromtimestamp(ended, timezone.utc).isoformat(),
        "wall_s": round(ended - started, 3),
        "exit": {"code": outcome.code, "status": exit_codes.NAMES.get(outcome.code, "unknown"),
                 "reason": outcome.reason, "failed_rank": outcome.failed_rank,
                 "failed_stage": outcome.failed_stage, "error": outcome.error, "hint": outcome.hint,
                 "stuck": outcome.stuck or None, "details": outcome.details or None,
                 "traceback": outcome.traceback},
        "launcher": launcher or None,
        "stacks": stacks,
        "seed": job.seed if job else None,
        "mode": spec.mode.value,
        "layout": {**spec.layout.model_dump(), "ulysses_degree": spec.layout.ulysses_degree,
                   "nproc_per_node": spec.nproc, "nnodes": spec.nnodes, "node_rank": spec.node_rank},
        # wall time per stage of the first rank on this node (rank 0 on node 0); per rank below
        "stage_seconds": stage_durations(r0) if r0 else {},
        "ranks": ranks,
        "output": output,
        "loras": lora.describe(spec.lora, spec.ckpt_dir, spec.dit_file) if spec.lora else [],
        "resume": _resume_info(spec) if job else None,
        # --cache: per clip this run generated, the steps computed and reused (rank 0's; every rank takes the same)
        "step_cache": (cache_policy.summary(job.cache, r0.step_cache) if job and r0 and cache_policy.parse(job.cache).on
                       else None),
        # --mode live: seconds to the first frame, frames per second after it, blocks (rank 0's, the last job's)
        "live": r0.live if job and r0 and r0.live else None,
        "engine": engine_info(spec),
        "versions": package_versions(),
        "platform": {"machine": platform.machine(), "system": platform.system(), "argv": sys.argv},
        "spec": spec.model_dump(mode="json"),
    }
