"""This rank's place in the run's parallel plan: its rank, the (cfg, sp) device mesh and what work it does.

The layout (:class:`~wan_s2v_runner.shared.layout.Layout`) holds every fact about the plan: the
degrees, the mesh's shape, a rank's coordinates on it, and it builds the ``DeviceMesh``
(:meth:`~wan_s2v_runner.shared.layout.Layout.device_mesh`; sequence-parallel dimension innermost:
an SP group is consecutive ranks, i.e. one node; CFG groups span nodes). Ask it (``plan.layout``)
for those. A :class:`RankPlan` adds only what is this rank's own: its number, the mesh and its
process groups (looked up by :class:`~wan_s2v_runner.shared.layout.MeshAxis`), and who does what:
the encoding rank (rank 0) encodes the speech and the decoding rank (rank 0) keeps the frames
while the last rank (the layout's ``text_rank``; rank 0 when alone) encodes the prompts, at the same
time; the others load neither wav2vec2 nor T5 unless T5 is FSDP-sharded (then every rank takes part
in the text encode). In the live recipe's step pipeline a rank runs the steps the layout's stage
plan gives it, and a decoding rank that runs none holds no DiT (:attr:`RankPlan.needs_dit`). The VAE work
(reference encode, per-clip decode, motion re-encode) is split by rows over every rank with
``--vae-parallel`` (on by default with more than one rank: every rank loads the VAE); without it
rank 0 runs it alone and the other ranks do not load the VAE.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from wan_s2v_runner.shared.layout import Layout, MeshAxis


@dataclass
class RankPlan:
    layout: Layout
    rank: int
    mesh: Any = None  # torch DeviceMesh, dimensions named by MeshAxis (None with one rank)

    def group(self, axis: MeshAxis) -> Any:
        """This rank's process group along ``axis`` (None without a mesh)."""
        return None if self.mesh is None else self.mesh.get_group(MeshAxis(axis))

    @property
    def cfg_group(self) -> Any:
        """This rank and its peer(s) in the other CFG branch (same SP index)."""
        return self.group(MeshAxis.CFG)

    @property
    def sp_group(self) -> Any:
        """The ranks that split this branch's sequence."""
        return self.group(MeshAxis.SP)

    @property
    def cfg_rank(self) -> int:
        """0: the conditional branch; 1: the unconditional one."""
        return self.layout.coords(self.rank)[0]

    @property
    def sp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def encodes(self) -> bool:
        """Computes audio features and reference/motion latents (broadcast from it)."""
        return self.rank == self.layout.encoding_rank

    @property
    def encodes_text(self) -> bool:
        """Computes the text contexts and broadcasts them (unless FSDP T5: every rank takes part)."""
        return self.rank == self.layout.text_rank

    @property
    def decodes(self) -> bool:
        """Decodes each clip (or block), re-encodes a clip's last frames, writes the video."""
        return self.rank == self.layout.decoding_rank

    @property
    def needs_dit(self) -> bool:
        """Loads and runs the DiT (not the decoding rank of a 5-rank live pipeline: it runs no step)."""
        return self.layout.holds_dit(self.rank)

    @property
    def steps(self) -> Optional[tuple[int, ...]]:
        """The live pipeline's denoising steps this rank runs (0-based), or None: the clip recipe,
        every rank at every step."""
        stages = self.layout.stages
        return None if stages is None else stages.steps_of(self.rank)

    @property
    def all_encode_text(self) -> bool:
        """Every rank takes part in the text encode (FSDP-sharded T5)."""
        return self.layout.t5_fsdp

    @property
    def needs_t5(self) -> bool:
        return self.encodes_text or self.all_encode_text

    @property
    def needs_audio_encoder(self) -> bool:
        return self.encodes

    @property
    def needs_vae(self) -> bool:
        return self.encodes or self.decodes or self.layout.vae_parallel

    def describe(self) -> dict:
        return {"rank": self.rank, "cfg_rank": self.cfg_rank, "sp_rank": self.sp_rank,
                "loads": [n for n, need in (("t5", self.needs_t5), ("wav2vec2", self.needs_audio_encoder),
                                            ("vae", self.needs_vae), ("dit", self.needs_dit)) if need],
                **({"steps": [s + 1 for s in self.steps]} if self.steps is not None else {})}


def rank_plan(layout: Layout, device_type: str, rank: Optional[int] = None) -> RankPlan:
    """The plan of this rank; builds the layout's device mesh when there is more than one rank."""
    rank = dist.get_rank() if rank is None and dist.is_initialized() else (rank or 0)
    if layout.world_size == 1 or not dist.is_initialized():
        return RankPlan(layout, rank)
    return RankPlan(layout, rank, layout.device_mesh(device_type))
