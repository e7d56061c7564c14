"""Band bookkeeping of the split VAE: which latent rows each rank of a group owns
(:func:`band_rows`), and a band tensor's geometry at any resolution (:class:`Band`: rows per
latent row, the whole frame's rows, this rank's rows of a whole frame, the zeros past the frame's
edges). Nothing here communicates; :class:`~.halo.Rows` adds the exchanges.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def band_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` bands ``(start, stop)`` covering ``range(rows)``, sizes as even as possible
    (the first ``rows % parts`` bands one row taller). Needs ``1 <= parts <= rows``."""
    if not 1 <= parts <= rows:
        raise ValueError(f"cannot split {rows} rows into {parts} non-empty bands")
    q, r = divmod(rows, parts)
    stops = [(i + 1) * q + min(i + 1, r) for i in range(parts)]
    return list(zip([0] + stops[:-1], stops))


def frame_latent_rows(height: int, factor: int, world: int) -> int:
    """Latent rows of a ``height``-row frame; checks that ``world`` bands fit."""
    if height % factor:
        raise ValueError(f"split VAE: the frame height {height} is not a multiple of {factor}")
    rows = height // factor
    if world > rows:
        raise ValueError(f"split VAE: {world} ranks but only {rows} latent rows; "
                         f"use a group of at most {rows} ranks")
    return rows


class Band:
    """This rank's band of a frame in a process group.

    Band tensors have rows on dim -2; a band tensor at any resolution has exactly
    ``(stop - start) * f`` rows, ``f`` its resolution in rows per latent row."""

    def __init__(self, group, latent_rows: int):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.latent_rows = latent_rows
        self.bands = band_rows(latent_rows, self.world)
        self.start, self.stop = self.bands[self.rank]

    def factor(self, x: torch.Tensor, extra: int = 0) -> int:
        """``x``'s resolution in rows per latent row; ``extra``: rows ``x`` holds beyond its band
        on each side."""
        f, rem = divmod(x.shape[-2] - 2 * extra, self.stop - self.start)
        assert rem == 0 and f > 0, (x.shape, extra, self.start, self.stop)
        return f

    def full_rows(self, x: torch.Tensor, extra: int = 0) -> int:
        """Rows of the whole frame at ``x``'s resolution."""
        return self.latent_rows * self.factor(x, extra)

    def min_band(self, x: torch.Tensor) -> int:
        """Rows of the smallest band at ``x``'s resolution (``x``: a band without extra rows)."""
        return min(e - s for s, e in self.bands) * self.factor(x)

    def zero_outside(self, x: torch.Tensor, extra: int) -> torch.Tensor:
        """``x`` (a fresh tensor; changed in place) with its ``extra`` rows past the frame's top
        or bottom edge set to zero: what the whole-frame conv's zero padding reads there."""
        if self.rank == 0:
            x.narrow(-2, 0, extra).zero_()
        if self.rank == self.world - 1:
            x.narrow(-2, x.shape[-2] - extra, extra).zero_()
        return x

    def own(self, full: torch.Tensor, f: int) -> torch.Tensor:
        """This rank's rows of a whole frame at resolution ``f``."""
        return full.narrow(-2, self.start * f, (self.stop - self.start) * f).contiguous()
