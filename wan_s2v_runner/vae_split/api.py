"""The split VAE's calls, as the generation loop uses them: :func:`split_encode`,
:func:`decode_bands`, :func:`own_band`, :func:`gather_bands`, :func:`split_decode`. Each is
collective over a process group, returns what the engine's ``Wan2_1_VAE`` returns bit for bit,
and falls back to the engine's own call without a group (or a group of one).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from .bands import frame_latent_rows
from .halo import Rows
from .layers import BandVAE, decoder_factor, encoder_factor


def _split_world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@contextmanager
def _engine_autocast(vae) -> Iterator[None]:
    """What ``Wan2_1_VAE.encode``/``decode`` run under: ``torch.cuda.amp.autocast(dtype=vae.dtype)``
    (on CUDA with the fp32 VAE this overrides the caller's bf16 autocast; off CUDA it is off)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        ctx = torch.amp.autocast("cuda", dtype=vae.dtype)
    with ctx:
        yield


def _unsplit(result: list, group, dst: Optional[int]) -> Optional[list]:
    """``result`` where it is returned (``dst``, or every rank for None), else None."""
    if dst is None or not dist.is_initialized() or dist.get_rank(group) == dst:
        return result
    return None


def _split_call(vae, inputs: Sequence[torch.Tensor], group, in_factor: int, compute,
                height: Optional[int] = None) -> list[tuple[Rows, torch.Tensor]]:
    """Each input's row band (``in_factor`` input rows per latent row) through
    ``compute(band_vae, band)``: per input, its ``Rows`` and this rank's output band. The inputs
    are whole frames, or (``height``) this rank's bands of frames ``height`` rows tall."""
    world = _split_world(group)
    out = []
    with _engine_autocast(vae):
        for u in inputs:
            rows = Rows(group, frame_latent_rows(height or u.shape[-2], in_factor, world), u.device)
            band = u.unsqueeze(0) if height else rows.own(u.unsqueeze(0), in_factor)
            if height:
                assert band.shape[-2] == (rows.stop - rows.start) * in_factor, (band.shape, rows.bands)
            out.append((rows, compute(BandVAE(vae.model, rows), band).squeeze(0)))
    return out


def _gathered(results: list[tuple[Rows, torch.Tensor]], group, dst: Optional[int]) -> Optional[list]:
    return _unsplit([rows.gather_to(band, dst) for rows, band in results], group, dst)


@torch.no_grad()
def split_encode(vae, videos: Sequence[torch.Tensor], group=None, dst: Optional[int] = 0,
                 height: Optional[int] = None) -> Optional[list[torch.Tensor]]:
    """``vae.encode(videos)`` (a ``Wan2_1_VAE``; each video ``[C, T, H, W]``, H a multiple of 8,
    given in full on every rank of ``group``), computed in row bands over the group's ranks.
    Collective: every rank of ``group`` (default: the world) calls it with the same inputs.
    With ``height``, each rank gives only its own rows of videos ``height`` rows tall (what
    ``own_band`` or ``decode_bands`` hold): nobody needs the whole video.

    Returns the engine's list of latents on group rank ``dst`` (None on the others), or on every
    rank for ``dst=None``. Bit-identical to the engine on CPU (see the module docstring). Needs at
    most one rank per latent row. A process without a process group (or a group of one) runs the
    engine's own ``vae.encode``.
    """
    if _split_world(group) == 1:
        return _unsplit(vae.encode(videos), group, dst)
    return _gathered(_split_call(vae, videos, group, encoder_factor(vae),
                                 lambda band_vae, band: band_vae.encode(band, vae.scale).float(), height),
                     group, dst)


def _decode_results(vae, zs, group) -> list[tuple[Rows, torch.Tensor]]:
    factor = decoder_factor(vae.model)

    def decode(band_vae, band):
        x = band_vae.decode(band, vae.scale).float().clamp_(-1, 1)
        rows = band_vae.rows
        assert x.shape[-2] == (rows.stop - rows.start) * factor
        return x

    return _split_call(vae, zs, group, 1, decode)


@torch.no_grad()
def decode_bands(vae, zs: Sequence[torch.Tensor], group=None) -> list[torch.Tensor]:
    """``vae.decode(zs)`` (each latent ``[16, T, h, w]``, given in full on every rank of
    ``group``), computed in row bands over the group's ranks; each rank gets its own rows of each
    decoded video (``own_band`` of what ``vae.decode`` returns; all of it without a split).
    Collective like ``split_encode``; ``gather_bands`` assembles the whole videos."""
    if _split_world(group) == 1:
        return vae.decode(zs)
    return [band for _, band in _decode_results(vae, zs, group)]


def own_band(vae, x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's rows (dim -2) of a whole frame at pixel resolution: the band ``split_encode``
    computes from, and ``decode_bands`` returns (``x`` itself without a split)."""
    world = _split_world(group)
    if world == 1:
        return x
    factor = encoder_factor(vae)
    return Rows(group, frame_latent_rows(x.shape[-2], factor, world), x.device).own(x, factor)


def gather_bands(vae, bands: Sequence[torch.Tensor], height: int, group=None,
                 dst: Optional[int] = 0) -> Optional[list[torch.Tensor]]:
    """The whole videos (``height`` rows) from every rank's ``bands`` (pixel resolution), on group
    rank ``dst`` (None on the others), or on every rank for ``dst=None``. Collective."""
    world = _split_world(group)
    if world == 1:
        return _unsplit(list(bands), group, dst)
    factor = encoder_factor(vae)
    results = [(Rows(group, frame_latent_rows(height, factor, world), b.device), b) for b in bands]
    return _gathered(results, group, dst)


@torch.no_grad()
def split_decode(vae, zs: Sequence[torch.Tensor], group=None,
                 dst: Optional[int] = 0) -> Optional[list[torch.Tensor]]:
    """``vae.decode(zs)`` computed in row bands over the group's ranks (``decode_bands``) and
    gathered like ``split_encode``'s result."""
    if _split_world(group) == 1:
        return _unsplit(vae.decode(zs), group, dst)
    return _gathered(_decode_results(vae, zs, group), group, dst)
