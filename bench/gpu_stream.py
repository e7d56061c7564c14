"""The streamed DiT (``--dit-offload blocks``, issue #57) against the resident DiT at real size, on
one GPU, under memory caps that emulate smaller cards.

The S2V-14B DiT is built from the engine's config with random bf16 weights on the GPU (as
``bench/gpu_step.py``), optionally quantized in place (``--dit-quant fp8``'s rule). Each case times
one CFG step (cond + uncond pass, ``autocast(bf16)``, a later clip's tokens) after a warm-up step:

1. resident: the whole DiT on the GPU, no cap (the baseline, same process);
2. streamed: ``loading.block_stream.attach`` moves the blocks to one pinned host buffer, then
   ``torch.cuda.set_per_process_memory_fraction`` caps the allocator at ``--cap`` GiB (a card of
   that size less its CUDA context and workspaces) and the same step runs with every block
   streamed; then with as many blocks resident as the measured peak leaves room for.

Printed and written (``--json``): seconds per step and the ratio to resident, the peak allocated
memory of each case, the bytes copied per step and the host-to-device bandwidth of one pinned
1 GiB copy. A case that runs out of memory under its cap is reported as such, not skipped.

    python bench/gpu_stream.py --cases fp8:1024*704:23,bf16:1024*704:23,fp8:832*480:15 --json s.json
    python bench/gpu_stream.py --device cpu --preset small --cases fp8:256*256:0 --infer-frames 8  # smoke
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_step import PRESETS, sync, timed  # noqa: E402


def step_fn(model, x, t, cond, uncond, device, dtype):
    import torch

    def step():
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            c = model(x, t=t, **cond)
            u = model(x, t=t, **uncond)
            return [u_ + 4.5 * (c_ - u_) for c_, u_ in zip(c, u)]
    return step


def h2d_gbps(device) -> float:
    """GB/s of one 1 GiB copy from pinned host memory to the device (median of 3)."""
    import statistics

    import torch
    if device.type != "cuda":
        return 0.0
    src = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(2**30, dtype=torch.uint8, device=device)
    times = [timed(lambda: dst.copy_(src, non_blocking=True), device) for _ in range(3)]
    return round(2**30 / statistics.median(times) / 1e9, 2)


def one_case(wan, a, quant: str, size: str, cap_gib: float, device, dtype) -> dict:
    import torch

    from wan_s2v_runner.demo.random_weights import dit_kwargs, random_dit, random_dit_inputs
    from wan_s2v_runner.loading import block_stream
    from wan_s2v_runner.loading.quantize import quantize_loaded
    from wan_s2v_runner.preflight.geometry import token_counts
    from wan_s2v_runner.shared.spec import size_pair

    w, h = size_pair(size)
    cuda = device.type == "cuda"
    out: dict = {"dit": quant, "size": size, "cap_gib": cap_gib}
    t0 = time.perf_counter()
    model, _ = random_dit(wan, device, dtype, **PRESETS[a.preset])
    if quant == "fp8":
        out["fp8_linears"] = len(quantize_loaded(model))
    cfg = dit_kwargs(wan, **PRESETS[a.preset])
    tokens = token_counts(h, w, a.infer_frames)
    x, t, cond, uncond = random_dit_inputs(int(cfg["audio_dim"]), int(cfg["motion_frames"]), tokens, a.infer_frames,
                                           device, dtype, False)
    out["tokens"] = tokens.max_len
    out["weights_gib"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 2)
    out["build_s"] = round(time.perf_counter() - t0, 1)
    step = step_fn(model, x, t, cond, uncond, device, dtype)

    streaming: list = [None]  # the streamer attached to the model, if any

    def measure(name: str, warmup: int = 1) -> dict:
        row: dict = {}
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        s = streaming[0]
        try:
            for _ in range(warmup):
                timed(step, device)
            copied1 = s.bytes_copied if s else 0
            row["step_s"] = round(timed(step, device), 3)
            if s:
                row["gib_copied_per_step"] = round((s.bytes_copied - copied1) / 2**30, 2)
        except torch.OutOfMemoryError as e:
            row["out_of_memory"] = str(e).splitlines()[0][:200]
        if cuda:
            row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        print(f"  {quant} {size} {name}: {row}", flush=True)
        return row

    # the output of one conditional pass, resident, to compare the streamed pass with
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=cuda):
        ref = torch.stack(list(model(x, t=t, **cond))).float()
    out["resident"] = measure("resident")
    t0 = time.perf_counter()
    s = streaming[0] = block_stream.attach(model, device, 0)
    out["attach_s"] = round(time.perf_counter() - t0, 1)
    out["stream"] = s.describe()
    if cuda and cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, device)
    ref = ref.cpu()
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=cuda):
            got = torch.stack(list(model(x, t=t, **cond))).float().cpu()
        out["streamed_pass_equal"] = bool(torch.equal(got, ref))
        out["streamed_pass_max_abs"] = float((got - ref).abs().max())
        del got
    except torch.OutOfMemoryError as e:
        out["streamed_pass_equal"] = "out of memory: " + str(e).splitlines()[0][:160]
    del ref
    out["streamed"] = measure("streamed, every block")
    if "step_s" in out["streamed"] and "step_s" in out["resident"]:
        out["streamed"]["vs_resident"] = round(out["streamed"]["step_s"] / out["resident"]["step_s"], 3)
    peak = out["streamed"].get("peak_allocated_gib")
    if cuda and cap_gib and peak and a.resident_too:
        unit = max(block_stream.unit_bytes(model)) / 2**30
        k = max(0, int((cap_gib - peak - 0.5) / unit))
        if k:
            s.detach()
            streaming[0] = block_stream.attach(model, device, k)
            row = measure(f"streamed, {k} resident", warmup=1)
            row["resident_blocks"] = k
            if "step_s" in row and "step_s" in out["resident"]:
                row["vs_resident"] = round(row["step_s"] / out["resident"]["step_s"], 3)
            out["streamed_some_resident"] = row
    streaming[0].detach()
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    sync(device)
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--preset", default="real", choices=sorted(PRESETS))
    ap.add_argument("--cases", default="fp8:1024*704:23,bf16:1024*704:23,fp8:832*480:15",
                    help="DIT:SIZE:CAP_GIB, comma-separated, in order (DIT fp8 or bf16; CAP 0: no cap)")
    ap.add_argument("--infer-frames", type=int, default=80)
    ap.add_argument("--resident-too", action="store_true",
                    help="after the all-streamed step, one with as many blocks resident as its peak leaves room for")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    import torch

    from patches import attention
    from wan_s2v_runner.loading.engine import import_wan
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    wan = import_wan()
    backend, reason = attention.resolve_backend("auto", device.type)
    attention.apply(wan, backend)
    torch.manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "attention": backend, "h2d_gbps_pinned_1gib": h2d_gbps(device),
                 "cases": []}
    print(f"{res['device']}: pinned H2D {res['h2d_gbps_pinned_1gib']} GB/s, attention {backend}", flush=True)
    for spec in a.cases.split(","):
        quant, size, cap = spec.split(":")
        res["cases"].append(one_case(wan, a, "fp8" if quant == "fp8" else "bf16", size, float(cap), device, dtype))
        if a.json:
            a.json.write_text(json.dumps(res, indent=2) + "\n")
    print(render(res))
    return res


def _cell(row: dict) -> str:
    peak = row.get("peak_allocated_gib", "-")
    return f"{row['step_s']} ({peak})" if "step_s" in row else f"OOM ({peak})"


def render(r: dict) -> str:
    lines = [f"{r['device']} (torch {r['torch']}, attention {r['attention']}); "
             f"pinned H2D {r['h2d_gbps_pinned_1gib']} GB/s", "",
             "| DiT, size, cap | resident s/step (peak GiB) | streamed s/step (peak GiB) | x resident | "
             "GiB copied/step | some resident |", "|---|---|---|---|---|---|"]
    for c in r["cases"]:
        res, st, some = c["resident"], c["streamed"], c.get("streamed_some_resident", {})
        some_cell = (f"{some.get('resident_blocks')} blocks: {_cell(some)}, {some.get('vs_resident', '-')}x"
                     if some else "-")
        lines.append(f"| {c['dit']} {c['size']} {c['cap_gib']} GiB | {_cell(res)} | {_cell(st)} | "
                     f"{st.get('vs_resident', '-')} | {st.get('gib_copied_per_step', '-')} | {some_cell} |")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
