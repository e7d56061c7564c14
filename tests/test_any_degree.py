"""Any Ulysses degree, exactly: real gloo ranks give one process's frames bit for bit (CPU, fp32)
where upstream cannot run at all.

The tiny DiT has 4 heads, and at 64x64 with 12 frames per clip the DiT sees 64 tokens on clip 1
and 88 on clip 2: at degree 3 the heads split 2/1/1 and both sequences are padded (to 66 and 90),
so upstream's even all-to-all and unpadded ``torch.chunk`` would abort inside gloo. Run twice:
Ulysses over 3 ranks (the VAE split in 3 bands of 3/3/2 latent rows), and CFG 2 x SP 3 over 6
ranks (the SP helpers bound to each CFG branch's group). Both with a pose video (``--pose-video``).
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_FLAGS, one_process_frames, run_frames

from wan_s2v_runner.preflight.geometry import token_counts
from wan_s2v_runner.shared.layout import Layout, Mode

#: 12 frames per clip: sequences of 64 and 88 tokens, neither a multiple of 3
FLAGS = [f if f != "8" else "12" for f in TINY_FLAGS]
assert FLAGS[FLAGS.index("--infer-frames") + 1] == "12"


def _run(tiny_assets, d, *extra):
    """Frames, run.json and the ranks' plan events of a run of FLAGS."""
    frames, run_dir = run_frames(tiny_assets, d, FLAGS, "--pose-video", str(tiny_assets.pose_video), *extra)
    plans = [json.loads(line) for p in sorted((run_dir / "events").glob("*.jsonl"))
             for line in p.read_text().splitlines() if '"kind": "plan"' in line]
    return frames, json.loads((run_dir / "run.json").read_text()), plans


@pytest.fixture(scope="module")
def frames_12(engine_cpu, tiny_assets):
    """One process's frames for FLAGS with the demo's pose video (in this process: the loop a
    --nproc 1 run's worker runs): the 3-rank run splits the pose encode in 3 bands, the 6-rank
    run encodes it on rank 0 and broadcasts it."""
    return one_process_frames(engine_cpu, infer_frames=12, pose_video=tiny_assets.pose_video)


def test_the_sizes_need_uneven_heads_and_padding():
    lengths = token_counts(64, 64, 12).lengths(2, False)
    lay = Layout.for_mode(Mode.ULYSSES, 3)
    assert lengths == [64, 88] and [lay.padding(n) for n in lengths] == [2, 2]
    assert lay.head_split(4) == [2, 1, 1]


@pytest.mark.parametrize("extra, cfg, sp", [
    (["--nproc", "3"], 1, 3),
    # the VAE on rank 0 (6 bands of 1-2 latent rows are slow on 2 cores; the 3-rank run splits it)
    # (one clip: the first clip's frames do not depend on the clips after it; 6 ranks on 2 cores are slow)
    (["--nproc", "6", "--cfg-parallel", "--no-vae-parallel", "--num-clips", "1"], 2, 3),
])
@pytest.mark.slow
def test_uneven_ulysses_equals_one_process(tiny_assets, frames_12, tmp_path, extra, cfg, sp):
    frames, manifest, plans = _run(tiny_assets, tmp_path / "sp", *extra)
    want = frames_12 if "--num-clips" not in extra else frames_12[:, :12 - 3]
    assert torch.equal(frames, want), f"max abs diff {(frames - want).abs().max()}"
    assert frames.shape == (3, (2 if want is frames_12 else 1) * 12 - 3, 64, 64)
    lay = manifest["layout"]
    assert (lay["cfg_degree"], lay["ulysses_degree"], lay["world_size"]) == (cfg, sp, cfg * sp)
    assert lay["vae_parallel"] == (cfg == 1)
    assert len(plans) == cfg * sp
    assert all("heads 2/1/1 per rank" in p["patches"]["ulysses_sp"] for p in plans)
