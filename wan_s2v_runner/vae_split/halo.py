"""Halo exchange and gathers of the split VAE: the rows a band's convolutions read from its
neighbours' bands (:meth:`Rows.start_halo`: posted at once, one message per neighbour for a whole
group of chunks, waited for when needed), and the whole frame assembled from every rank's band
(:meth:`Rows.gather_all`, :meth:`Rows.gather_to`). On a gloo group with the model on a GPU,
tensors are staged through the CPU.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .bands import Band


def await_peers(works) -> None:
    """Wait for point-to-point transfers (the halo rows). Named so that a hang report's stack
    analysis (``diagnose.analyse_stacks``, which looks for this name) counts a rank blocked
    here as waiting for its peers, like one blocked in a collective."""
    for work in works:
        work.wait()


class PendingHalo:
    """Halo rows on their way (``Rows.start_halo``): ``wait()`` returns, per chunk, ([the rows
    above] or [], [the rows below] or []), zeros past the frame's edges."""

    def __init__(self, works, sent, rows):
        self._works, self._sent, self._rows = works, sent, rows

    def wait(self) -> list[tuple[list, list]]:
        await_peers(self._works)
        self._sent = None
        return self._rows()


class Rows(Band):
    """This rank's band of a frame in a process group, and the exchanges between bands."""

    def __init__(self, group, latent_rows: int, device: torch.device):
        super().__init__(group, latent_rows)
        # gloo moves CPU tensors only: stage through the CPU when the model is elsewhere
        self.stage = dist.get_backend(group) == "gloo" and device.type != "cpu"

    def _peer(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()  # first: a copy to the CPU keeps the strides, and gloo wants dense
        return t.cpu() if self.stage else t

    def halo(self, x: torch.Tensor, above: int, below: int) -> torch.Tensor:
        """``x`` with ``above`` rows of the previous band on top and ``below`` rows of the next
        band underneath; zero rows (the whole frame's zero padding) past the frame's edges."""
        if not above and not below:
            return x
        (top, bottom), = self.start_halo([x], above, below).wait()
        return torch.cat(top + [x] + bottom, dim=-2)

    def start_halo(self, xs: Sequence[torch.Tensor], above: int, below: int) -> "PendingHalo":
        """Posts the exchange of ``halo``'s rows of every band tensor in ``xs`` (the chunks of a
        group, ``BandVAE``), one message per neighbour for them all, and returns at once;
        ``.wait()`` gives each one's (rows above, rows below)."""
        rows = xs[0].shape[-2]
        assert all(x.shape[-2] == rows for x in xs) and rows >= max(above, below), (rows, above, below)
        shapes = [list(x.shape) for x in xs]
        part = lambda s, n: s[:-2] + [n, s[-1]]  # noqa: E731
        wire = torch.device("cpu") if self.stage else xs[0].device
        ops, got, sent = [], {}, []

        def recv(key, n, peer):
            got[key] = torch.empty(sum(math.prod(part(s, n)) for s in shapes), dtype=xs[0].dtype, device=wire)
            ops.append(dist.P2POp(dist.irecv, got[key], self._peer(peer), self.group))

        def send(start, n, peer):  # rows start .. start + n - 1 of every chunk, in one message
            sent.append(self._wire(torch.cat([x.narrow(-2, start, n).reshape(-1) for x in xs])))
            ops.append(dist.P2POp(dist.isend, sent[-1], self._peer(peer), self.group))  # kept alive until waited

        if self.rank > 0:
            if above:
                recv("above", above, self.rank - 1)
            if below:
                send(0, below, self.rank - 1)
        if self.rank < self.world - 1:
            if above:
                send(rows - above, above, self.rank + 1)
            if below:
                recv("below", below, self.rank + 1)
        works = dist.batch_isend_irecv(ops) if ops else []

        def edges(key, n) -> list[list]:  # per chunk: its received rows, or the frame's zero padding
            if not n:
                return [[] for _ in xs]
            if key not in got:
                return [[x.new_zeros(part(s, n))] for x, s in zip(xs, shapes)]
            pieces = got[key].split([math.prod(part(s, n)) for s in shapes])
            return [[p.view(part(s, n)).to(x.device)] for p, x, s in zip(pieces, xs, shapes)]
        return PendingHalo(works, sent, lambda: list(zip(edges("above", above), edges("below", below))))

    def _padded(self, x: torch.Tensor, f: int) -> tuple[torch.Tensor, list[int]]:
        heights = [(e - s) * f for s, e in self.bands]
        pad = max(heights) - x.shape[-2]
        if pad:
            shape = list(x.shape)
            shape[-2] = pad
            x = torch.cat([x, x.new_zeros(shape)], dim=-2)
        return self._wire(x), heights

    def _assemble(self, parts: list[torch.Tensor], heights: list[int], device) -> torch.Tensor:
        return torch.cat([p.narrow(-2, 0, h) for p, h in zip(parts, heights)], dim=-2).to(device)

    def gather_all(self, x: torch.Tensor) -> torch.Tensor:
        """The whole frame from every rank's band, on every rank."""
        padded, heights = self._padded(x, self.factor(x))
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return self._assemble(parts, heights, x.device)

    def gather_to(self, x: torch.Tensor, dst: Optional[int]) -> Optional[torch.Tensor]:
        """The whole frame on group rank ``dst`` (None elsewhere), or on all ranks for None."""
        if dst is None:
            return self.gather_all(x)
        padded, heights = self._padded(x, self.factor(x))
        parts = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == dst else None
        dist.gather(padded, parts, dst=self._peer(dst), group=self.group)
        return self._assemble(parts, heights, x.device) if parts is not None else None
