"""One job on one rank: what every job does once, whatever its recipe, around a step driver that
does the denoising.

The shell (:class:`JobShell`), in upstream ``WanS2V.generate``'s order:

1. **Inputs**, by one choreography (:meth:`JobShell.encode`; rank roles from the layout, never a
   literal rank): the speech's audio features and the reference on the encoding rank
   (``Layout.encoding_rank``), the texts' T5 contexts on the text rank (``Layout.text_rank``) at the
   same time, then broadcast from each; with an FSDP-sharded T5 every rank takes part in the text
   encode (FSDP needs it) first; with the VAE split by rows (``--vae-parallel``) every rank encodes
   its rows of the reference. *What* is encoded is the driver's (:class:`StepDriver`): its texts
   (the prompt and the negative prompt for CFG; the prompt alone for the live recipe), its speech
   bucket (a clip's frames, a block's), its reference encode.
2. **The DiT joined** (a DiT read on its thread while the encoders ran: ``Components.ready``), on
   every rank at the same point.
3. **The denoising**, by the driver, under the run's precision (CUDA's autocast in the compute
   dtype, as upstream) and ``no_grad``; the driver's step control carries the stop, the step
   cache's agreement and fp16's faults (:mod:`~wan_s2v_runner.rank.step_control`).
4. **The end**: every rank leaves the job together (one barrier).

The drivers: :class:`~wan_s2v_runner.rank.clip_steps.ClipSteps` (upstream's clips: every rank at
every step, CFG, the step cache; proven equal to upstream ``generate``: tests/test_generation.py)
and :class:`~wan_s2v_runner.rank.block_pipeline.BlockPipeline` (LiveAvatar's causal blocks, the
steps pipelined over the ranks). A mode's recipe (``ModeTraits.recipe``) names its driver once
(:func:`driver_for`); nothing else asks which mode runs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from wan_s2v_runner.rank.block_pipeline import BlockPipeline
from wan_s2v_runner.rank.clip_steps import ClipSteps
from wan_s2v_runner.rank.encoders import TextContexts, encode_audio, encode_texts, placement
from wan_s2v_runner.rank.job_contract import FramesInMemory, Hooks, Inputs, Reference, Request, broadcast_tensors
from wan_s2v_runner.shared.layout import Recipe
from wan_s2v_runner.shared.stages import Stage

__all__ = ["Hooks", "JobShell", "Request", "driver_for"]


# --------------------------------------------------------------------------- the shell
class JobShell:
    """Runs jobs on one rank of a plan with one driver. ``parts`` is the engine component holder
    (:class:`~wan_s2v_runner.loading.components.Components`), ``plan`` this rank's place, ``texts``
    the group's memo of T5 encodings (kept across its jobs; None: a fresh one), ``driver`` the
    recipe's step driver class (default: the layout's, :func:`driver_for`)."""

    def __init__(self, parts, plan, hooks: Optional[Hooks] = None, texts: Optional[TextContexts] = None,
                 driver: Optional[type] = None):
        self.parts, self.plan, self.hooks = parts, plan, hooks or Hooks()
        self.texts = texts if texts is not None else TextContexts()
        self.s2v = parts.shell  # a WanS2V whose helper methods we call (upstream code)
        self.device = parts.device
        self.param_dtype = parts.param_dtype
        self.driver = (driver or driver_for(plan.layout.recipe))(self)

    # ----- 1. inputs
    def encode(self, req: Request) -> Inputs:
        plan, layout, h = self.plan, self.plan.layout, self.hooks
        texts = self.driver.texts(req)
        contexts: Optional[list] = None
        # Collective work goes first, in the same order on every rank; none of these encodes draws
        # random numbers, so the order does not change a bit. FSDP-sharded T5: every rank runs it.
        if plan.all_encode_text:
            contexts = self._encode_texts(req, texts)
        size = None
        if plan.encodes or layout.vae_parallel:  # reads the image header only
            size = self.s2v.get_gen_size(size=None, max_area=req.max_area, ref_image_path=req.ref_image_path,
                                         pre_video_path=None)
        split = size is not None and layout.splits_vae(size[0])
        ref = None
        if split:  # every rank encodes its rows of the reference
            h.stage(Stage.REF_ENCODE)
            ref = self.driver.reference(req, size, True)
        if plan.encodes_text and not plan.encodes:  # the text rank, while the encoding rank encodes the speech
            contexts = self._encode_texts(req, texts)
        mine: dict = {}
        if plan.encodes:
            mine, ref = self._encode_speech_and_reference(req, size, ref)
            if plan.encodes_text:  # one rank: it encodes everything
                contexts = self._encode_texts(req, texts)
        if layout.world_size > 1:
            if not plan.encodes:
                h.stage(Stage.RECEIVE_INPUTS)
            mine = broadcast_tensors(mine, src=layout.encoding_rank, device=self.device)
            if layout.text_rank is not None:  # the contexts, from the rank that encoded them
                sent = {f"context{i}": c for i, c in enumerate(contexts)} if plan.encodes_text else {}
                got = broadcast_tensors(sent, src=layout.text_rank, device=self.device)
                contexts = [got[f"context{i}"] for i in range(len(texts))]
        return self._inputs(mine, contexts, ref, split)

    def _encode_speech_and_reference(self, req: Request, size, ref: Optional[Reference]) -> tuple[dict, Reference]:
        """The encoding rank's part: the speech, and the reference unless every rank made its rows."""
        h = self.hooks
        if self.driver.encodes_speech:
            where, why = placement(self.parts.audio_encoder(), self.device, req.audio_path)
            h.stage(Stage.AUDIO_ENCODE, wav2vec2=where.value, wav2vec2_why=why)
            audio_emb, units = encode_audio(self.s2v, where, self.device, req.audio_path,
                                            self.driver.speech_frames(req))
            self.parts.release_audio_encoder()  # --release-encoders: wav2vec2 let go
        else:  # the driver's blocks make their features as they start (the live recipe)
            h.stage(Stage.AUDIO_ENCODE, wav2vec2="per block")
            audio_emb, units = self.driver.open_speech(req)
        mine: dict = {}
        if ref is None:
            h.stage(Stage.REF_ENCODE)
            ref = self.driver.reference(req, size, False)
            mine.update(ref.latents)
        flags = list(ref.flags.values())
        mine.update(audio_emb=audio_emb, meta=torch.tensor([size[0], size[1], units, *flags], dtype=torch.int64))
        return mine, ref

    def _inputs(self, got: dict, contexts: list, ref: Optional[Reference], split: bool) -> Inputs:
        meta = got["meta"].tolist()
        latents = dict(ref.latents) if split else {k: v for k, v in got.items() if k not in ("meta", "audio_emb")}
        names = list(ref.flags) if ref is not None else self.driver.flag_names
        return Inputs(height=meta[0], width=meta[1], units=meta[2], audio_emb=got["audio_emb"], contexts=contexts,
                      latents=latents, flags=dict(zip(names, meta[3:])),
                      local=ref.local if ref is not None else {})

    def _encode_texts(self, req: Request, texts: tuple[str, ...]) -> list:
        """Upstream's T5 encodes (:func:`~wan_s2v_runner.rank.encoders.encode_texts`), each text
        taken from the group's memo when it was encoded before."""
        self.hooks.stage(Stage.TEXT_ENCODE, texts_encoded=len(self.texts.new(texts)),
                         t5_device="cpu" if self.s2v.t5_cpu else self.device.type)
        return encode_texts(self.parts, self.texts, self.device, texts, req.offload_model)

    # ----- the job
    def generate(self, req: Request, resuming: bool = False, resume=None) -> Optional[torch.Tensor]:
        """Run the job: the decoding rank hands each unit's frames to ``hooks.sink``; without one,
        the frames (3, N, H, W) in [-1, 1] are returned there (:class:`FramesInMemory`), None
        elsewhere. ``resuming`` (every rank): continue from a checkpoint; ``resume`` (decoding
        rank): the state after the last complete clip."""
        kept = FramesInMemory() if self.plan.decodes and self.hooks.sink is None else None
        inputs = self.encode(req)
        self.join_dit()
        sink = (kept or self.hooks.sink) if self.plan.decodes else None
        with self.precision(), torch.no_grad():
            self.driver.run(req, inputs, sink, resuming, resume)
        if dist.is_initialized():
            dist.barrier()
        return kept.video() if kept is not None else None

    def join_dit(self) -> None:
        """The DiT read on its thread while the encoders ran: joined here, on every rank; fp16's
        guard starts the job with no flag (an earlier job that ended mid-step may have left one)."""
        if self.parts.dit_loading:
            if self.parts.pending.reading:
                self.hooks.stage(Stage.LOAD, what="WanModel_S2V")
            self.parts.ready()
        if self.parts.guard is not None:
            self.parts.guard.take()

    def precision(self):
        """The denoising's autocast: CUDA's in the compute dtype, as upstream's ``generate``."""
        return torch.amp.autocast(self.device.type, dtype=self.param_dtype, enabled=self.device.type == "cuda")

    def record(self) -> dict:
        return self.driver.record()


#: each recipe's step driver
DRIVERS: dict[Recipe, type] = {Recipe.CLIPS: ClipSteps, Recipe.LIVE: BlockPipeline}


def driver_for(recipe: Recipe) -> type:
    """The step driver of a recipe (bound once, when a rank group makes its shell)."""
    return DRIVERS[Recipe(recipe)]
