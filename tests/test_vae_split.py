"""wan_s2v_runner.vae_split: the row-band split of the engine's Wan2.1 VAE returns exactly what
``Wan2_1_VAE.encode``/``decode`` return (``torch.equal``, fp32, CPU), over real
``torch.distributed.run`` processes on gloo; and its conv primitive computes a band with the kernel
the whole-frame call would use."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from wan_s2v_runner import vae_split
from wan_s2v_runner.shared.ckpt_layout import VAE_FILE
from wan_s2v_runner.vae_split import band_rows, conv_rows

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("vae_split_worker.py")

# 56 rows = 7 latent rows: bands of 3/2/2 rows on 3 ranks, 4/3 on 2 (neither divides 7).
# 16 columns = 2 latent columns (and a non-square frame): band convs at latent resolution have
# 2..8 output pixels per image, under MKL's small-matrix threshold, so conv_rows' zero-row padding
# of gemm-backed convs is needed (without it the decode differs by ~2e-6).
# 9 frames: encode chunks of 1 + 4 + 4 frames -> 3 latent frames; the decode of 3 latent frames
# runs one frame at a time through the temporal caches (and the upsample3d 'Rep' first frame).
HEIGHT, WIDTH, FRAMES = 56, 16, 9
WORLD = 3  # the worker also splits over the subgroup of ranks 1..2: 2 bands in the same launch


def test_band_rows_as_even_as_possible():
    assert band_rows(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert band_rows(7, 2) == [(0, 4), (4, 7)]
    assert band_rows(5, 5) == [(i, i + 1) for i in range(5)]
    for rows in range(1, 20):
        for parts in range(1, rows + 1):
            sizes = [e - s for s, e in band_rows(rows, parts)]
            assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        band_rows(3, 4)


def _bands_equal_whole(conv, x, full, bands, pad_rows: int) -> None:
    """Each band's conv_rows output is the whole-frame output's rows, bit for bit. ``x`` is the
    whole input, its rows zero-padded by ``pad_rows`` (what the engine's padding adds)."""
    xp = F.pad(x, (0, 0, pad_rows, pad_rows))
    for s, e in bands:
        band = xp.narrow(-2, s, e - s + 2 * pad_rows)
        got = conv_rows(conv, band, x.shape[-2] + 2 * pad_rows, padding=[0] * (x.dim() - 2))
        assert torch.equal(got, full.narrow(-2, s, e - s)), (s, e)


def test_conv_rows_computes_a_band_with_the_whole_frame_kernel():
    """PyTorch picks a CPU conv kernel by input size: a batch-1 conv runs oneDNN only when
    N*C*D*H > 20480, so a band of this frame would run im2col + MKL sgemm (other bits)."""
    torch.manual_seed(0)
    with torch.no_grad():
        # the engine's CausalConv3d: explicit padding, then a padding-0 conv
        conv = nn.Conv3d(32, 32, 3)
        x = torch.randn(1, 32, 3, 240, 10)
        full = conv(F.pad(x, (0, 0, 1, 1)))
        band = F.pad(x, (0, 0, 1, 1))[..., :42, :]
        assert vae_split.convs._engine_backend(conv, band, 242, (0, 0, 0)) == "Mkldnn"
        assert torch._C._select_conv_backend(band, conv.weight, conv.bias, [1] * 3, [0] * 3, [1] * 3,
                                             False, [0] * 3, 1, None).name == "Slow3d"
        _bands_equal_whole(conv, x, full, [(0, 40), (40, 41), (41, 150), (150, 240)], 1)

        # gemm-backed on the whole frame too: 1-row bands have 5 output pixels (MKL small path)
        conv = nn.Conv3d(8, 8, 3)
        x = torch.randn(1, 8, 3, 20, 7)
        full = conv(F.pad(x, (0, 0, 1, 1)))
        _bands_equal_whole(conv, x, full, [(i, i + 1) for i in range(20)], 1)

        # the upsample's Conv2d: its own padding=1 (W kept in the call, H rows given as halo)
        conv = nn.Conv2d(8, 4, 3, padding=1)
        x = torch.randn(2, 8, 14, 12)
        full = conv(x)
        xp = F.pad(x, (0, 0, 1, 1))
        for s, e in [(0, 6), (6, 10), (10, 14)]:
            assert torch.equal(conv_rows(conv, xp[:, :, s:e + 2], 14), full[:, :, s:e])


@pytest.mark.slow
def test_split_encode_decode_equal_engine_bitwise(tiny_assets, tmp_path):
    vae_file = tiny_assets.ckpt_dir / VAE_FILE
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]]
                                                         if os.environ.get("PYTHONPATH") else [])))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(WORLD), str(WORKER), "--vae", str(vae_file),
                        "--out", str(tmp_path), "--height", str(HEIGHT), "--width", str(WIDTH),
                        "--frames", str(FRAMES)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    checked = set()
    for rep in reports:
        for call, res in rep.items():
            if isinstance(res, dict):
                assert res["ok"], (rep["rank"], call, res)
                if "max_abs_diff" in res:
                    checked.add(call)
                    assert res["unclamped"] > 0.9  # the decode is not clamped flat: values compared
    assert checked == {"encode/3", "decode/3", "encode/2", "decode/2", "encode/3/thin", "decode/3/thin",
                       "decode/3/band", "decode/3/gathered", "encode/3/from-bands", "encode/3/ungrouped",
                       "decode/3/ungrouped"}
