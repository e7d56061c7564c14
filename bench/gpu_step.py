"""One S2V DiT denoising step at real size (issue #29, part 1): seconds, TFLOP/s, MFU, peak memory.

The S2V-14B DiT is built from the engine's own config (``WAN_CONFIGS['s2v-14B'].transformer``:
dim 5120, 40 heads, 40 layers, 12 audio-injection layers) on the meta device, then every
parameter is materialized on the device as random bf16 (no checkpoint file, no 33 GB on disk).
One step is what the generation loop does per timestep: the conditional and the unconditional
pass (CFG; the unconditional pass zeroes the audio and swaps the text), under
``autocast(bf16)``, at the real shapes of a later clip (noisy latents of an 80-frame clip, the
reference latent, the 19 motion latents packed by FramePack: 63,360 tokens at 1024x704).

What it prints (and writes with ``--json``):

* seconds per step (median of ``--repeat`` after ``--warmup``), and per pass;
* operations per step counted from the shapes (:mod:`wan_s2v_runner.preflight.dit_flops`: every
  matmul and convolution of the pass, ``2 m k n``; the text embedding and cross-attention
  keys/values counted unless ``--text-cached``) and with ``--count-flops`` also by
  ``torch.utils.flop_counter`` over a real pass; achieved TFLOP/s and MFU against the GPU's dense
  bf16 peak (``--peak-tflops``, else by device name: ``preflight/streaming.py``'s table);
* the attention backend the runner picks (``--attention auto``: FA3, FA2, then SDPA) and, for
  SDPA, which kernel ran (the CUDA kernel names of one attention call at the real shape, from
  ``torch.profiler``);
* peak memory (``torch.cuda.max_memory_allocated``) above the weights, and the weights' bytes;
* with ``--compile``: the same step with the DiT under ``torch.compile`` (first call's seconds
  reported as compile time).

    python bench/gpu_step.py                       # CUDA, real size, 1024x704, 80 frames
    python bench/gpu_step.py --compile --count-flops --json step.json
    python bench/gpu_step.py --device cpu --preset small --size 256*256 --infer-frames 8  # smoke test

``--preset small`` is a small DiT of the same structure (for a CPU check of the script). The
engine comes from where the runner finds it (``WAN_REPO`` or the installed ``wan22``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: DiT sizes per preset: the real config, or a small one of the same structure
PRESETS = {
    "real": {},
    "small": {"dim": 256, "ffn_dim": 512, "num_heads": 4, "num_layers": 4, "audio_inject_layers": [0, 2, 3],
              "audio_dim": 64},
}


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def sdpa_kernel_names(device, heads: int, head_dim: int, length: int, dtype) -> list[str]:
    """CUDA kernels one SDPA call at this shape launches, under the loop's autocast (profiler)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile
    q = torch.randn(1, heads, length, head_dim, device=device, dtype=torch.float32)
    with torch.amp.autocast("cuda", dtype=dtype), profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, q, q)
        torch.cuda.synchronize(device)
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def sdpa_kernel_kind(names: list[str]) -> str:
    """Which SDPA implementation launched these kernels."""
    low = " ".join(names).lower()
    for needle, kind in (("cudnn", "cuDNN attention"), ("flash", "FlashAttention-2 (PyTorch's)"),
                         ("fmha", "memory-efficient (xformers/cutlass)"), ("efficient", "memory-efficient"),
                         ("cutlass", "memory-efficient (cutlass)")):
        if needle in low:
            return kind
    return "math (unfused)" if names else "unknown"


def peak_tflops(name: str, override: float | None) -> float | None:
    """``--peak-tflops``, else the GPU's dense bf16 peak by name (the doctor's table:
    :func:`wan_s2v_runner.preflight.streaming.gpu_tflops`)."""
    from wan_s2v_runner.preflight.streaming import gpu_tflops
    return override or gpu_tflops(name)


def _mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """The share of ``peak`` reached (``shared.dit_cost.achieved_mfu``, the plan's MFU read back), rounded."""
    from wan_s2v_runner.shared.dit_cost import achieved_mfu
    mfu = achieved_mfu(flops, seconds, peak)
    return None if mfu is None else round(mfu, 4)


def run_steps(model, x, t, cond, uncond, device, dtype, warmup: int, repeat: int):
    """(first call's seconds, median step seconds, median pass seconds) of cond + uncond passes."""
    import torch
    autocast = torch.amp.autocast(device.type, dtype=dtype, enabled=device.type == "cuda")

    def one_pass(args):
        with autocast, torch.no_grad():
            return model(x, t=t, **args)

    def step():
        c, u = one_pass(cond), one_pass(uncond)
        return [u_ + 4.5 * (c_ - u_) for c_, u_ in zip(c, u)]

    first = timed(step, device)
    for _ in range(max(0, warmup - 1)):
        timed(step, device)
    steps = [timed(step, device) for _ in range(repeat)]
    passes = [timed(lambda: one_pass(cond), device) for _ in range(repeat)]
    return first, statistics.median(steps), statistics.median(passes)


def counted_flops(model, x, t, cond, device, dtype) -> int:
    """Operations of one conditional pass as ``torch.utils.flop_counter`` counts them."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    # on the CPU the fused SDPA kernel is not counted: its math form is (CUDA's SDPA kernels are)
    kernels = sdpa_kernel([SDPBackend.MATH]) if device.type == "cpu" else contextlib.nullcontext()
    with kernels, counter, torch.amp.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"), torch.no_grad():
        model(x, t=t, **cond)
    return int(counter.get_total_flops())


def fp8_step(model, x, t, cond, uncond, device, dtype, a, eager_step_s: float) -> dict:
    """Quantize ``model`` in place (--dit-quant fp8's rule) and time its step once per
    ``--fp8-matmul`` way: seconds, peak memory, and one conditional pass's distance from the
    full-precision pass; plus the weights' bytes. The model is left in the last way (a
    ``--compile`` compiles that)."""
    import torch

    from patches import fp8_linear
    from wan_s2v_runner.loading.quantize import quantize_loaded
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        ref = torch.stack(list(model(x, t=t, **cond))).float()
    names = quantize_loaded(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    out = {"linears": len(names), "weights_gib": round(weights / 2**30, 2),
           "output_mean_magnitude": float(ref.abs().mean()), "matmul": {}}
    for way in a.fp8_matmul:
        fp8_linear.set_matmul(model, way)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        first, step_s, pass_s = run_steps(model, x, t, cond, uncond, device, dtype, a.warmup, a.repeat)
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            got = torch.stack(list(model(x, t=t, **cond))).float()
        d = (got - ref).abs()
        r = {"first_step_s": round(first, 3), "step_s": round(step_s, 3), "pass_s": round(pass_s, 3),
             "vs_eager": round(step_s / eager_step_s, 3), "output_max_abs": float(d.max()),
             "output_mean_abs": float(d.mean())}
        del got, d
        if device.type == "cuda":
            r["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        out["matmul"][way] = r
        print(f"fp8 ({way}): {step_s:.3f} s/step ({r['vs_eager']}x eager)", flush=True)
    return out


def linear_times(device, dtype, tokens: int, dims, repeat: int = 10) -> dict:
    """Seconds of one block Linear at the step's token count, by the three ways: the param dtype's
    F.linear, fp8 dequantized per call, and torch._scaled_mm with per-token activation scales
    (the quantizing of the input included). Shapes: the FFN's first Linear and one q/k/v/o."""
    import torch
    import torch.nn.functional as F

    from patches import fp8_linear
    from wan_s2v_runner.loading.quantize import quantize_tensor
    def one(n_in: int, n_out: int) -> dict:
        lin = torch.nn.Linear(n_in, n_out, device=device, dtype=dtype)
        xin = torch.randn(tokens, n_in, device=device, dtype=dtype)
        qw = fp8_linear.Fp8Weight(n_out, n_in, device=device)
        q, scale = quantize_tensor(lin.weight.detach())
        qw.weight = torch.nn.Parameter(q, requires_grad=False)
        qw.scale = scale
        ways = {"bf16": lambda: F.linear(xin, lin.weight, lin.bias),
                "dequant": lambda: F.linear(xin, qw(dtype), lin.bias),
                "scaled-mm": lambda: fp8_linear.scaled_mm_linear(xin, qw, lin.bias)}
        row = {}
        with torch.no_grad():
            for way, fn in ways.items():
                fn()
                row[way] = round(statistics.median(timed(fn, device) for _ in range(repeat)) * 1e3, 3)
        return {"shape": [tokens, n_in, n_out], "ms": row}

    return {name: one(*shape) for name, shape in (("ffn.0", (dims.dim, dims.ffn_dim)),
                                                   ("self_attn.q", (dims.dim, dims.dim)))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--preset", default="real", choices=sorted(PRESETS))
    ap.add_argument("--size", default="1024*704", help="WIDTH*HEIGHT, multiples of 64 (default 1024*704)")
    ap.add_argument("--infer-frames", type=int, default=80)
    ap.add_argument("--first-clip", action="store_true", help="clip 1: motion tokens dropped (shorter sequence)")
    ap.add_argument("--attention", default="auto", choices=["auto", "fa4", "fa3", "fa2", "sdpa"])
    ap.add_argument("--attention-also", choices=["fa4", "fa3", "fa2", "sdpa"],
                    help="after the eager step, time it again with this backend on the same model and inputs (and "
                         "one pass's distance from the first backend's); a --compile then runs with this one")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compile", nargs="?", const="blocks", choices=["blocks", "model"],
                    help="also time the step under torch.compile: each DiT block (default: the runner's --compile, "
                         "patches/compile_blocks.py) or the whole model as upstream wrote it")
    ap.add_argument("--dit-quant", default="none", choices=["none", "fp8"],
                    help="fp8: after the eager step, quantize the DiT's Linears in place (the runner's --dit-quant "
                         "fp8 rule, loading/quantize.py) and time the fp8 step, its peak memory and its output's "
                         "distance (a --compile then compiles the fp8 DiT)")
    ap.add_argument("--fp8-matmul", default="dequant", type=lambda v: v.split(","),
                    help="with --dit-quant fp8: the ways to time, comma-separated, in order (dequant, scaled-mm; "
                         "the runner's --fp8-matmul); the last is the one --compile compiles")
    ap.add_argument("--linear-times", action="store_true",
                    help="also time one block Linear at the step's token count: bf16, fp8 dequant, fp8 scaled-mm")
    ap.add_argument("--count-flops", action="store_true", help="also count one pass with torch.utils.flop_counter")
    ap.add_argument("--text-cached", action="store_true",
                    help="count FLOPs as the runner runs (text embedding and cross-attention k/v cached)")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, TFLOP/s (default: by name)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    from wan_s2v_runner.shared.quant import Fp8Matmul
    try:
        a.fp8_matmul = [Fp8Matmul(w).value for w in a.fp8_matmul]
    except ValueError as e:
        ap.error(f"--fp8-matmul: {e} (the ways: {', '.join(m.value for m in Fp8Matmul)})")

    import torch

    from patches import attention
    from wan_s2v_runner.demo.random_weights import dit_kwargs, random_dit, random_dit_inputs
    from wan_s2v_runner.loading.engine import import_wan
    from wan_s2v_runner.preflight.dit_flops import forward_flops, step_flops
    from wan_s2v_runner.preflight.geometry import token_counts
    from wan_s2v_runner.shared.dit_cost import DitDims
    from wan_s2v_runner.shared.spec import size_pair

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here; use --device cpu --preset small for a smoke test")
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    try:
        w, h = size_pair(a.size)
    except ValueError as e:
        ap.error(str(e))
    if w % 64 or h % 64:
        ap.error(f"--size {a.size}: WIDTH and HEIGHT must be multiples of 64")
    torch.manual_seed(0)

    wan = import_wan()
    backend, reason = attention.resolve_backend(a.attention, device.type)
    attention.apply(wan, backend)
    t0 = time.perf_counter()
    model, weight_bytes = random_dit(wan, device, dtype, **PRESETS[a.preset])
    build_s = time.perf_counter() - t0
    cfg = dit_kwargs(wan, **PRESETS[a.preset])
    dims = DitDims.from_config(cfg)
    tokens = token_counts(h, w, a.infer_frames)
    x, t, cond, uncond = random_dit_inputs(
        int(cfg["audio_dim"]), int(cfg["motion_frames"]), tokens, a.infer_frames, device, dtype, a.first_clip
    )
    flops = forward_flops(dims, tokens, with_motion=not a.first_clip, text_cached=a.text_cached)
    per_step = step_flops(dims, tokens, with_motion=not a.first_clip, text_cached=a.text_cached)

    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "cuda": torch.version.cuda,
                 "preset": a.preset, "size": f"{w}*{h}", "infer_frames": a.infer_frames, "tokens": flops.length,
                 "dims": dims.__dict__, "dtype": str(dtype).replace("torch.", ""),
                 "attention": {"backend": backend, "reason": reason},
                 "weights_gib": round(weight_bytes / 2**30, 2), "build_s": round(build_s, 1),
                 "flops_per_pass": flops.total, "flops_terms": flops.terms,
                 "flops_per_step": per_step, "text_cached": a.text_cached}
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401
            out["attention"]["flash_attn"] = getattr(flash_attn, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - reported, not needed
            out["attention"]["flash_attn"] = f"not importable ({type(e).__name__})"
        if backend == "sdpa":
            names = sdpa_kernel_names(device, dims.num_heads, dims.dim // dims.num_heads, flops.length, dtype)
            out["attention"]["sdpa_kernel"] = sdpa_kernel_kind(names)
            out["attention"]["sdpa_cuda_kernels"] = names
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    first, step_s, pass_s = run_steps(model, x, t, cond, uncond, device, dtype, a.warmup, a.repeat)
    out.update(first_step_s=round(first, 3), step_s=round(step_s, 3), pass_s=round(pass_s, 3))
    if device.type == "cuda":
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        out["peak_above_weights_gib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 2)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    tflops = per_step / step_s / 1e12
    peak = peak_tflops(out["device"], a.peak_tflops)
    out.update(tflops=round(tflops, 1), peak_tflops=peak, mfu=_mfu(per_step, step_s, peak))
    # said at once: a run stopped later (the device call's time limit) still reports the eager step
    print(f"eager: {step_s:.3f} s/step, {tflops:.1f} TFLOP/s (build {build_s:.1f} s)", flush=True)
    if a.count_flops:  # flop_counter sees SDPA's kernels, not flash-attn's: counted with SDPA
        attention.apply(wan, "sdpa")
        out["flops_counted_per_pass"] = counted_flops(model, x, t, cond, device, dtype)
        attention.apply(wan, backend)
        out["flops_counted_vs_shapes"] = round(out["flops_counted_per_pass"] / flops.total, 4)
    def dump() -> None:  # after each part: a call stopped by its time limit keeps what was measured
        if a.json:
            a.json.write_text(json.dumps(out, indent=2) + "\n")

    dump()
    if a.attention_also:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            ref = torch.stack(list(model(x, t=t, **cond))).float()
        other, why = attention.resolve_backend(a.attention_also, device.type)
        attention.apply(wan, other)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        o_first, o_step, o_pass = run_steps(model, x, t, cond, uncond, device, dtype, a.warmup, a.repeat)
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            d = (torch.stack(list(model(x, t=t, **cond))).float() - ref).abs()
        o_tflops = per_step / o_step / 1e12
        out["attention_also"] = {"backend": other, "reason": why, "first_step_s": round(o_first, 3),
                                 "step_s": round(o_step, 3), "pass_s": round(o_pass, 3), "tflops": round(o_tflops, 1),
                                 "mfu": _mfu(per_step, o_step, peak),
                                 "vs_first_backend": round(o_step / step_s, 3),
                                 "pass_vs_first_backend_max_abs": float(d.max()),
                                 "pass_vs_first_backend_mean_abs": float(d.mean()),
                                 "output_mean_magnitude": float(ref.abs().mean())}
        if device.type == "cuda":
            out["attention_also"]["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        del ref, d
        print(f"eager with {other}: {o_step:.3f} s/step ({out['attention_also']['vs_first_backend']}x {backend}; "
              f"first step {o_first:.1f} s)", flush=True)
        dump()
    if a.linear_times:
        out["linear_ms"] = linear_times(device, dtype, flops.length, dims)
        print(f"one Linear, ms: {out['linear_ms']}", flush=True)
    if a.dit_quant == "fp8":
        out["fp8"] = fp8_step(model, x, t, cond, uncond, device, dtype, a, step_s)
        dump()
    if a.compile:
        from torch._dynamo.utils import counters
        counters.clear()
        if a.compile == "blocks":  # the product's --compile (patches/compile_blocks.py)
            from patches import compile_blocks
            compile_blocks.apply(wan, dtype, on_compile=lambda info: print(f"compiled: {info}", flush=True))
            compiled = model
        else:
            compiled = torch.compile(model, dynamic=False)
        print(f"compiling ({a.compile}) ...", flush=True)
        c_first, c_step, c_pass = run_steps(compiled, x, t, cond, uncond, device, dtype, a.warmup, a.repeat)
        print(f"compiled: {c_step:.3f} s/step (first step {c_first:.1f} s), eager {step_s:.3f}", flush=True)
        c_tflops = per_step / c_step / 1e12
        out["compiled"] = {"scope": a.compile, "fp8_matmul": a.fp8_matmul[-1] if "fp8" in out else None,
                           "first_step_s": round(c_first, 1), "step_s": round(c_step, 3),
                           "pass_s": round(c_pass, 3), "tflops": round(c_tflops, 1),
                           "mfu": _mfu(per_step, c_step, peak), "speedup": round(step_s / c_step, 3),
                           "unique_graphs": int(counters["stats"]["unique_graphs"]),
                           "graph_breaks": int(sum(counters["graph_break"].values()))}
    print(render(out))
    dump()
    return out


def render(r: dict) -> str:
    """The results as a small markdown table plus the attention line."""
    lines = [
        f"DiT step on {r['device']} (torch {r['torch']}, cuda {r['cuda']}), preset {r['preset']}, "
        f"{r['size']}, {r['infer_frames']} frames, {r['tokens']} tokens, {r['dtype']}",
        f"attention: {r['attention']['backend']} ({r['attention']['reason']})"
        + (f"; SDPA kernel: {r['attention']['sdpa_kernel']}" if "sdpa_kernel" in r["attention"] else ""),
        "",
        "| | step s (cond + uncond) | pass s | TFLOP/s | MFU | peak GiB (weights) |",
        "|---|---|---|---|---|---|",
    ]
    mfu = lambda v: f"{100 * v:.1f}%" if v is not None else "-"  # noqa: E731
    mem = f"{r.get('peak_allocated_gib', '-')} ({r['weights_gib']})"
    lines.append(f"| eager | {r['step_s']} | {r['pass_s']} | {r['tflops']} | {mfu(r['mfu'])} | {mem} |")
    if "attention_also" in r:
        o = r["attention_also"]
        lines.append(f"| eager, attention {o['backend']} ({o['vs_first_backend']}x; one pass vs "
                     f"{r['attention']['backend']}: max {o['pass_vs_first_backend_max_abs']:.3g}, mean "
                     f"{o['pass_vs_first_backend_mean_abs']:.3g} of {o['output_mean_magnitude']:.3g}) | "
                     f"{o['step_s']} | {o['pass_s']} | {o['tflops']} | {mfu(o['mfu'])} | "
                     f"{o.get('peak_allocated_gib', '-')} |")
    if "fp8" in r:
        f = r["fp8"]
        for way, m in f["matmul"].items():
            lines.append(f"| --dit-quant fp8 --fp8-matmul {way} ({f['linears']} Linears; {m['vs_eager']}x eager; "
                         f"output vs full precision: max {m['output_max_abs']:.3g}, mean {m['output_mean_abs']:.3g} "
                         f"of {f['output_mean_magnitude']:.3g}) | {m['step_s']} | {m['pass_s']} | - | - | "
                         f"{m.get('peak_allocated_gib', '-')} ({f['weights_gib']}) |")
    if "compiled" in r:
        c = r["compiled"]
        what = "torch.compile" + (f" (fp8, {list(r['fp8']['matmul'])[-1]})" if "fp8" in r else "") + (
            f", attention {r['attention_also']['backend']}" if "attention_also" in r else "")
        lines.append(f"| {what}, {c['scope']} (first step {c['first_step_s']} s; {c['unique_graphs']} graphs, "
                     f"{c['graph_breaks']} breaks) | {c['step_s']} | {c['pass_s']} | "
                     f"{c['tflops']} | {mfu(c['mfu'])} | - |")
    lines.append("")
    lines.append(f"operations per step (from shapes): {r['flops_per_step'] / 1e15:.4g} PFLOP; per pass by term: "
                 + ", ".join(f"{k} {v / r['flops_per_pass'] * 100:.1f}%" for k, v in r["flops_terms"].items()))
    for name, row in r.get("linear_ms", {}).items():
        lines.append(f"one Linear {name} {row['shape']}: " + ", ".join(f"{k} {v} ms" for k, v in row["ms"].items()))
    if "flops_counted_per_pass" in r:
        lines.append(f"torch.utils.flop_counter, one pass: {r['flops_counted_per_pass'] / 1e15:.4g} PFLOP "
                     f"({r['flops_counted_vs_shapes']}x the count from shapes)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
