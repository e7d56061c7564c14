"""The live mode's loop (``--mode live``): LiveAvatar's causal few-step S2V, block by block, the
denoising steps pipelined over the ranks, the video written as each block decodes.

The clip loop's sibling (:mod:`wan_s2v_runner.rank.generation`): the same component holder, rank
plan, hooks and clip sink; the same job in, the same growing video out. Per job:

1. **Inputs** (rank 0: the speech and the reference; the text rank: the prompt; broadcast to the
   DiT ranks): wav2vec2 features for 12-frame blocks; the reference encoded as LiveAvatar does
   (5 copies of the image, the second latent frame kept) and the initial motion latents (the
   reference repeated over the 73 motion frames, encoded: never refreshed afterwards); the prompt's
   T5 context (no CFG: the negative prompt is not encoded).
2. **The sink** (every DiT rank): the condition tokens' keys and values, once per job.
3. **Blocks** (:func:`~wan_s2v_runner.shared.live_recipe.stage_plan`): a block's noise is LiveAvatar's
   (a 4-block window's worth drawn from ``seed + window``, the block's 3 frames sliced); its
   steps run on the ranks holding them, each against its own step cache, the latents sent on
   point to point (``isend``: a rank never waits for the next one to take them); rank 0 decodes
   the final latents with the streaming VAE (the first 7 motion latents decoded first to fill its
   causal cache) and hands the frames to the sink (:class:`~wan_s2v_runner.rank.video_writer.VideoWriter`:
   one fragment per block, the speech beside it).
4. **Reports**: each rank reports a block it finished (the step hook: a served job stops there);
   rank 0 also the time to the first frame and the frames per second so far (``live`` events,
   :attr:`LiveGenerator.record` for ``run.json``).

A resume is not supported (the caches are the state: a stopped live job runs again from its
start); the preflight says so before a live resume spawns.
"""
from __future__ import annotations

import contextlib
import random
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from patches.fp16_compute import NonFiniteActivation
from wan_s2v_runner.rank.encoders import TextContexts, encode_audio, encode_texts, placement
from wan_s2v_runner.rank.generation import FramesInMemory, Hooks, Request, broadcast_tensors, reference_pixels
from wan_s2v_runner.rank.live_decode import StreamDecoder
from wan_s2v_runner.rank.live_dit import LiveDiT
from wan_s2v_runner.shared import live_recipe as recipe
from wan_s2v_runner.shared.stages import Stage


class Schedule:
    """The distilled 4-step schedule: diffusers' ``FlowMatchEulerDiscreteScheduler(shift=3)``'s
    timesteps and sigmas, its Euler update applied per step (a stage runs any step without the
    scheduler's internal step counter)."""

    def __init__(self, num_train_timesteps: int, steps: int = recipe.STEPS, shift: float = recipe.SHIFT):
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
        sched.set_timesteps(steps)
        self.timesteps, self.sigmas = sched.timesteps, sched.sigmas

    def step(self, i: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """diffusers' ``step`` at index ``i`` (deterministic sampling)."""
        dt = self.sigmas[i + 1] - self.sigmas[i]
        return (sample.to(torch.float32) + dt * model_output).to(model_output.dtype)


class LiveGenerator:
    """Runs a live job on one rank of a group (``parts``, ``plan`` as the clip loop's)."""

    def __init__(self, parts, plan, hooks: Optional[Hooks] = None, texts: Optional[TextContexts] = None):
        self.parts, self.plan, self.hooks = parts, plan, hooks or Hooks()
        self.texts = texts if texts is not None else TextContexts()
        self.s2v = parts.shell
        self.device = parts.device
        self.param_dtype = parts.param_dtype
        self.stages = recipe.stage_plan(plan.layout.world_size)
        if self.stages is None:
            raise ValueError(recipe.stage_problem(plan.layout.world_size))
        #: rank 0: the job's live figures (time to the first frame, frames per second)
        self.record: dict = {}
        self.cache_records: list = []  # the clip loop's; a live job has none

    # ----- inputs
    def _reference(self, req: Request, size):
        """LiveAvatar's reference and initial motion latents (``causal_s2v_pipeline.generate``): the
        image 5 times, encoded, its second latent frame; the 5 over the 73 motion frames, encoded."""
        s2v = self.s2v
        ref = reference_pixels(req.ref_image_path, size, s2v.vae).repeat(1, 1, 5, 1, 1)
        with torch.no_grad():
            ref_latents = torch.stack(s2v.vae.encode(ref))[:, :, 1:]
            motion = torch.stack(s2v.vae.encode(ref.repeat(1, 1, s2v.motion_frames, 1, 1)))
        return ref_latents, motion

    def _text(self, req: Request) -> list:
        """The prompt's T5 context (no CFG: no negative prompt)."""
        (context,) = encode_texts(self.parts, self.texts, self.device, (req.prompt,), req.offload_model)
        return context

    def encode(self, req: Request) -> dict:
        """Every rank's inputs: {audio_emb, ref, motion, context, meta=[H, W, blocks]}."""
        plan, h = self.plan, self.hooks
        mine: dict = {}
        texts: dict = {}
        if plan.encodes_text and not plan.encodes:
            h.stage(Stage.TEXT_ENCODE, texts_encoded=len(self.texts.new((req.prompt,))))
            texts = {"context": self._text(req)}
        if plan.encodes:
            size = self.s2v.get_gen_size(size=None, max_area=req.max_area, ref_image_path=req.ref_image_path,
                                         pre_video_path=None)
            where, why = placement(self.parts.audio_encoder(), self.device, req.audio_path)
            h.stage(Stage.AUDIO_ENCODE, wav2vec2=where.value, wav2vec2_why=why)
            audio_emb, blocks = encode_audio(self.s2v, where, self.device, req.audio_path, recipe.BLOCK_FRAMES)
            self.parts.release_audio_encoder()
            h.stage(Stage.REF_ENCODE)
            ref, motion = self._reference(req, size)
            mine = {"audio_emb": audio_emb, "ref": ref, "motion": motion,
                    "meta": torch.tensor([size[0], size[1], blocks], dtype=torch.int64)}
            if plan.encodes_text:
                h.stage(Stage.TEXT_ENCODE, texts_encoded=len(self.texts.new((req.prompt,))))
                mine["context"] = self._text(req)
        if plan.layout.world_size > 1:
            h.stage(Stage.RECEIVE_INPUTS)
            got = broadcast_tensors({k: v for k, v in mine.items() if k != "context"} if plan.encodes else {},
                                    src=0, device=self.device)
            ctx_src = plan.layout.text_rank
            ctx = broadcast_tensors({"context": (mine.get("context") or texts.get("context"))}
                                    if plan.rank == ctx_src else {}, src=ctx_src, device=self.device)
            got.update(ctx)
            return got
        return mine

    # ----- the job
    def generate(self, req: Request, resuming: bool = False, resume=None) -> Optional[torch.Tensor]:
        """Run the job; without a sink on the hooks, rank 0 returns the frames (3, N, H, W)."""
        if resuming:
            raise ValueError("a live job cannot be resumed: run it again")
        kept = FramesInMemory() if self.plan.decodes and self.hooks.sink is None else None
        inputs = self.encode(req)
        if self.parts.dit_loading:
            if self.parts.pending.reading:
                self.hooks.stage(Stage.LOAD, what="WanModel_S2V")
            self.parts.ready()
        self.run_blocks(req, inputs, kept or self.hooks.sink)
        return kept.video() if kept is not None else None

    def run_blocks(self, req: Request, inputs: dict, sink) -> None:
        plan, h, s2v, stages = self.plan, self.hooks, self.s2v, self.stages
        rank = plan.rank
        height, width, blocks = (int(v) for v in inputs["meta"].tolist())
        mine = stages.steps_of(rank)
        seed = req.seed if req.seed >= 0 else random.randint(0, sys.maxsize)
        sched = Schedule(s2v.num_train_timesteps)
        lat_h, lat_w = height // 8, width // 8
        lat_motion = (s2v.motion_frames + 3) // 4
        motion_frames = [s2v.motion_frames, lat_motion]
        block_shape = (16, recipe.BLOCK_LATENT_FRAMES, lat_h, lat_w)
        world = plan.layout.world_size
        autocast = torch.amp.autocast(self.device.type, dtype=self.param_dtype, enabled=self.device.type == "cuda")
        # fp16 on the CPU: the DiT's forwards under CPU autocast, as patches.fp16_compute wraps the
        # model's forward (which this path does not call), so the tests compute what a GPU does
        cpu_fp16 = self.device.type == "cpu" and self.param_dtype == torch.float16

        def dit_autocast():
            return torch.amp.autocast("cpu", dtype=torch.float16) if cpu_fp16 else contextlib.nullcontext()
        pending: list = []
        started = time.monotonic()
        with autocast, torch.no_grad():
            dit = cond = ctx = None
            kvs: dict = {}
            if mine:
                from patches.live_kv import StepKV

                h.stage(Stage.DENOISE, clip=1, clips=blocks, steps=recipe.STEPS, what="sink")
                dit = LiveDiT(self.parts.noise_model, recipe.rope_positions(blocks))
                with dit_autocast():
                    ctx = dit.context(inputs["context"][0:1])
                    cond = dit.sink(inputs["ref"], inputs["motion"], ctx)
                kvs = {i: StepKV(len(dit.model.blocks)) for i in mine}
            decoder = None
            if plan.decodes:
                decoder = StreamDecoder(s2v.vae)
                decoder.decode(inputs["motion"][:, :, :recipe.PRIME_LATENTS])  # fills its causal cache
            cond_states = torch.zeros(block_shape, dtype=self.param_dtype, device=self.device)
            window_noise = None
            # rank 0 decodes block g once it holds its final latents: at once when it runs the last
            # step, else `lag` blocks later (the blocks in flight on the other ranks); where the step
            # hook is a collective (a served job's stop check, every block), at once: a job stopped
            # there must leave no block in flight for the group's next job to receive
            last_rank = stages.rank_of_step(recipe.STEPS - 1)
            lag = (0 if last_rank == 0 or not stages.decoder_runs_dit or h.step_is_collective
                   else len(stages.dit_ranks) - 1)
            finals: dict = {}
            posted: dict = {}  # block -> (buffer, irecv) of final latents rank 0 receives ahead
            decoded = 0

            def decode_upto(limit: int) -> None:
                nonlocal decoded
                while decoded < limit:
                    g = decoded
                    x = finals.pop(g, None)
                    if g in posted:  # received while this rank sent its next block
                        x, work = posted.pop(g)
                        work.wait()
                    if x is None:
                        x = torch.empty(block_shape, dtype=torch.float32, device=self.device)
                        dist.recv(x, src=last_rank)
                    frames = decoder.decode(x.unsqueeze(0).to(s2v.vae.dtype))
                    frames = frames[:, :, -recipe.BLOCK_FRAMES:]
                    if g == 0:
                        frames = frames[:, :, recipe.FIRST_BLOCK_DROP:]
                    self._report(g, blocks, frames.shape[2], started)
                    if sink is not None:
                        sink.frames(g, frames.cpu(), blocks)
                    decoded += 1

            for g in range(blocks):
                if mine:
                    h.stage(Stage.DENOISE, clip=g + 1, clips=blocks, steps=recipe.STEPS)
                    if mine[0] == 0:
                        w = g // recipe.WINDOW_BLOCKS
                        if g % recipe.WINDOW_BLOCKS == 0:
                            gen = torch.Generator(device=self.device)
                            gen.manual_seed(seed + w)
                            window_noise = torch.randn(16, recipe.WINDOW_BLOCKS * recipe.BLOCK_LATENT_FRAMES,
                                                       lat_h, lat_w, dtype=self.param_dtype, device=self.device,
                                                       generator=gen)
                        b = g % recipe.WINDOW_BLOCKS
                        x = window_noise[:, b * recipe.BLOCK_LATENT_FRAMES:(b + 1) * recipe.BLOCK_LATENT_FRAMES]
                    else:
                        x = torch.empty(block_shape, dtype=torch.float32, device=self.device)
                        dist.recv(x, src=stages.rank_of_step(mine[0] - 1))
                    audio = inputs["audio_emb"][..., g * recipe.BLOCK_FRAMES:(g + 1) * recipe.BLOCK_FRAMES]
                    for i in mine:
                        t = torch.stack([sched.timesteps[i]]).to(self.device)
                        try:
                            with dit_autocast():
                                v = dit.block(x, t, kvs[i], g, recipe.ref_distance(seed, g, i), audio, cond_states,
                                              motion_frames, ctx, cond)
                        except NonFiniteActivation as e:  # --dtype fp16: which step of which block
                            raise e.at(i + 1, recipe.STEPS, g + 1) from None
                        x = sched.step(i, v, x)
                    nxt = stages.rank_of_step(mine[-1] + 1) if mine[-1] + 1 < recipe.STEPS else 0
                    if nxt != rank:
                        if plan.decodes and lag and g - lag >= 0:
                            # the final latents rank 0 decodes next, posted before its send: two ranks
                            # that send to each other (2 ranks) keep their sends and receives in one
                            # order on both sides (NCCL runs a pair's in turn: a send can wait for its
                            # receive)
                            buf = torch.empty(block_shape, dtype=torch.float32, device=self.device)
                            posted[g - lag] = (buf, dist.irecv(buf, src=last_rank))
                        pending.append(dist.isend(x.contiguous(), dst=nxt))
                    else:
                        finals[g] = x
                    pending = [p for p in pending if not p.is_completed()]
                if plan.decodes:
                    h.stage(Stage.DECODE, clip=g + 1, clips=blocks)
                    decode_upto(g + 1 - lag)
                h.step(clip=g + 1, clips=blocks, step=recipe.STEPS, steps=recipe.STEPS, unit="block",
                       **({k: self.record[k] for k in ("fps", "first_frame_s") if k in self.record}
                          if plan.decodes else {}))
            if plan.decodes:
                decode_upto(blocks)
                decoder.close()
            for p in pending:
                p.wait()
        if world > 1:
            dist.barrier()

    def _report(self, block: int, blocks: int, frames: int, started: float) -> None:
        """Rank 0, a block decoded: the time to the first frame and the frames per second since."""
        now = time.monotonic()
        rec = self.record
        if block == 0:
            rec["first_frame_s"] = round(now - started, 3)
            rec["frames_made"] = 0
        rec["frames_made"] += frames
        rec["blocks"] = block + 1
        span = now - started - rec["first_frame_s"]
        if block > 0 and span > 0:
            rec["fps"] = round((rec["frames_made"] - self._first_frames) / span, 3)
        else:
            self._first_frames = rec["frames_made"]
        if self.hooks.live is not None:
            self.hooks.live(dict(rec, of=blocks))

