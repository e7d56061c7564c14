"""Our S2V generation loop: upstream ``WanS2V.generate``'s control flow, re-expressed with a
parallel plan (CFG x sequence parallel) and every piece of work done once.

Built from the engine's own parts (the DiT, T5, VAE and audio encoder the engine loads, its
schedulers, and ``WanS2V``'s own helper methods called on a component holder), in upstream's
order, with upstream's numerics: per clip a generator on the run's device seeded ``seed + clip``,
the same noise, scheduler, CFG combine ``u + g * (c - u)`` and decode/re-encode. Upstream's
``generate`` stays the reference (tests/test_generation.py: our loop == upstream exactly).

What differs is *where* work runs (:class:`~wan_s2v_runner.rank.parallel.RankPlan`):
* audio features, reference and initial-motion latents are computed by the encoding rank (rank 0)
  and broadcast; the text contexts (prompt and negative) by the last rank (the layout's
  ``text_rank``), at the same time, and broadcast from there (one rank: rank 0 does both); with
  an FSDP-sharded T5 every rank takes part in the text encode (FSDP needs it) and no broadcast
  of contexts is needed;
* with CFG-parallel the conditional and unconditional DiT passes run on the two halves of the
  ranks and the two noise predictions are exchanged with one all-gather per step;
* the VAE work (reference and initial-motion encode, each clip's decode, the motion re-encode of
  its last frames) is split by rows over every rank (:mod:`~wan_s2v_runner.vae_split`, exact;
  ``--vae-parallel``, on with more than one rank): every rank ends an encode with the whole
  latents (no broadcast), a decode with its own rows of the frames (rank 0 also gathers them
  whole, for the output), and the motion re-encode reads each rank's own rows of the last frames;
  without it rank 0 runs the VAE alone and broadcasts the motion latents;
* the pose-condition VAE encode, whose result upstream multiplies by zero when there is no pose
  video, is not run (its zeros are made directly); with ``--pose-video`` each clip's condition is
  read and encoded just before the clip, by the VAE ranks (split by rows, or the decoding rank
  and a broadcast), not every clip's up front on every rank (:mod:`~wan_s2v_runner.rank.pose`);
* the initial-motion VAE encode (73 frames of zeros) is not run when the first clip drops its
  motion frames (``drop_first_motion``, the S2V-14B default, without ``--start-from-ref``) and the
  DiT is one whose dropped motion tokens are never read (frame-pack or plain: ``_dropped_motion_unread``);
  its latents' shape is kept with zeros (upstream decodes that clip after the reference latents);
* the audio encode runs under ``no_grad``; on CUDA, wav2vec2 runs on the GPU for it where memory
  allows, back on the CPU after (upstream: always the CPU; :mod:`~wan_s2v_runner.rank.encoders`);
* a text the group has encoded before (a served group's next job; the default negative prompt) is
  not encoded again: its stored T5 encoding is used (:class:`~wan_s2v_runner.rank.encoders.TextContexts`),
  and T5 is not moved to the GPU when neither text is new.
With ``--cache`` (not upstream's: :mod:`~wan_s2v_runner.rank.step_cache`) a step predicted to change
little reuses the last computed step's noise prediction instead of running the DiT; every rank takes
the same decision (rank 0's measure, broadcast), and ``--cache off`` leaves the loop as it was.
Progress (stages and steps) is reported from here.
"""
from __future__ import annotations

import logging
import random
import sys
from copy import deepcopy
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np
import torch
import torch.distributed as dist

from patches.fp16_compute import NonFiniteActivation
from wan_s2v_runner.loading import block_stream
from wan_s2v_runner.rank.encoders import TextContexts, encode_audio, encode_texts, placement
from wan_s2v_runner.rank.step_cache import StepCache
from wan_s2v_runner.shared import cache_policy
from wan_s2v_runner.shared.procfs import trim_heap
from wan_s2v_runner.shared.stages import Stage

log = logging.getLogger("wan_s2v.generation")


@dataclass
class Request:
    """The generate() arguments our runner uses (names as upstream's)."""

    prompt: str
    ref_image_path: str
    audio_path: str
    num_repeat: Optional[int]
    max_area: int
    infer_frames: int
    shift: float
    sample_solver: str
    sampling_steps: int
    guide_scale: float
    n_prompt: str
    seed: int
    offload_model: bool
    init_first_frame: bool
    pose_video: Optional[str] = None
    cache: str = "off"  # --cache (wan_s2v_runner.shared.cache_policy); not upstream's: ours to skip DiT passes


@dataclass
class Encoded:
    """What every rank needs before the clips (computed once, broadcast)."""

    height: int
    width: int
    num_repeat: int
    audio_emb: torch.Tensor  # [1, layers, C, frames], param dtype, on device
    ref_latents: torch.Tensor  # [1, 16, 1, H/8, W/8]
    motion_latents: torch.Tensor  # [1, 16, 19, H/8, W/8] of the initial motion frames
    context: list  # [tensor [L, 4096]] on device
    context_null: list
    drop_first_motion: bool
    #: the initial "last 73 frames" (pixels); on the ranks that decode (rank 0, or every rank when
    #: the VAE is split)
    last_frames: Optional[torch.Tensor] = None


@dataclass
class ClipState:
    """What one clip hands the next: small, and all a resume needs (the clips so far are in the
    video file)."""

    clip: int  # index of the next clip to generate
    motion_latents: torch.Tensor
    #: [1, 3, 73, H, W]: only the decoding rank has it; None where no later clip reads it (a
    #: resume where each clip's frames replace all of them: ``infer_frames`` >= the motion frames)
    videos_last_frames: Optional[torch.Tensor]


class ClipSink(Protocol):
    """Where the decoding rank's clips go (:class:`~wan_s2v_runner.rank.video_writer.VideoWriter`
    in a run; :class:`FramesInMemory` for a caller that wants the frames)."""

    def frames(self, clip: int, frames: torch.Tensor, num_clips: int) -> None:
        """Clip ``clip`` (0-based) of ``num_clips`` is decoded: its frames (1, 3, n, H, W) on the CPU,
        before its motion re-encode (the sink may work on them meanwhile)."""

    def clip_done(self, state: "ClipState", num_clips: int) -> None:
        """The state after the clip (the next clip's motion latents): a clip checkpoint."""


class FramesInMemory:
    """The sink :meth:`S2VGenerator.generate` uses when given none: every clip's frames kept and
    returned whole, as upstream's ``generate`` returns them (memory grows with the clips: for
    callers that want the tensor, not for long videos)."""

    def __init__(self):
        self.clips: list[torch.Tensor] = []

    def frames(self, clip: int, frames: torch.Tensor, num_clips: int) -> None:
        self.clips.append(frames)

    def clip_done(self, state: "ClipState", num_clips: int) -> None:
        pass

    def video(self) -> torch.Tensor:
        return torch.cat(self.clips, dim=2)[0]


@dataclass
class Hooks:
    """How the loop reports: stage/step events (optional) and where the clips go."""

    stage: Callable[..., None] = lambda *a, **k: None
    step: Callable[..., None] = lambda **k: None
    #: decoding rank only: the clips' frames and checkpoints (None: :meth:`S2VGenerator.generate`
    #: keeps them in memory and returns them)
    sink: Optional[ClipSink] = None
    #: every rank, with --cache: a clip's steps computed and reused (:meth:`StepCache.record`), at its end
    cache_done: Optional[Callable[[dict], None]] = None
    #: whether ``step`` is a collective of every rank (a served job's stop check): the live loop then
    #: ends each block with all its messages taken, so a job stopped there leaves none in flight
    step_is_collective: bool = False
    #: the decoding rank, ``--mode live``: the job's live figures after each decoded block
    #: (:meth:`wan_s2v_runner.rank.live_loop.LiveGenerator.record`)
    live: Optional[Callable[[dict], None]] = None


# --------------------------------------------------------------------------- broadcast helpers
def broadcast_tensors(tensors: dict, src: int, device: torch.device, group=None) -> dict:
    """Broadcast a dict of tensors (or lists of tensors) from ``src``: shapes/dtypes first as an
    object, then each tensor on ``device`` (nccl needs CUDA tensors). Bits are preserved."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensors
    me = dist.get_rank()
    meta = [None]
    if me == src:
        meta = [{k: ([(tuple(t.shape), t.dtype, t.device.type) for t in v] if isinstance(v, list)
                     else (tuple(v.shape), v.dtype, v.device.type)) for k, v in tensors.items()}]
    dist.broadcast_object_list(meta, src=src, group=group)
    out = {}
    for k, m in meta[0].items():
        items = m if isinstance(m, list) else [m]
        srcs = (tensors[k] if isinstance(m, list) else [tensors[k]]) if me == src else [None] * len(items)
        got = []
        for (shape, dtype, _dev_type), t in zip(items, srcs):
            buf = t.to(device).contiguous() if me == src else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(buf, src=src, group=group)
            got.append(buf if me != src else t)
        out[k] = got if isinstance(m, list) else got[0]
    return out


# --------------------------------------------------------------------------- the loop
class S2VGenerator:
    """Runs the S2V loop on one rank of a plan. ``parts`` is the engine component holder
    (:class:`~wan_s2v_runner.loading.components.Components`), ``plan`` this rank's place."""

    def __init__(self, parts, plan, hooks: Optional[Hooks] = None, texts: Optional[TextContexts] = None):
        """``texts``: the group's memo of T5 encodings (kept across its jobs); None: a fresh one."""
        self.parts, self.plan, self.hooks = parts, plan, hooks or Hooks()
        self.texts = texts if texts is not None else TextContexts()
        self.s2v = parts.shell  # a WanS2V whose helper methods we call (upstream code)
        self.device = parts.device
        self.param_dtype = parts.param_dtype
        #: with --cache: per clip generated, the steps computed and reused (:meth:`StepCache.record`)
        self.cache_records: list[dict] = []

    # ----- inputs, once -----
    def encode(self, req: Request) -> Encoded:
        plan, s2v, h = self.plan, self.s2v, self.hooks
        mine: dict = {}
        last_frames = None
        # Collective work goes first, in the same order on every rank; none of these encodes draws
        # random numbers, so the order does not change a bit. FSDP-sharded T5: every rank runs it.
        if plan.all_encode_text:
            h.stage(Stage.TEXT_ENCODE, **self._text_news(req))
            context, context_null = self._encode_text(req)
        size = None
        if plan.encodes or plan.layout.vae_parallel:  # reads the image header only
            size = s2v.get_gen_size(size=None, max_area=req.max_area, ref_image_path=req.ref_image_path,
                                    pre_video_path=None)
        split_vae = size is not None and plan.layout.splits_vae(size[0])
        if split_vae:  # every rank encodes its rows of the reference and initial motion
            h.stage(Stage.REF_ENCODE)
            ref_latents, motion_latents, drop_first_motion, last_frames = self._encode_reference(req, size, True)
        texts: dict = {}
        if plan.encodes_text and not plan.encodes:  # the text rank, while rank 0 encodes the speech
            h.stage(Stage.TEXT_ENCODE, **self._text_news(req))
            context, context_null = self._encode_text(req)
            texts = {"context": context, "context_null": context_null}
        if plan.encodes:
            where, why = placement(self.parts.audio_encoder(), self.device, req.audio_path)
            h.stage(Stage.AUDIO_ENCODE, wav2vec2=where.value, wav2vec2_why=why)
            audio_emb, nr = encode_audio(s2v, where, self.device, req.audio_path, req.infer_frames)
            self.parts.release_audio_encoder()  # --release-encoders: wav2vec2 let go
            if not split_vae:
                h.stage(Stage.REF_ENCODE)
                ref_latents, motion_latents, drop_first_motion, last_frames = self._encode_reference(req, size, False)
                mine = {"ref_latents": ref_latents, "motion_latents": motion_latents}
            mine.update(audio_emb=audio_emb, meta=torch.tensor([size[0], size[1], nr, int(drop_first_motion)],
                                                               dtype=torch.int64))
            if plan.encodes_text:  # one rank: it encodes everything
                h.stage(Stage.TEXT_ENCODE, **self._text_news(req))
                context, context_null = self._encode_text(req)
        if plan.layout.world_size > 1:
            if not plan.encodes:
                h.stage(Stage.RECEIVE_INPUTS)
            got = broadcast_tensors(mine, src=0, device=self.device)
            if plan.layout.text_rank is not None:  # the contexts, from the rank that encoded them
                texts = broadcast_tensors(texts, src=plan.layout.text_rank, device=self.device)
                context, context_null = texts["context"], texts["context_null"]
            mine = got
        if split_vae:
            mine.update(ref_latents=ref_latents, motion_latents=motion_latents)
        meta = mine["meta"].tolist()
        num_repeat = meta[2] if req.num_repeat is None or req.num_repeat > meta[2] else req.num_repeat
        return Encoded(height=meta[0], width=meta[1], num_repeat=num_repeat, audio_emb=mine["audio_emb"],
                       ref_latents=mine["ref_latents"], motion_latents=mine["motion_latents"],
                       context=context, context_null=context_null, drop_first_motion=bool(meta[3]),
                       last_frames=last_frames)

    def _encode(self, videos, split: bool, height: Optional[int] = None) -> torch.Tensor:
        """The engine's ``vae.encode``, or its row-split equivalent (every rank calls it and gets
        the whole result; with ``height``, each rank gives only its band of the videos)."""
        if split:
            from wan_s2v_runner.vae_split import split_encode
            return torch.stack(split_encode(self.s2v.vae, videos, dst=None, height=height))
        return torch.stack(self.s2v.vae.encode(videos))

    def _decode(self, zs, split: bool, height: int, keep: Callable[[torch.Tensor], torch.Tensor]
                ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``keep`` (a slice of frames) of the engine's ``vae.decode``: (the whole frames on the
        decoding rank, else None; with ``split``, this rank's row band of them, else None). Only
        the kept frames are gathered, on the decoding rank only: the next motion encode reads the
        bands (upstream decodes a clip's motion frames as well, ~10x the frames it keeps)."""
        if not split:
            return keep(torch.stack(self.s2v.vae.decode(zs))), None
        from wan_s2v_runner.vae_split import decode_bands, gather_bands
        band = keep(torch.stack(decode_bands(self.s2v.vae, zs))).contiguous()  # a copy: frees the rest
        whole = gather_bands(self.s2v.vae, band, height, dst=0)
        return (torch.stack(whole) if whole is not None else None), band

    def _encode_reference(self, req: Request, size, split: bool):
        """Upstream's reference-image and initial-motion encodes (speech2video L461-507).
        Returns (ref latents, motion latents, drop_first_motion, initial last frames)."""
        s2v = self.s2v
        HEIGHT, WIDTH = size
        motion_latents = torch.zeros([1, 3, s2v.motion_frames, HEIGHT, WIDTH], dtype=self.param_dtype,
                                     device=self.device)
        ref_pixel_values = reference_pixels(req.ref_image_path, size, s2v.vae)
        with torch.no_grad():
            ref_latents = self._encode(ref_pixel_values, split)
            # upstream keeps videos_last_frames = motion_latents.detach(): the same storage, so
            # the reference pixels written below are in it too
            last_frames = motion_latents.detach()
            drop_first_motion = s2v.drop_first_motion
            if req.init_first_frame:
                drop_first_motion = False
                motion_latents[:, :, -6:] = ref_pixel_values
            if drop_first_motion and self._dropped_motion_unread():
                # the first clip's motion tokens are dropped, and nothing else reads these latents:
                # the 73-frame encode is skipped, its shape kept (the decode starts from ref_latents)
                motion_latents = torch.zeros(
                    [1, s2v.vae.model.z_dim, (s2v.motion_frames + 3) // 4, HEIGHT // 8, WIDTH // 8],
                    dtype=torch.float32, device=self.device)
            else:
                motion_latents = self._encode(motion_latents, split)
        return ref_latents, motion_latents, drop_first_motion, last_frames

    def _dropped_motion_unread(self) -> bool:
        """Whether the DiT reads nothing of the motion latents of a clip whose motion frames are
        dropped (``drop_motion_frames``): its frame-pack path (S2V-14B) slices the packed motion
        tokens to length 0 and the plain path returns none, both before any value is used
        (model_s2v ``process_motion_frame_pack`` / ``process_motion``); the motioner path
        (``enable_motioner``) computes from them and multiplies by 0.0, so it keeps the encode."""
        return self.parts.dit_attr("enable_motioner", True) is False

    def _texts(self, req: Request) -> tuple[str, str]:
        return req.prompt, req.n_prompt or self.s2v.sample_neg_prompt

    def _text_news(self, req: Request) -> dict:
        """The text-encode stage's data: how many of the two texts T5 encodes (0: both reused), and
        where T5 runs (``cpu``: the hybrid mode's or ``--t5-cpu``, never moved to the device)."""
        return {"texts_encoded": len(self.texts.new(self._texts(req))),
                "t5_device": "cpu" if self.s2v.t5_cpu else self.device.type}

    def _encode_text(self, req: Request):
        """Upstream's prompt and negative-prompt encodes (:func:`~wan_s2v_runner.rank.encoders.encode_texts`)."""
        context, context_null = encode_texts(self.parts, self.texts, self.device, self._texts(req), req.offload_model)
        return context, context_null

    def initial_state(self, enc: Encoded) -> ClipState:
        return ClipState(clip=0, motion_latents=enc.motion_latents, videos_last_frames=enc.last_frames)

    # ----- clips -----
    def _scheduler(self, req: Request):
        from wan.utils.fm_solvers import FlowDPMSolverMultistepScheduler, get_sampling_sigmas, retrieve_timesteps
        from wan.utils.fm_solvers_unipc import FlowUniPCMultistepScheduler
        n = self.s2v.num_train_timesteps
        if req.sample_solver == 'unipc':
            sched = FlowUniPCMultistepScheduler(num_train_timesteps=n, shift=1, use_dynamic_shifting=False)
            sched.set_timesteps(req.sampling_steps, device=self.device, shift=req.shift)
            return sched, sched.timesteps
        if req.sample_solver == 'dpm++':
            sched = FlowDPMSolverMultistepScheduler(num_train_timesteps=n, shift=1, use_dynamic_shifting=False)
            timesteps, _ = retrieve_timesteps(sched, device=self.device,
                                              sigmas=get_sampling_sigmas(req.sampling_steps, req.shift))
            return sched, timesteps
        raise NotImplementedError("Unsupported solver.")

    def _denoise_pred(self, latent_model_input, timestep, arg_c, arg_null, guide_scale):
        """One step's noise prediction: both CFG passes here, or this rank's pass + exchange."""
        model = self.parts.noise_model
        plan = self.plan
        if guide_scale <= 1:
            return model(latent_model_input, t=timestep, **arg_c)
        if plan.layout.cfg_degree == 1:
            noise_pred_cond = model(latent_model_input, t=timestep, **arg_c)
            noise_pred_uncond = model(latent_model_input, t=timestep, **arg_null)
        else:
            mine = model(latent_model_input, t=timestep, **(arg_c if plan.cfg_rank == 0 else arg_null))[0]
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine.contiguous(), group=plan.cfg_group)
            noise_pred_cond, noise_pred_uncond = [both[0]], [both[1]]
        return [u + guide_scale * (c - u) for c, u in zip(noise_pred_cond, noise_pred_uncond)]

    def run_clips(self, req: Request, enc: Encoded, state: ClipState, sink: Optional[ClipSink] = None) -> None:
        """Clips ``state.clip`` .. ``num_repeat - 1``; the decoding rank hands each to ``sink``
        (default: ``hooks.sink``)."""
        s2v, plan, h = self.s2v, self.plan, self.hooks
        HEIGHT, WIDTH = enc.height, enc.width
        infer_frames = req.infer_frames
        seed = req.seed if req.seed >= 0 else random.randint(0, sys.maxsize)
        lat_motion_frames = (s2v.motion_frames + 3) // 4
        lat_target_frames = (infer_frames + 3 + s2v.motion_frames) // 4 - lat_motion_frames
        target_shape = [lat_target_frames, HEIGHT // 8, WIDTH // 8]
        max_seq_len = np.prod(target_shape) // 4
        # upstream without a pose video: COND[0] * 0 from a VAE encode of -1 frames: zeros of that shape
        cond_latents = torch.zeros([1, 16, lat_target_frames, HEIGHT // 8, WIDTH // 8],
                                   dtype=self.param_dtype, device=self.device)
        drop_first_motion = enc.drop_first_motion
        split_vae = plan.layout.splits_vae(HEIGHT)
        vae_here = plan.decodes or split_vae  # this rank takes part in decode and motion re-encode
        pose = self._pose_condition(req, enc, split_vae) if req.pose_video and vae_here else None
        motion_latents, videos_last_frames = state.motion_latents, state.videos_last_frames
        last_band = None  # split VAE: this rank's rows of videos_last_frames, which only rank 0 keeps whole
        if split_vae:
            from wan_s2v_runner.vae_split import own_band
            last_band = own_band(s2v.vae, videos_last_frames) if videos_last_frames is not None else None
            if not plan.decodes:
                videos_last_frames = None

        def clip_frames(image, drop: bool):  # the frames a clip adds (upstream's slicing of its decode)
            image = image[:, :, -(infer_frames):]
            return image[:, :, 3:] if drop else image

        def roll(last, image):  # upstream's update of the last motion_frames frames
            overlap_frames_num = min(s2v.motion_frames, image.shape[2])
            if last is None:  # a resume's, where this clip's frames replace every one of them (ClipState)
                assert overlap_frames_num == s2v.motion_frames, "a resume without the last frames it reads"
                last = image[:, :, -overlap_frames_num:]
            else:
                last = torch.cat([last[:, :, overlap_frames_num:], image[:, :, -overlap_frames_num:]], dim=2)
            return last.to(dtype=motion_latents.dtype, device=motion_latents.device)

        setting = cache_policy.parse(req.cache)
        sink = (sink or h.sink) if plan.decodes else None
        autocast = torch.amp.autocast(self.device.type, dtype=self.param_dtype, enabled=self.device.type == "cuda")
        with autocast, torch.no_grad():
            for r in range(state.clip, enc.num_repeat):
                if req.pose_video:  # upstream: COND[r], the r-th chunk of the pose frames, encoded
                    h.stage(Stage.POSE_ENCODE, clip=r + 1, clips=enc.num_repeat)
                    cond_latents = pose.latents(r) if pose is not None else None
                    if plan.layout.world_size > 1 and not split_vae:
                        cond_latents = broadcast_tensors({"c": cond_latents} if plan.decodes else {}, src=0,
                                                         device=self.device)["c"]
                seed_g = torch.Generator(device=self.device)
                seed_g.manual_seed(seed + r)
                noise = [torch.randn(16, *target_shape, dtype=self.param_dtype, device=self.device,
                                     generator=seed_g)]
                sample_scheduler, timesteps = self._scheduler(req)
                latents = deepcopy(noise)
                left_idx, right_idx = r * infer_frames, r * infer_frames + infer_frames
                audio_input = enc.audio_emb[..., left_idx:right_idx]
                input_motion_latents = motion_latents.clone()
                drop = drop_first_motion and r == 0
                arg_c = {'context': enc.context[0:1], 'seq_len': max_seq_len, 'cond_states': cond_latents,
                         "motion_latents": input_motion_latents, 'ref_latents': enc.ref_latents,
                         "audio_input": audio_input, "motion_frames": [s2v.motion_frames, lat_motion_frames],
                         "drop_motion_frames": drop}
                arg_null = {**arg_c, 'context': enc.context_null[0:1], "audio_input": 0.0 * audio_input}
                streamed = block_stream.streamer_of(self.parts.noise_model) is not None  # never moved whole
                if (req.offload_model or s2v.init_on_cpu) and not streamed:
                    self.parts.noise_model.to(self.device)
                    self._empty_cache()
                h.stage(Stage.DENOISE, clip=r + 1, clips=enc.num_repeat, steps=len(timesteps))
                cache = StepCache.for_clip(setting, len(timesteps), self.device)
                for i, t in enumerate(timesteps):
                    timestep = torch.stack([t]).to(self.device)
                    predicted = cache.reuse(i, latents[0]) if cache is not None else None
                    if predicted is not None:  # --cache: this step reuses the last computed one (no DiT pass)
                        noise_pred = [predicted]
                    else:
                        try:
                            noise_pred = self._denoise_pred(latents[0:1], timestep, arg_c, arg_null, req.guide_scale)
                        except NonFiniteActivation as e:  # fp16's guard (every rank raises here): which step
                            raise e.at(i + 1, len(timesteps), r + 1) from None
                        if cache is not None:
                            cache.computed(i, latents[0], noise_pred[0])
                    temp_x0 = sample_scheduler.step(noise_pred[0].unsqueeze(0), t, latents[0].unsqueeze(0),
                                                    return_dict=False, generator=seed_g)[0]
                    latents[0] = temp_x0.squeeze(0)
                    h.step(clip=r + 1, clips=enc.num_repeat, step=i + 1, steps=len(timesteps),
                           **(self._cache_counters(cache, predicted is not None) if cache is not None else {}))
                if cache is not None:
                    self.cache_records.append(cache.record(r + 1))
                    if h.cache_done is not None:
                        h.cache_done(self.cache_records[-1])
                    del cache  # its latent copies, before the decode
                if req.offload_model and not streamed:
                    self.parts.noise_model.cpu()
                    self._empty_cache(sync=True)
                latents = torch.stack(latents)
                if not vae_here:  # waits for the decoding rank (its next motion latents, or the end)
                    h.stage(Stage.RECEIVE_MOTION, clip=r + 1, clips=enc.num_repeat)
                else:
                    h.stage(Stage.DECODE, clip=r + 1, clips=enc.num_repeat)
                    decode_latents = torch.cat([ref_latents_or_motion(drop, enc.ref_latents, motion_latents), latents],
                                               dim=2)
                    image, image_band = self._decode(decode_latents, split_vae, HEIGHT,
                                                     lambda video: clip_frames(video, drop))  # noqa: B023
                    if image is not None:
                        videos_last_frames = roll(videos_last_frames, image)
                    if image_band is not None:
                        last_band = roll(last_band, image_band)
                    if sink is not None:  # the frames leave the loop: it keeps only the last ones, as float
                        sink.frames(r, image.cpu(), enc.num_repeat)
                    del image, image_band
                last = r == enc.num_repeat - 1
                if not last:  # upstream also re-encodes after the last clip, for nothing
                    if vae_here:
                        h.stage(Stage.MOTION_ENCODE, clip=r + 1, clips=enc.num_repeat)
                        motion_latents = (self._encode(last_band, True, HEIGHT) if split_vae
                                          else self._encode(videos_last_frames, False))
                    if plan.layout.world_size > 1 and not split_vae:
                        motion_latents = broadcast_tensors({"m": motion_latents} if plan.decodes else {}, src=0,
                                                           device=self.device)["m"]
                if sink is not None:
                    h.stage(Stage.CLIP_CHECKPOINT, clip=r + 1, clips=enc.num_repeat)
                    keep = videos_last_frames if infer_frames < s2v.motion_frames else None  # read again?
                    sink.clip_done(ClipState(r + 1, None if last else motion_latents, keep), enc.num_repeat)
                trim_heap()  # what the clip freed goes back: a long run's resident set stays a clip's
                if not last and plan.layout.world_size > 1:
                    # no rank starts the next clip before the clip's checkpoint is written: one that
                    # failed there at once had every rank stopped while the decoding rank wrote it,
                    # and the run lost the clip (seen: rank 1 raised 5 ms before rank 0 began writing)
                    dist.barrier()
        if pose is not None:
            pose.close()
        if dist.is_initialized():
            dist.barrier()

    def _cache_counters(self, cache: StepCache, reused: bool) -> dict:
        """A step's progress data under ``--cache``: whether it reused a computed step, and how
        many of this job's steps so far did (every clip's)."""
        return {"reused": reused,
                "reused_steps": len(cache.reused_steps) + sum(len(c["reused"]) for c in self.cache_records)}

    def _pose_condition(self, req: Request, enc: Encoded, split_vae: bool):
        """The pose video's per-clip condition (:mod:`~wan_s2v_runner.rank.pose`), encoded by this
        rank's share of the VAE work."""
        from wan_s2v_runner.rank.pose import PoseCondition

        height = enc.height
        if split_vae:
            from wan_s2v_runner.vae_split import own_band
            band = lambda x: own_band(self.s2v.vae, x)  # noqa: E731
        else:
            band = lambda x: x  # noqa: E731
        return PoseCondition(req.pose_video, (enc.height, enc.width), req.infer_frames, enc.num_repeat,
                             self.param_dtype, self.device, band=band,
                             encode=lambda px: self._encode(px, split_vae, height if split_vae else None))

    def _empty_cache(self, sync: bool = False) -> None:
        if self.device.type == "cuda":
            if sync:
                torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def generate(self, req: Request, resuming: bool = False,
                 resume: Optional[ClipState] = None) -> Optional[torch.Tensor]:
        """Run the job: the decoding rank hands each clip to ``hooks.sink``; without one, the frames
        (3, N, H, W) in [-1, 1] are returned there (:class:`FramesInMemory`), None elsewhere.
        ``resuming`` (every rank): continue from a checkpoint; ``resume`` (decoding rank): the
        state after the last complete clip."""
        kept = FramesInMemory() if self.plan.decodes and self.hooks.sink is None else None
        enc = self.encode(req)
        state = self.initial_state(enc)
        if resuming:
            split_vae = self.plan.layout.splits_vae(enc.height)  # then every rank needs the last frames
            mine = {}
            if self.plan.decodes:
                state = resume
                # a run whose clips were all written has no next motion latents: nothing is generated
                motion = state.motion_latents if state.motion_latents is not None else enc.motion_latents
                mine = {"motion": motion.to(self.device),
                        "clip": torch.tensor([state.clip], dtype=torch.int64)}
                if split_vae and state.videos_last_frames is not None:
                    mine["last"] = state.videos_last_frames.to(self.device)
            got = broadcast_tensors(mine, src=0, device=self.device) if self.plan.layout.world_size > 1 else mine
            if split_vae:
                last = got.get("last")
            else:
                last = (state.videos_last_frames.to(self.device)
                        if self.plan.decodes and state.videos_last_frames is not None else None)
            state = ClipState(int(got["clip"].item()), got["motion"], last)
        if self.parts.dit_loading:  # read on its thread while the encoders ran: joined here, on every rank
            if self.parts.pending.reading:
                self.hooks.stage(Stage.LOAD, what="WanModel_S2V")
            self.parts.ready()
        self.run_clips(req, enc, state, sink=kept)
        return kept.video() if kept is not None else None


def reference_pixels(path: str, size, vae) -> torch.Tensor:
    """Upstream's reference image for the VAE (speech2video L461-476): resized to the short side,
    center-cropped to ``size`` (H, W), in [-1, 1], [1, 3, 1, H, W] in the VAE's dtype and device."""
    from PIL import Image
    from torchvision import transforms

    height, width = size
    pic = transforms.CenterCrop((height, width))(transforms.Resize(min(height, width))(
        Image.fromarray(np.array(Image.open(path).convert('RGB')))))
    pixels = transforms.ToTensor()(pic).unsqueeze(1).unsqueeze(0) * 2 - 1.0
    return pixels.to(dtype=vae.dtype, device=vae.device)


def ref_latents_or_motion(drop: bool, ref_latents, motion_latents):
    """Upstream decodes the first clip after the reference latents when its motion is dropped,
    every other clip after the motion latents."""
    return ref_latents if drop else motion_latents
