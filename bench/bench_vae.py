"""Benchmark for issue #13: the split VAE against the engine's unsplit VAE, isolated from the run.

The end-to-end bench (``bench_loop.py``) times the VAE stages inside whole runs, where they share
the machine with loading, the other rank's work and each other; this one times only the VAE calls
the loop makes, with the compute preset's VAE (the bench checkpoint's weights, 256x256):

* reference encode: the 73-frame initial-motion video (zeros, as the loop encodes it), 1 + 4k
  frame chunks;
* clip decode: ``[motion latents | clip latents]`` (19 + 3 latent frames here, a clip's shape);

each ``--repeat`` times, alternating: the engine's own ``vae.encode``/``vae.decode`` on rank 0
while the other ranks wait at a barrier (the 1-rank cost), then ``split_encode``/``split_decode``
over all ranks (results on every rank, as the loop calls them). It prints the median seconds,
the ratio split / unsplit, and whether the split results equal the unsplit ones bit for bit.

    .venv/bin/python bench/bench_vae.py                 # 2 ranks, 3 repeats
    .venv/bin/python bench/bench_vae.py --nproc 3 --repeat 5

One torch thread per rank; a 2-rank run wants 2 idle cores.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from patches import checkpoint_dims
    from wan_s2v_runner.loading.engine import import_wan
    wan = import_wan()
    checkpoint_dims.apply(wan)  # the VAE width comes from the file, as in a run
    from wan.modules.vae2_1 import Wan2_1_VAE

    from wan_s2v_runner.vae_split import split_decode, split_encode

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    vae = Wan2_1_VAE(vae_pth=str(Path(a.ckpt) / "Wan2.1_VAE.pth"), device="cpu")  # as the engine builds it
    dim = vae.model.dim
    h, w = a.height, a.width
    video = torch.zeros(3, 73, h, w)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(16, 22, h // 8, w // 8, generator=g)
    work = {"ref encode (73 frames)": (vae.encode, split_encode, video),
            "clip decode (22 latent frames)": (vae.decode, split_decode, latents)}
    rows = {}
    with torch.no_grad():
        for name, (plain, split, x) in work.items():
            t_plain, t_split, exact = [], [], True
            for _ in range(a.repeat):
                dist.barrier()
                ref = None
                if rank == 0:
                    t0 = time.perf_counter()
                    ref = plain([x])[0]
                    t_plain.append(time.perf_counter() - t0)
                dist.barrier()
                t0 = time.perf_counter()
                got = split(vae, [x], dst=None)[0]
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's time
                t_split.append(float(took))
                if rank == 0:
                    exact = exact and torch.equal(got, ref)
            rows[name] = (statistics.median(t_plain) if t_plain else None, statistics.median(t_split), exact)
    if rank == 0:
        world = dist.get_world_size()
        print(f"| VAE call | unsplit s (1 rank) | split s (max of {world} ranks) | split x | bit-exact |")
        print("|---|---|---|---|---|")
        for name, (p, s, ex) in rows.items():
            print(f"| {name} | {p:.2f} | {s:.2f} | {s / p:.2f} | {'yes' if ex else 'NO'} |")
        print(f"\nVAE width {dim}, {w}x{h}, {world} ranks, gloo, 1 thread/rank, median of {a.repeat}; "
              f"torch {torch.__version__}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/wan-s2v/bench"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_loop import ensure_assets
    ckpt, _, _ = ensure_assets(a.cache, "compute")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
            str(Path(__file__).resolve()), "--worker", "--ckpt", str(ckpt), "--repeat", str(a.repeat),
            "--height", str(a.height), "--width", str(a.width)]
    return subprocess.run(argv, cwd=str(ROOT)).returncode


if __name__ == "__main__":
    sys.exit(main())
