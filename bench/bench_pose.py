"""Benchmark for issue #28: a clip's pose condition (``--pose-video``) at N ranks against 1.

Times what the loop does per clip with a pose video (``wan_s2v_runner.rank.pose.PoseCondition``:
read the clip's frames from the video, scale, resize, centre-crop, pad, VAE-encode), with the
compute preset's VAE (the bench checkpoint's weights) at 256x256, from a synthetic 320x256 pose
video at 25 fps (every 2nd frame read), ``--infer-frames`` frames per clip:

* 1 rank: rank 0 alone with the engine's ``vae.encode`` (what one process, or ``--no-vae-parallel``
  does; upstream does it on every rank) while the other ranks wait at a barrier;
* split: every rank reads the frames, keeps its own rows, and the encode is split by rows
  (``split_encode``; the whole latents on every rank, as the loop calls it).

Alternating, ``--repeat`` times; it prints the median seconds (the slowest rank's for the split),
the ratio, and whether the split latents equal the 1-rank latents bit for bit.

    .venv/bin/python bench/bench_pose.py                 # 2 ranks, 3 repeats, 80 frames per clip
    .venv/bin/python bench/bench_pose.py --nproc 2 --repeat 5

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
    checkpoint_dims.apply(wan)
    from wan.modules.vae2_1 import Wan2_1_VAE

    from wan_s2v_runner.rank.pose import PoseCondition
    from wan_s2v_runner.vae_split import own_band, split_encode

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vae = Wan2_1_VAE(vae_pth=str(Path(a.ckpt) / "Wan2.1_VAE.pth"), device="cpu")
    size, cpu = (a.height, a.width), torch.device("cpu")

    def one_rank():
        return PoseCondition(a.video, size, a.infer_frames, 1, torch.float32, cpu, band=lambda x: x,
                             encode=lambda px: torch.stack(vae.encode(px)))

    def split():
        return PoseCondition(a.video, size, a.infer_frames, 1, torch.float32, cpu, band=lambda x: own_band(vae, x),
                             encode=lambda px: torch.stack(split_encode(vae, px, dst=None, height=a.height)))

    t_one, t_split, exact = [], [], True
    with torch.no_grad():
        for _ in range(a.repeat):
            dist.barrier()
            ref = None
            if rank == 0:
                t0 = time.perf_counter()
                pose = one_rank()
                ref = pose.latents(0)
                pose.close()
                t_one.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            pose = split()
            got = pose.latents(0)
            pose.close()
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            t_split.append(float(took))
            if rank == 0:
                exact = exact and torch.equal(got, ref)
    if rank == 0:
        one, sp = statistics.median(t_one), statistics.median(t_split)
        print(f"| pose condition of one clip | 1 rank s | split s (max of {world} ranks) | split x | bit-exact |")
        print("|---|---|---|---|---|")
        print(f"| {a.infer_frames} + 1 frames -> {tuple(ref.shape)} latents | {one:.2f} | {sp:.2f} | {sp / one:.2f} "
              f"| {'yes' if exact else 'NO'} |")
        print(f"\nVAE width {vae.model.dim}, {a.width}x{a.height} from a 320x256 25 fps video, {world} ranks, gloo, "
              f"1 thread/rank, median of {a.repeat}; torch {torch.__version__}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--infer-frames", type=int, default=80)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/wan-s2v/bench"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--video", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_loop import ensure_assets

    from wan_s2v_runner.demo.synthetic_inputs import make_pose_video
    ckpt, _, _ = ensure_assets(a.cache, "compute")
    video = a.cache.expanduser() / "compute" / f"pose-320x256-{2 * a.infer_frames}f.mp4"
    if not video.is_file():
        make_pose_video(video, width=320, height=256, frames=2 * a.infer_frames, fps=25.0)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
            str(Path(__file__).resolve()), "--worker", "--ckpt", str(ckpt), "--video", str(video),
            "--repeat", str(a.repeat), "--infer-frames", str(a.infer_frames), "--height", str(a.height),
            "--width", str(a.width)]
    return subprocess.run(argv, cwd=str(ROOT)).returncode


if __name__ == "__main__":
    sys.exit(main())
