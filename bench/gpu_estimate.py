"""Seconds per 5-second video at 1, 2, 4, 8 GPUs per layout, from one GPU's measurements (issue #29, part 4).

A model, stated with its inputs, not a measurement. Inputs:

* ``--step-json``: ``bench/gpu_step.py --json`` on one GPU: seconds per denoising step at the real
  size and the operation count by term (attention's share decides how Ulysses scales);
* ``--pipeline-json`` (optional): ``bench/gpu_pipeline.py --json`` of a 5-second video (its
  default: two clips): the VAE seconds of the video's clips and the once-per-video stages on one
  GPU; without it those are left out (said in the table);
* ``--link-gbs``: all-to-all bandwidth per GPU in GB/s (default 300: H100 NVLink 4's 450 GB/s per
  direction at ~2/3 efficiency for all-to-all; measure yours with nccl-tests' alltoall_perf).

Per step, for a layout of CFG degree c and Ulysses degree d (:mod:`wan_s2v_runner.preflight.plans`):

    compute  = step_1gpu / speedup(layout)          speedup: plans.estimate_speedup (work split:
                                                     per-token work / d, attention by heads per rank)
    comm     = (2 / c) passes x layers x 4 all-to-alls x (L / d) x dim x 2 bytes x (d - 1) / d / link
               + (c > 1) one all-gather of the noise prediction (16 x f x h x w x 4 bytes)
               + (FSDP DiT) (2 / c) passes x the DiT's bytes x (world - 1) / world / link
    step     = compute + comm                        (no overlap assumed: an upper bound)

    video    = clips x steps x step + vae x vae_share(world) + once
    clips    = floor(5 s x 16 fps / 80) + 1 = 2;  steps = 40
    vae      = the measured video's decode + motion_encode seconds (clip 1 decodes 21 latent frames,
               later clips 39, and only clips before the last re-encode motion: a pipeline run of
               fewer clips is scaled by clips and flagged); vae_share = 0.50 / 0.34 at 2 / 3 bands
               (the split VAE measured on an H100, docs/gpu.md), 1 / bands beyond
    once     = audio, reference and text encoding, save and mux (one GPU's seconds; not split)

Loading is not in the number (it is paid once per server or batch, not per video).

    python bench/gpu_estimate.py --step-json step.json --pipeline-json pipeline.json [--markdown]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VIDEO_SECONDS, INFER_FRAMES, STEPS = 5.0, 80, 40
#: the split VAE's band cost as a share of one GPU's VAE time, measured on an H100 (docs/gpu.md):
#: 2 bands 0.50x, 3 bands 0.34x; more bands: rows / bands (what the band sizes give)
VAE_SHARE = {1: 1.0, 2: 0.50, 3: 0.34}
ONCE_STAGES = ("audio_encode", "ref_encode", "text_encode", "save", "mux")
CLIP_VAE_STAGES = ("decode", "motion_encode")


def vae_share(world: int) -> float:
    return VAE_SHARE.get(world, 1.0 / world)


def estimate(step: dict, pipeline: dict | None, link_gbs: float, worlds=(1, 2, 4, 8)) -> list[dict]:
    from wan_s2v_runner.preflight.geometry import VAE_STRIDE, clips_for_audio, latent_frames
    from wan_s2v_runner.preflight.plans import plans_for
    from wan_s2v_runner.shared.job_time import step_passes
    from wan_s2v_runner.shared.layout import Mode
    from wan_s2v_runner.shared.spec import size_pair

    dims = step["dims"]
    length = step["tokens"]
    clips = clips_for_audio(VIDEO_SECONDS, INFER_FRAMES)
    measured = (pipeline or {}).get("measured", {})
    stages = measured.get("stage_seconds", {})
    vae = sum(stages.get(s, 0.0) for s in CLIP_VAE_STAGES) * clips / max(1, measured.get("clips") or clips)
    once = sum(stages.get(s, 0.0) for s in ONCE_STAGES)
    w, h = size_pair(step["size"])
    weight_bytes = step["weights_gib"] * 2**30
    pred_bytes = 16 * latent_frames(INFER_FRAMES) * (h // VAE_STRIDE[1]) * (w // VAE_STRIDE[2]) * 4
    rows = []
    for mode in (Mode.ULYSSES, Mode.FSDP_FIXED, Mode.HYBRID):
        for world in worlds:
            for plan in plans_for(mode, world, dims["num_heads"], dims["dim"], dims["ffn_dim"], [length]):
                if not plan.valid:
                    continue
                c, d = plan.layout.cfg_degree, plan.layout.sp_degree
                passes = step_passes(True, c)  # a rank's passes a step (CFG on: the step measured)
                compute = step["step_s"] / plan.speedup
                a2a = 0.0
                if plan.layout.use_sp and d > 1:
                    per_pass = dims["num_layers"] * 4 * math.ceil(length / d) * dims["dim"] * 2 * (d - 1) / d
                    a2a = passes * per_pass / (link_gbs * 1e9)
                gather = pred_bytes * (c - 1) / (link_gbs * 1e9) if c > 1 else 0.0
                fsdp = 0.0
                if plan.layout.dit_fsdp and world > 1:  # every pass gathers the other ranks' shards
                    fsdp = passes * weight_bytes * (world - 1) / world / (link_gbs * 1e9)
                step_s = compute + a2a + gather + fsdp
                video = clips * STEPS * step_s + vae * vae_share(world) + once
                rows.append(
                    {
                        "mode": mode.value,
                        "gpus": world,
                        "layout": plan.shape,
                        "speedup_compute": plan.speedup,
                        "compute_s": compute,
                        "all_to_all_s": a2a,
                        "cfg_gather_s": gather,
                        "fsdp_gather_s": fsdp,
                        "step_s": step_s,
                        "video_s": video,
                    }
                )
    return rows


def render(rows: list[dict], step: dict, pipeline: dict | None, link: float) -> str:
    made = ((pipeline or {}).get("measured") or {}).get("clips")
    short = pipeline is not None and made is not None and made < 2
    lines = [f"NOTE: the pipeline run made {made} clip(s); its VAE seconds are scaled by clips "
             "(clip 1 is the lighter one: this understates the VAE)"] if short else []
    lines += [
        f"inputs: one GPU ({step['device']}) step {step['step_s']} s at {step['size']} ({step['tokens']} tokens); "
        f"link {link} GB/s; VAE and once-per-video stages "
        + ("from " + str(pipeline.get("run_json")) if pipeline else "NOT included (no --pipeline-json)"),
        "",
        "| mode | GPUs | layout | compute speed-up | step s (compute + all-to-all + CFG gather + FSDP gather) | "
        "s per 5-s video |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['gpus']} | {r['layout']} | {r['speedup_compute']:.2f}x | "
                     f"{r['step_s']:.2f} ({r['compute_s']:.2f} + {r['all_to_all_s']:.2f} + {r['cfg_gather_s']:.3f} + "
                     f"{r['fsdp_gather_s']:.2f}) | "
                     f"{r['video_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-json", type=Path, required=True)
    ap.add_argument("--pipeline-json", type=Path)
    ap.add_argument("--link-gbs", type=float, default=300.0)
    ap.add_argument("--gpus", default="1,2,4,8")
    a = ap.parse_args(argv)
    step = json.loads(a.step_json.read_text())
    pipeline = json.loads(a.pipeline_json.read_text()) if a.pipeline_json else None
    rows = estimate(step, pipeline, a.link_gbs, tuple(int(g) for g in a.gpus.split(",")))
    print(render(rows, step, pipeline, a.link_gbs))
    return rows


if __name__ == "__main__":
    main()
