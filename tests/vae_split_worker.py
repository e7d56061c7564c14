"""torchrun worker for tests/test_vae_split.py: ``split_encode``/``split_decode`` against the
engine's ``Wan2_1_VAE.encode``/``decode`` on the same seeded inputs, over gloo on CPU.

Two splits per launch: over the whole world (encode gathered on the last rank, decode on all;
and as the generation loop calls it: decode kept in bands and gathered on rank 0, encode from
each rank's band), and over the subgroup of ranks 1..world-1 (group ranks differ from global ranks there; encode
on all its ranks, decode gathered on its rank 0 = global rank 1). Every rank computes the
unsplit reference itself (the tiny VAE is cheap) and writes ``OUT/rank{r}.json``: per call,
whether its result is ``torch.equal`` to the reference (or, off the destination rank, whether it
returned None), the max abs difference and the shapes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def compare(got, ref, expect_result: bool) -> dict:
    """What the test asserts about one call's result on this rank."""
    if not expect_result:
        return {"ok": got is None, "got": None if got is None else "a result off the destination rank"}
    if got is None or len(got) != len(ref):
        return {"ok": False, "got": repr(got)[:200]}
    diffs = [(g - r).abs().max().item() if g.shape == r.shape else float("inf") for g, r in zip(got, ref)]
    return {"ok": all(torch.equal(g, r) for g, r in zip(got, ref)), "max_abs_diff": max(diffs),
            "shapes": [list(g.shape) for g in got], "ref_shapes": [list(r.shape) for r in ref],
            # a decode of random latents could clamp to +-1 almost everywhere and compare nothing
            "unclamped": min(float((r.abs() < 1).float().mean()) for r in ref)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vae", required=True, help="a Wan2.1 VAE state dict (the tiny checkpoint's)")
    p.add_argument("--out", required=True)
    p.add_argument("--height", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--frames", type=int, required=True, help="pixel frames to encode (1 + 4k)")
    a = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from patches import checkpoint_dims
    from wan_s2v_runner import vae_split
    from wan_s2v_runner.loading.engine import import_wan
    from wan_s2v_runner.vae_split import decode_bands, gather_bands, own_band, split_decode, split_encode

    wan = import_wan()
    checkpoint_dims.apply(wan)
    vae = wan.modules.vae2_1.Wan2_1_VAE(vae_pth=a.vae, device="cpu")
    g = torch.Generator().manual_seed(11)
    videos = [torch.rand(3, a.frames, a.height, a.width, generator=g) * 2 - 1]
    zs = [torch.randn(16, 1 + (a.frames - 1) // 4, a.height // 8, a.width // 8, generator=g)]
    with torch.no_grad():
        ref_enc, ref_dec = vae.encode(videos), vae.decode(zs)
    last = world - 1
    report = {
        "rank": rank, "world": world,
        f"encode/{world}": compare(split_encode(vae, videos, dst=last), ref_enc, rank == last),
        f"decode/{world}": compare(split_decode(vae, zs, dst=None), ref_dec, True),
    }
    # the loop's way: each rank keeps its rows of the decode, gathered whole on rank 0 only,
    # and encodes from its rows alone
    bands = decode_bands(vae, zs)
    report[f"decode/{world}/band"] = compare(bands, [own_band(vae, r) for r in ref_dec], True)
    report[f"decode/{world}/gathered"] = compare(gather_bands(vae, bands, a.height, dst=0), ref_dec, rank == 0)
    report[f"encode/{world}/from-bands"] = compare(
        split_encode(vae, [own_band(vae, v) for v in videos], dst=None, height=a.height), ref_enc, True)
    # one latent row per rank: bands too thin for a residual block's 2-row exchange at latent
    # resolution (a halo per conv there), thick enough above it (one exchange per block)
    thin_v = [torch.rand(3, 5, 8 * world, 96, generator=g) * 2 - 1]
    thin_z = [torch.randn(16, 2, world, 12, generator=g)]
    with torch.no_grad():
        ref_thin_enc, ref_thin_dec = vae.encode(thin_v), vae.decode(thin_z)
    report[f"encode/{world}/thin"] = compare(split_encode(vae, thin_v, dst=None), ref_thin_enc, True)
    report[f"decode/{world}/thin"] = compare(split_decode(vae, thin_z, dst=None), ref_thin_dec, True)
    # chunks one at a time through the layers (what real frame sizes do: GROUP_BYTES); the calls
    # above run each video's chunks through every layer together
    group_bytes, vae_split.layers.GROUP_BYTES = vae_split.layers.GROUP_BYTES, 0
    report[f"encode/{world}/ungrouped"] = compare(split_encode(vae, videos, dst=None), ref_enc, True)
    report[f"decode/{world}/ungrouped"] = compare(split_decode(vae, zs, dst=None), ref_dec, True)
    vae_split.layers.GROUP_BYTES = group_bytes
    sub = dist.new_group(list(range(1, world)))  # every rank takes part in creating it
    if rank >= 1:
        report[f"encode/{world - 1}"] = compare(split_encode(vae, videos, group=sub, dst=None),
                                                ref_enc, True)
        report[f"decode/{world - 1}"] = compare(split_decode(vae, zs, group=sub, dst=0),
                                                ref_dec, rank == 1)
    Path(a.out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    # every rank tears down after the last transfer of every other (rank 0, outside ``sub``, is
    # otherwise done first; the generation loop ends with a barrier too): once in a full suite,
    # rank 0 aborted in gloo's teardown ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
