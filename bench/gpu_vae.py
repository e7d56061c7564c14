"""The split VAE on a CUDA GPU (issue #13): how far a band is from the whole frame, per-rank peak
memory and time at the real S2V size. Results go to docs/gpu.md.

Needs only torch, einops and the engine's ``wan/modules/vae2_1.py`` (the VAE is built at its real
width, 96, with seeded random weights: no checkpoint). ``wan``'s package ``__init__`` is not run
(it imports the whole engine and its dependencies); the VAE module is loaded on its own.

    python bench/gpu_vae.py --wan-dir DIR [--nproc 3] [--out DIR]

``DIR`` holds the ``wan`` package. Every rank runs on ``cuda:0`` (one GPU is enough: the exchange
goes over gloo, staged through the CPU as the split does for gloo with CUDA tensors); so the split's
*time* here is the ranks' GPU time-shared, not a speed-up: the per-band cost is measured by the
unsplit VAE on a band-sized frame, alone on the GPU. What it prints:

1. exactness: split (2 and 3 ranks) vs unsplit on CUDA at 256x448, under the default settings
   (cuDNN may use TF32 for fp32 convs), with TF32 off, and TF32 off + deterministic algorithms;
   and unsplit CUDA vs unsplit CPU fp32 for scale;
2. the real size (704x1024, a 73-frame motion re-encode and a 39-latent-frame clip decode): per
   rank peak memory and time, unsplit vs split at 2 and 3 ranks, and the band-sized unsplit proxy.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_vae_module(wan_dir: Path):
    """``wan.modules.vae2_1`` without running ``wan/__init__`` (bare parent packages)."""
    for name, sub in (("wan", ""), ("wan.modules", "modules")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(wan_dir / "wan" / sub) if sub else str(wan_dir / "wan")]
            sys.modules[name] = pkg
    spec = importlib.util.spec_from_file_location("wan.modules.vae2_1", wan_dir / "wan" / "modules" / "vae2_1.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["wan.modules.vae2_1"] = mod
    spec.loader.exec_module(mod)
    return mod


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from wan_s2v_runner.vae_split import split_decode, split_encode

    eng = load_vae_module(Path(a.wan_dir))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    log = []

    def say(*parts):
        if rank == 0:
            line = " ".join(str(p) for p in parts)
            print(line, flush=True)
            log.append(line)

    # the real VAE, seeded random weights; every rank the same
    torch.manual_seed(0)
    cfg = dict(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
               temperal_downsample=[False, True, True], dropout=0.0)
    model = eng.WanVAE_(**cfg)
    pth = Path(a.tmp) / f"vae_rank{rank}.pth"
    torch.save(model.state_dict(), pth)
    vae = eng.Wan2_1_VAE(vae_pth=str(pth), device=a.device)
    say(
        f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
        f"{torch.cuda.get_device_name(0) if cuda else 'CPU'}, {world} ranks on one device, gloo; "
        f"VAE width {vae.model.dim} "
        f"({sum(p.numel() for p in vae.model.parameters()) / 1e6:.0f}M params)"
    )
    groups = {n: dist.new_group(list(range(n))) for n in (2, 3) if n <= world}  # every rank creates each
    results: dict = {"setup": log}

    def diff(got, ref):
        d = (got - ref).abs()
        return {"max_abs": float(d.max()), "frac_differ": float((d > 0).float().mean()),
                "ref_absmax": float(ref.abs().max()), "equal": bool(torch.equal(got, ref)),
                # a decode of random weights could clamp to +-1 almost everywhere and compare nothing
                "frac_unclamped": float((ref.abs() < 1).float().mean())}

    # ---- 1. exactness
    g = torch.Generator().manual_seed(11)
    h, w = a.exact_height, a.exact_width
    video = (torch.rand(3, 9, h, w, generator=g) * 2 - 1)
    z = torch.randn(16, 3, h // 8, w // 8, generator=g)
    exact = {}
    defaults = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    settings = {"default": (None, False), "no-tf32": (False, False), "no-tf32+deterministic": (False, True),
                "default+deterministic": (None, True)}
    for name in a.settings.split(","):
        tf32, deterministic = settings[name]
        torch.backends.cudnn.allow_tf32 = defaults[0] if tf32 is None else tf32
        torch.backends.cuda.matmul.allow_tf32 = defaults[1] if tf32 is None else tf32
        torch.backends.cudnn.deterministic = deterministic
        with torch.no_grad():
            ref_e = vae.encode([video.to(dev)])[0]
            ref_d = vae.decode([z.to(dev)])[0]
            row = {"cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}
            for n, grp in groups.items():
                e = split_encode(vae, [video.to(dev)], group=grp, dst=None) if rank < n else None
                d = split_decode(vae, [z.to(dev)], group=grp, dst=None) if rank < n else None
                dist.barrier()
                if rank == 0:
                    row[f"encode {n} ranks"] = diff(e[0], ref_e)
                    row[f"decode {n} ranks"] = diff(d[0], ref_d)
            if rank == 0 and name == "no-tf32" and cuda and not a.exact_only:
                cpu = eng.Wan2_1_VAE(vae_pth=str(pth), device="cpu")
                row["unsplit CUDA vs CPU fp32: encode"] = diff(ref_e.cpu(), cpu.encode([video])[0])
                row["unsplit CUDA vs CPU fp32: decode"] = diff(ref_d.cpu(), cpu.decode([z])[0])
                del cpu
        exact[name] = row
        say(f"exactness [{name}]:", json.dumps(row))
    results["exactness"] = exact
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = defaults
    torch.backends.cudnn.deterministic = False

    def finish(name: str) -> None:  # results to OUT/name (rank 0), then leave together
        if rank == 0 and a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            Path(a.out, name).write_text(json.dumps(results, indent=1))
        dist.barrier()
        dist.destroy_process_group()

    if a.exact_only:
        return finish("gpu_vae_exact.json")

    # ---- 2. the real size
    H, W = a.height, a.width
    calls = {
        "motion re-encode (73 frames)": ("encode", lambda: torch.zeros(3, 73, H, W).uniform_(-1, 1)),
        f"clip decode ({a.decode_frames} latent frames)": (
            "decode",
            lambda: torch.randn(16, a.decode_frames, H // 8, W // 8),
        ),
    }
    real = {}
    for label, (kind, make) in calls.items():
        torch.manual_seed(5)
        x = make().to(dev)
        plain = vae.encode if kind == "encode" else vae.decode
        split = split_encode if kind == "encode" else split_decode
        row = {}

        def timed(fn):
            if not cuda:
                t0 = time.perf_counter()
                out = fn()
                return out, time.perf_counter() - t0, 0.0
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            return out, time.perf_counter() - t0, (torch.cuda.max_memory_allocated() - base) / 2**30

        with torch.no_grad():
            ref = None
            dist.barrier()
            if rank == 0:
                plain([x[:, :2]])  # warm-up (cuDNN handles, allocator)
                ref, t, peak = timed(lambda: plain([x])[0])  # noqa: B023
                row["unsplit 1 rank"] = {"s": round(t, 2), "peak_GiB": round(peak, 2)}
                per_latent = 8 if kind == "encode" else 1  # input rows per latent row
                for parts in (2, 3):
                    band = -(-(H // 8) // parts)  # the tallest band, latent rows
                    _, t, peak = timed(lambda: plain([x[..., :band * per_latent, :]])[0])  # noqa: B023
                    row[f"unsplit on a 1/{parts} band ({band * 8} rows), alone"] = {
                        "s": round(t, 2), "peak_GiB": round(peak, 2)}
            dist.barrier()
            for n, grp in groups.items():
                got, t, peak = timed(lambda: split(vae, [x], group=grp, dst=0)) if rank < n else (None, 0.0, 0.0)  # noqa: B023
                stats = [None] * world
                dist.all_gather_object(stats, (t, peak))
                if rank == 0:
                    row[f"split {n} ranks (GPU shared)"] = {
                        "s_max": round(max(s[0] for s in stats[:n]), 2),
                        "peak_GiB_per_rank": [round(s[1], 2) for s in stats[:n]],
                        "vs_unsplit": diff(got[0], ref)}
                del got
                dist.barrier()
        x = ref = None
        if cuda:
            torch.cuda.empty_cache()
        real[label] = row
        say(f"{label} at {W}x{H}:", json.dumps(row))
    results["real_size"] = real
    finish("gpu_vae.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wan-dir", required=True, help="the folder holding the `wan` package")
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--height", type=int, default=704)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--exact-height", type=int, default=256)
    ap.add_argument("--exact-width", type=int, default=448)
    ap.add_argument("--settings", default="default,no-tf32,no-tf32+deterministic",
                    help="exactness settings, comma-separated: default, no-tf32, no-tf32+deterministic, "
                         "default+deterministic")
    ap.add_argument("--exact-only", action="store_true", help="only the exactness part")
    ap.add_argument("--decode-frames", type=int, default=39, help="19 motion + 20 clip latent frames")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(Path(__file__).resolve()),
            "--worker", "--wan-dir", str(a.wan_dir), "--height", str(a.height), "--width", str(a.width),
            "--decode-frames", str(a.decode_frames), "--tmp", a.tmp, "--device", a.device,
            "--exact-height", str(a.exact_height), "--exact-width", str(a.exact_width),
            "--settings", a.settings] + (["--exact-only"] if a.exact_only else []) \
        + (["--out", a.out] if a.out else [])
    return subprocess.run(argv, cwd=str(ROOT)).returncode


if __name__ == "__main__":
    sys.exit(main())
