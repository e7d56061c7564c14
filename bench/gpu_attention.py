"""One attention call at S2V's real shapes, per backend: milliseconds, TFLOP/s and the distance from an
fp32 reference (issue #60: FA4 against SDPA's cuDNN kernel).

The calls are the runner's own (``patches.attention``'s ``sdpa_attention``, ``fa4_attention``, ...,
exactly what the DiT calls through the engine's ``flash_attention``), on the inputs the DiT gives
them under the loop's bf16 autocast: the self-attention of a later clip at 1024x704 (q, k, v
[1, 63360, 40, 128], bf16) and the text cross-attention (k, v [1, 512, 40, 128]). Each backend's
output on the first ``--ref-queries`` queries is compared with the same attention in float32
(SDPA's math kernel): max and mean absolute error, so both bf16 kernels are held to one reference.
With ``--compile-check`` it also compiles a small function around the backend with
``fullgraph=True`` (a graph break is an error) and reports the graphs: the custom op keeps the
kernel opaque to the compiler.

    python bench/gpu_attention.py --backends sdpa,fa4 --json attention.json
    python bench/gpu_attention.py --device cpu --tokens 2048 --backends sdpa   # smoke test
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


def timed_ms(fn, device, repeat: int) -> float:
    import torch

    def one():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3

    return statistics.median(one() for _ in range(repeat))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backends", default="sdpa,fa4", help="comma-separated (sdpa, fa4, fa3, fa2)")
    ap.add_argument("--tokens", type=int, default=63360, help="self-attention length (a later clip at 1024x704)")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--ref-queries", type=int, default=256, help="queries compared with the fp32 reference")
    ap.add_argument("--compile-check", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from patches import attention
    from wan_s2v_runner.loading.engine import import_wan

    import_wan()  # the engine's modules, as the run has them (the backends call through them)
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    n, d = a.heads, a.head_dim
    shapes = {"self": (rnd(1, a.tokens, n, d), rnd(1, a.tokens, n, d), rnd(1, a.tokens, n, d)),
              "cross": (rnd(1, a.tokens, n, d), rnd(1, a.text_len, n, d), rnd(1, a.text_len, n, d))}
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": str(dtype).replace("torch.", ""),
                 "shapes": {k: [list(t.shape) for t in v] for k, v in shapes.items()}, "backends": {}}
    refs = {}
    for name, (q, k, v) in shapes.items():
        m = min(a.ref_queries, q.shape[1])
        qt, kt, vt = (t.float().transpose(1, 2) for t in (q[:, :m], k, v))
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            refs[name] = F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
    for backend in a.backends.split(","):
        fn = attention.IMPLEMENTATIONS[backend]
        row: dict = {}
        try:
            for name, (q, k, v) in shapes.items():
                t0 = time.perf_counter()
                got = fn(q, k, v)  # FA4: the first call compiles its kernel
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                first_s = time.perf_counter() - t0
                ms = timed_ms(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), device, a.repeat)
                flops = 4 * q.shape[1] * k.shape[1] * n * d
                diff = (got[:, :refs[name].shape[1]].float() - refs[name]).abs()
                row[name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
                             "first_call_s": round(first_s, 2), "vs_fp32_max_abs": float(diff.max()),
                             "vs_fp32_mean_abs": float(diff.mean())}
                print(f"{backend} {name}: {ms:.3f} ms ({row[name]['tflops']} TFLOP/s; first call {first_s:.1f} s); "
                      f"vs fp32: max {row[name]['vs_fp32_max_abs']:.3g}, mean {row[name]['vs_fp32_mean_abs']:.3g}",
                      flush=True)
            if a.compile_check:
                from torch._dynamo.utils import counters
                counters.clear()
                small = tuple(t[:, :4096] for t in shapes["self"])

                def block(q, k, v, fn=fn):
                    return fn(q * 1.0, k, v).float().sum(-1)

                got = torch.compile(block, fullgraph=True, dynamic=False)(*small)
                want = block(*small)
                row["compile"] = {"unique_graphs": int(counters["stats"]["unique_graphs"]),
                                  "graph_breaks": int(sum(counters["graph_break"].values())),
                                  "max_abs_vs_eager": float((got - want).abs().max())}
                print(f"{backend} compiled (fullgraph): {row['compile']}", flush=True)
        except Exception as e:  # noqa: BLE001 - a backend that fails is the finding; the others go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"{backend}: {row['error']}", flush=True)
        out["backends"][backend] = row
        if a.json:
            a.json.write_text(json.dumps(out, indent=2) + "\n")
    base = out["backends"].get("sdpa", {})
    for backend, row in out["backends"].items():
        for name in shapes:
            if backend != "sdpa" and name in row and name in base:
                row[name]["vs_sdpa_time"] = round(row[name]["ms"] / base[name]["ms"], 3)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
