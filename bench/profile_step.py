"""Where one DiT pass spends its time on this CPU, eager and with ``--compile`` (issue #46).

One conditional pass of the compute preset's DiT (``bench/bench_loop.py``: dim 1536, 10 layers,
256x256, 80 frames) on one thread under ``torch.profiler``: the share of the matrix products
(``aten::addmm``), of attention (SDPA) and of everything else, which is all that compiling the
blocks can fuse. The matrix products and attention stay the same library calls compiled or not,
so ``1 - share(other)`` bounds what ``--compile`` can reach on this CPU.

    .venv/bin/python bench/profile_step.py            # eager, then compiled (~8 min on one thread)
    .venv/bin/python bench/profile_step.py --eager-only
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

LIBRARY = {"matmul": ("aten::addmm", "aten::mm", "aten::bmm"),
           "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_attention_math")}


def shares(prof) -> dict[str, float]:
    """Self CPU seconds of the matrix products, attention and the rest."""
    got = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.key_averages():
        kind = next((k for k, names in LIBRARY.items() if e.key in names), "other")
        got[kind] += e.self_cpu_time_total / 1e6
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eager-only", action="store_true")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "wan-s2v" / "bench")
    a = ap.parse_args()

    import torch
    from bench_loop import ensure_assets
    from torch.profiler import ProfilerActivity, profile

    from patches import attention, compile_blocks, context_cache
    from wan_s2v_runner.demo.random_weights import dit_kwargs, random_dit_inputs
    from wan_s2v_runner.loading.engine import import_wan
    from wan_s2v_runner.preflight.geometry import token_counts

    torch.set_num_threads(1)
    ckpt, _, _ = ensure_assets(a.cache, "compute")
    wan = import_wan()
    attention.apply(wan, "sdpa")
    model = wan.modules.s2v.model_s2v.WanModel_S2V.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    model = model.eval().requires_grad_(False)
    context_cache.apply(model)  # as the runner loads it
    cfg = model.config
    motion_frames = int(cfg.get("motion_frames", dit_kwargs(wan)["motion_frames"]))  # the engine's, if not saved
    x, t, cond, _ = random_dit_inputs(int(cfg["audio_dim"]), motion_frames, token_counts(256, 256, 80),
                                      80, torch.device("cpu"), torch.float32, False)

    def one_pass():
        with torch.no_grad():
            return model(x, t=t, **cond)

    rows = []
    for name in ("eager",) if a.eager_only else ("eager", "compiled"):
        if name == "compiled":
            compile_blocks.apply(wan, torch.float32)
        one_pass()  # warm-up (and the compile)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one_pass()
        rows.append((name, time.perf_counter() - t0, shares(prof)))
        print(f"{name}: {rows[-1][1]:.1f} s", file=sys.stderr, flush=True)
    print("| pass | s (profiled) | matrix products | attention (SDPA) | everything else |")
    print("|---|---|---|---|---|")
    for name, wall, s in rows:
        total = sum(s.values())
        print(f"| {name} | {wall:.1f} | " + " | ".join(f"{s[k]:.1f} s ({s[k] / total:.0%})"
                                                       for k in ("matmul", "attention", "other")) + " |")
    eager_other = rows[0][2]["other"] / sum(rows[0][2].values())
    print(f"\nbound: with everything else fused away, a compiled pass is >= {1 - eager_other:.2f}x eager")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
