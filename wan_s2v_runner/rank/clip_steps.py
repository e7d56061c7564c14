"""The clip recipe's step driver: upstream ``WanS2V.generate``'s clips, every rank at every
denoising step, re-expressed with a parallel plan (CFG x sequence parallel) and every piece of work
done once. Driven by the job shell (:mod:`~wan_s2v_runner.rank.job_shell`: inputs, DiT join,
precision, end).

Built from the engine's own parts (its DiT, VAE and schedulers, ``WanS2V``'s helper methods), in
upstream's order and numerics: per clip a generator on the run's device seeded ``seed + clip``, the
same noise, scheduler, CFG combine ``u + g * (c - u)`` and decode/re-encode. Upstream's ``generate``
stays the reference (tests/test_generation.py: the shell with this driver == upstream exactly).
Three parts a clip:

* :class:`ClipInputs`: the clip's noise, scheduler and the DiT's arguments (both CFG branches);
* :class:`Denoiser`: the steps: both CFG passes here, or this rank's pass and one all-gather with
  its CFG peer (``--cfg-parallel``); ``--cache``'s reuse of the last computed step
  (:mod:`~wan_s2v_runner.rank.step_cache`); and one step message at each step's end
  (:class:`~wan_s2v_runner.rank.step_control.Lockstep`: the served stop, the cache's decision and
  fp16's faults, agreed by every rank);
* :class:`ClipOutput`: the decode (split by rows over every rank with ``--vae-parallel``: each
  rank decodes its band and the decoding rank gathers the kept frames), the frames to the sink,
  the motion re-encode of the last frames for the next clip, the clip's checkpoint.

Where upstream's work is skipped or moved: the pose-condition VAE encode that upstream multiplies
by zero without a pose video is not run (its zeros are made); with ``--pose-video`` each clip's
condition is read and encoded just before it (:mod:`~wan_s2v_runner.rank.pose`); the initial-motion
encode is not run where the first clip drops its motion frames and the DiT never reads them
(:meth:`ClipSteps._dropped_motion_unread`); the re-encode after the last clip is not run.
"""
from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from wan_s2v_runner.loading.components import DitPlacement
from wan_s2v_runner.rank.job_contract import Inputs, Reference, Request, broadcast_tensors
from wan_s2v_runner.rank.step_cache import StepCache
from wan_s2v_runner.rank.step_control import Lockstep
from wan_s2v_runner.shared import cache_policy
from wan_s2v_runner.shared.dit_cost import motion_latent_frames
from wan_s2v_runner.shared.events import ProgressUnit
from wan_s2v_runner.shared.job_time import cfg_on
from wan_s2v_runner.shared.procfs import trim_heap
from wan_s2v_runner.shared.stages import Stage


@dataclass
class ClipState:
    """What one clip hands the next: small, and all a resume needs (the clips so far are in the
    video file)."""

    clip: int  # index of the next clip to generate
    motion_latents: torch.Tensor
    #: [1, 3, 73, H, W]: only the decoding rank has it; None where no later clip reads it (a
    #: resume where each clip's frames replace all of them: ``infer_frames`` >= the motion frames)
    videos_last_frames: Optional[torch.Tensor]


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


class VaeWork:
    """The VAE's encode and decode as this rank takes part in them: the engine's, or split by
    row bands over every rank (``--vae-parallel``: :mod:`~wan_s2v_runner.vae_split`, exact)."""

    def __init__(self, s2v, decoding_rank: int):
        self.s2v, self.decoding_rank = s2v, decoding_rank

    def encode(self, videos, split: bool, height: Optional[int] = None) -> torch.Tensor:
        """The engine's ``vae.encode``, or its row-split equivalent (every rank calls it and gets
        the whole result; with ``height``, each rank gives only its band of the videos)."""
        if split:
            from wan_s2v_runner.vae_split import split_encode
            return torch.stack(split_encode(self.s2v.vae, videos, dst=None, height=height))
        return torch.stack(self.s2v.vae.encode(videos))

    def decode(self, zs, split: bool, height: int, keep: Callable[[torch.Tensor], torch.Tensor]
               ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``keep`` (a slice of frames) of the engine's ``vae.decode``: (the whole frames on the
        decoding rank, else None; with ``split``, this rank's row band of them, else None). Only
        the kept frames are gathered, on the decoding rank only: the next motion encode reads the
        bands (upstream decodes a clip's motion frames as well, ~10x the frames it keeps)."""
        if not split:
            return keep(torch.stack(self.s2v.vae.decode(zs))), None
        from wan_s2v_runner.vae_split import decode_bands, gather_bands
        band = keep(torch.stack(decode_bands(self.s2v.vae, zs))).contiguous()  # a copy: frees the rest
        whole = gather_bands(self.s2v.vae, band, height, dst=self.decoding_rank)
        return (torch.stack(whole) if whole is not None else None), band

    def own_band(self, frames: torch.Tensor) -> torch.Tensor:
        from wan_s2v_runner.vae_split import own_band
        return own_band(self.s2v.vae, frames)


# --------------------------------------------------------------------------- one clip's inputs
@dataclass
class ClipInputs:
    """One clip's noise, scheduler, timesteps and the DiT's arguments (conditional, unconditional)."""

    index: int  # 0-based
    latents: list
    scheduler: object
    timesteps: object
    generator: torch.Generator
    arg_c: dict
    arg_null: dict


class ClipSteps:
    """The clip recipe's driver (:class:`~wan_s2v_runner.rank.job_contract.StepDriver`)."""

    unit = ProgressUnit.CLIP
    flag_names = ("drop_first_motion",)
    #: the speech is encoded with the inputs (upstream's whole-file pass)
    encodes_speech = True

    def __init__(self, shell):
        """``shell``: the :class:`~wan_s2v_runner.rank.job_shell.JobShell` it runs in."""
        self.shell, self.parts, self.plan, self.hooks = shell, shell.parts, shell.plan, shell.hooks
        self.s2v, self.device, self.param_dtype = shell.s2v, shell.device, shell.param_dtype
        self.vae = VaeWork(self.s2v, self.plan.layout.decoding_rank)
        #: with --cache: per clip generated, the steps computed and reused (:meth:`StepCache.record`)
        self.cache_records: list[dict] = []
        self.cache: Optional[str] = None

    # ----- what the shell encodes
    def texts(self, req: Request) -> tuple[str, str]:
        return req.prompt, req.n_prompt or self.s2v.sample_neg_prompt

    def speech_frames(self, req: Request) -> int:
        return req.infer_frames

    def reference(self, req: Request, size, split: bool) -> Reference:
        """Upstream's reference-image and initial-motion encodes (speech2video L461-507)."""
        s2v = self.s2v
        height, width = size
        motion_pixels = torch.zeros([1, 3, s2v.motion_frames, height, width], dtype=self.param_dtype,
                                    device=self.device)
        ref_pixel_values = reference_pixels(req.ref_image_path, size, s2v.vae)
        with torch.no_grad():
            ref_latents = self.vae.encode(ref_pixel_values, split)
            # upstream keeps videos_last_frames = motion_latents.detach(): the same storage, so
            # the reference pixels written below are in it too
            last_frames = motion_pixels.detach()
            drop_first_motion = s2v.drop_first_motion
            if req.init_first_frame:
                drop_first_motion = False
                motion_pixels[:, :, -6:] = ref_pixel_values
            if drop_first_motion and self._dropped_motion_unread():
                # the first clip's motion tokens are dropped, and nothing else reads these latents:
                # the 73-frame encode is skipped, its shape kept (the decode starts from ref_latents)
                motion_latents = torch.zeros(
                    [1, s2v.vae.model.z_dim, motion_latent_frames(s2v.motion_frames), height // 8, width // 8],
                    dtype=torch.float32, device=self.device)
            else:
                motion_latents = self.vae.encode(motion_pixels, split)
        return Reference({"ref_latents": ref_latents, "motion_latents": motion_latents},
                         {"drop_first_motion": int(drop_first_motion)}, {"last_frames": last_frames})

    def _dropped_motion_unread(self) -> bool:
        """Whether the DiT reads nothing of the motion latents of a clip whose motion frames are
        dropped (``drop_motion_frames``): its frame-pack path (S2V-14B) slices the packed motion
        tokens to length 0 and the plain path returns none, both before any value is used
        (model_s2v ``process_motion_frame_pack`` / ``process_motion``); the motioner path
        (``enable_motioner``) computes from them and multiplies by 0.0, so it keeps the encode."""
        return self.parts.dit_attr("enable_motioner", True) is False

    # ----- the job
    def run(self, req: Request, inputs: Inputs, sink, resuming: bool, resume) -> None:
        num_repeat = inputs.units if req.num_repeat is None or req.num_repeat > inputs.units else req.num_repeat
        state = self._start_state(inputs, resuming, resume)
        self.cache = req.cache
        out = ClipOutput(self, req, inputs, state, sink, num_repeat)
        denoiser = Denoiser(self, req, num_repeat)
        try:
            for r in range(state.clip, num_repeat):
                clip = self._clip_inputs(req, inputs, r, out.motion_latents, out.condition(r))
                latents = denoiser.run(clip)
                out.finish(r, latents)
        finally:
            out.close()

    def _start_state(self, inputs: Inputs, resuming: bool, resume: Optional[ClipState]) -> ClipState:
        """The first clip's state, or a resume's (every rank hears the decoding rank's)."""
        state = ClipState(0, inputs.latents["motion_latents"], inputs.local.get("last_frames"))
        if not resuming:
            return state
        plan = self.plan
        split_vae = plan.layout.splits_vae(inputs.height)  # then every rank needs the last frames
        mine = {}
        if plan.decodes:
            state = resume
            # a run whose clips were all written has no next motion latents: nothing is generated
            motion = state.motion_latents if state.motion_latents is not None else inputs.latents["motion_latents"]
            mine = {"motion": motion.to(self.device), "clip": torch.tensor([state.clip], dtype=torch.int64)}
            if split_vae and state.videos_last_frames is not None:
                mine["last"] = state.videos_last_frames.to(self.device)
        got = (broadcast_tensors(mine, src=plan.layout.decoding_rank, device=self.device)
               if plan.layout.world_size > 1 else mine)
        if split_vae:
            last = got.get("last")
        else:
            last = (state.videos_last_frames.to(self.device)
                    if plan.decodes and state.videos_last_frames is not None else None)
        return ClipState(int(got["clip"].item()), got["motion"], last)

    def _clip_inputs(self, req: Request, inputs: Inputs, r: int, motion_latents, cond_latents) -> ClipInputs:
        """Clip ``r``'s noise (``seed + r``), scheduler and DiT arguments, as upstream makes them."""
        s2v = self.s2v
        lat_motion_frames = motion_latent_frames(s2v.motion_frames)
        target_shape = self._target_shape(req, inputs)
        seed_g = torch.Generator(device=self.device)
        seed_g.manual_seed(req.seed + r)
        noise = [torch.randn(16, *target_shape, dtype=self.param_dtype, device=self.device, generator=seed_g)]
        scheduler, timesteps = self._scheduler(req)
        audio_input = inputs.audio_emb[..., r * req.infer_frames:(r + 1) * req.infer_frames]
        context, context_null = inputs.contexts
        arg_c = {'context': context[0:1], 'seq_len': np.prod(target_shape) // 4, 'cond_states': cond_latents,
                 "motion_latents": motion_latents.clone(), 'ref_latents': inputs.latents["ref_latents"],
                 "audio_input": audio_input, "motion_frames": [s2v.motion_frames, lat_motion_frames],
                 "drop_motion_frames": bool(inputs.flags["drop_first_motion"]) and r == 0}
        arg_null = {**arg_c, 'context': context_null[0:1], "audio_input": 0.0 * audio_input}
        return ClipInputs(r, deepcopy(noise), scheduler, timesteps, seed_g, arg_c, arg_null)

    def _target_shape(self, req: Request, inputs: Inputs) -> list[int]:
        """A clip's latents: [latent frames, H/8, W/8] (upstream's frame arithmetic)."""
        lat_motion_frames = motion_latent_frames(self.s2v.motion_frames)
        lat_target_frames = (req.infer_frames + 3 + self.s2v.motion_frames) // 4 - lat_motion_frames
        return [lat_target_frames, inputs.height // 8, inputs.width // 8]

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

    def record(self) -> dict:
        """``step_cache``: what --cache did over the job's clips (None without it)."""
        return {"step_cache": cache_policy.summary(self.cache, self.cache_records) if self.cache_records else None}


# --------------------------------------------------------------------------- the steps
class Denoiser:
    """A clip's denoising steps on this rank: the CFG passes, the step cache, the step control."""

    def __init__(self, driver: ClipSteps, req: Request, num_clips: int):
        self.driver, self.req, self.num_clips = driver, req, num_clips
        self.parts, self.plan, self.hooks, self.device = driver.parts, driver.plan, driver.hooks, driver.device
        self.setting = cache_policy.parse(req.cache)
        self.control = Lockstep(self.device, self.hooks.stop_requested, self.parts.guard, self.setting.reuses)
        self.offloads = req.offload_model and self.parts.placement is not DitPlacement.STREAMED

    def run(self, clip: ClipInputs) -> torch.Tensor:
        """The clip's final latents [1, 16, F, H/8, W/8]."""
        h, r = self.hooks, clip.index
        # the DiT moves to the device for a clip's steps when it is held on the host (upstream's
        # init_on_cpu, or --offload-model), never when it is streamed
        if self.parts.placement is DitPlacement.HOST or self.offloads:
            self.parts.noise_model.to(self.device)
            _empty_cache(self.device)
        h.stage(Stage.DENOISE, unit=ProgressUnit.CLIP, clip=r + 1, clips=self.num_clips, steps=len(clip.timesteps))
        cache = StepCache.for_clip(self.setting, len(clip.timesteps), measures=self.plan.rank == 0)
        latents = clip.latents
        measure = -1.0  # the first step is computed
        for i, t in enumerate(clip.timesteps):
            predicted = cache.reuse(i, latents[0], measure) if cache is not None else None
            if predicted is None:
                noise_pred = self._prediction(latents[0:1], torch.stack([t]).to(self.device), clip)
                if cache is not None:
                    cache.computed(i, latents[0], noise_pred[0])
            else:  # --cache: this step reuses the last computed one (no DiT pass)
                noise_pred = [predicted]
            temp_x0 = clip.scheduler.step(noise_pred[0].unsqueeze(0), t, latents[0].unsqueeze(0),
                                          return_dict=False, generator=clip.generator)[0]
            latents[0] = temp_x0.squeeze(0)
            measure = self._end_of_step(i, len(clip.timesteps), r, cache, latents[0], predicted is not None)
        if cache is not None:
            self._cache_done(cache, r)
        if self.offloads:
            self.parts.noise_model.cpu()
            _empty_cache(self.device, sync=True)
        return torch.stack(latents)

    def _end_of_step(self, i: int, steps: int, r: int, cache: Optional[StepCache], x: torch.Tensor,
                     reused: bool) -> float:
        """The step's message, agreed by every rank: a fault or the server's stop ends the job here
        (on every rank); else the step is reported and the next step's cache measure returned."""
        message = self.control.after_step(i, r, cache.measure(i + 1, x) if cache is not None else -1.0)
        if message.fault is not None:
            raise message.error(steps, ProgressUnit.CLIP.value)
        self.hooks.step(unit=ProgressUnit.CLIP, clip=r + 1, clips=self.num_clips, step=i + 1, steps=steps,
                        **(self._cache_counters(cache, reused) if cache is not None else {}))
        if message.stops:
            raise message.error(steps, ProgressUnit.CLIP.value)
        return message.measure

    def _prediction(self, latent_model_input, timestep, clip: ClipInputs) -> list:
        """One step's noise prediction: both CFG passes here, or this rank's pass + exchange."""
        model, plan, guide_scale = self.parts.noise_model, self.plan, self.req.guide_scale
        if not cfg_on(guide_scale):
            return model(latent_model_input, t=timestep, **clip.arg_c)
        if plan.layout.cfg_degree == 1:
            noise_pred_cond = model(latent_model_input, t=timestep, **clip.arg_c)
            noise_pred_uncond = model(latent_model_input, t=timestep, **clip.arg_null)
        else:
            mine = model(latent_model_input, t=timestep, **(clip.arg_c if plan.cfg_rank == 0 else clip.arg_null))[0]
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine.contiguous(), group=plan.cfg_group)
            noise_pred_cond, noise_pred_uncond = [both[0]], [both[1]]
        return [u + guide_scale * (c - u) for c, u in zip(noise_pred_cond, noise_pred_uncond)]

    def _cache_done(self, cache: StepCache, r: int) -> None:
        records = self.driver.cache_records
        records.append(cache.record(r + 1))
        if self.hooks.cache_done is not None:
            self.hooks.cache_done(records[-1])

    def _cache_counters(self, cache: StepCache, reused: bool) -> dict:
        """A step's progress data under ``--cache``: whether it reused a computed step, and how
        many of this job's steps so far did (every clip's)."""
        return {"reused": reused,
                "reused_steps": len(cache.reused_steps) + sum(len(c["reused"]) for c in self.driver.cache_records)}


def _empty_cache(device: torch.device, sync: bool = False) -> None:
    if device.type == "cuda":
        if sync:
            torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- a clip's output
class ClipOutput:
    """After a clip's steps: its decode, frames to the sink, the next clip's motion latents, its
    checkpoint; and the pose condition each clip reads (``--pose-video``)."""

    def __init__(self, driver: ClipSteps, req: Request, inputs: Inputs, state: ClipState, sink, num_clips: int):
        self.driver, self.req, self.inputs, self.sink, self.num_clips = driver, req, inputs, sink, num_clips
        self.s2v, self.plan, self.hooks, self.vae = driver.s2v, driver.plan, driver.hooks, driver.vae
        self.device = driver.device
        self.split = self.plan.layout.splits_vae(inputs.height)
        #: this rank takes part in the decode and the motion re-encode
        self.vae_here = self.plan.decodes or self.split
        self.motion_latents, self.last_frames = state.motion_latents, state.videos_last_frames
        self.last_band = None  # split VAE: this rank's rows of the last frames (whole on the decoding rank only)
        if self.split:
            self.last_band = self.vae.own_band(self.last_frames) if self.last_frames is not None else None
            if not self.plan.decodes:
                self.last_frames = None
        self.pose = self._pose_condition() if req.pose_video and self.vae_here else None
        # upstream without a pose video: COND[0] * 0 from a VAE encode of -1 frames: zeros of that shape
        self.zeros = torch.zeros([1, 16, driver._target_shape(req, inputs)[0], inputs.height // 8, inputs.width // 8],
                                 dtype=driver.param_dtype, device=self.device)

    def condition(self, r: int) -> torch.Tensor:
        """Clip ``r``'s condition latents: upstream's COND[r] (the pose video's r-th chunk, encoded),
        or zeros without a pose video."""
        if not self.req.pose_video:
            return self.zeros
        self.hooks.stage(Stage.POSE_ENCODE, unit=ProgressUnit.CLIP, clip=r + 1, clips=self.num_clips)
        cond = self.pose.latents(r) if self.pose is not None else None
        if self.plan.layout.world_size > 1 and not self.split:
            cond = broadcast_tensors({"c": cond} if self.plan.decodes else {}, src=self.plan.layout.decoding_rank,
                                     device=self.device)["c"]
        return cond

    def finish(self, r: int, latents: torch.Tensor) -> None:
        """Clip ``r`` denoised: decoded, handed on, its motion re-encoded, checkpointed."""
        h, last = self.hooks, r == self.num_clips - 1
        if not self.vae_here:  # waits for the decoding rank (its next motion latents, or the end)
            h.stage(Stage.RECEIVE_MOTION, unit=ProgressUnit.CLIP, clip=r + 1, clips=self.num_clips)
        else:
            self._decode(r, latents)
        if not last:  # upstream also re-encodes after the last clip, for nothing
            self._next_motion(r)
        if self.sink is not None:
            h.stage(Stage.CLIP_CHECKPOINT, unit=ProgressUnit.CLIP, clip=r + 1, clips=self.num_clips)
            keep = self.last_frames if self.req.infer_frames < self.s2v.motion_frames else None  # read again?
            self.sink.clip_done(ClipState(r + 1, None if last else self.motion_latents, keep), self.num_clips)
        trim_heap()  # what the clip freed goes back: a long run's resident set stays a clip's
        if not last and self.plan.layout.world_size > 1:
            # no rank starts the next clip before the clip's checkpoint is written: one that
            # failed there at once had every rank stopped while the decoding rank wrote it,
            # and the run lost the clip (seen: rank 1 raised 5 ms before rank 0 began writing)
            dist.barrier()

    def _decode(self, r: int, latents: torch.Tensor) -> None:
        drop = bool(self.inputs.flags["drop_first_motion"]) and r == 0
        self.hooks.stage(Stage.DECODE, unit=ProgressUnit.CLIP, clip=r + 1, clips=self.num_clips)
        # upstream decodes the first clip after the reference latents when its motion is dropped,
        # every other clip after the motion latents
        before = self.inputs.latents["ref_latents"] if drop else self.motion_latents
        infer_frames = self.req.infer_frames

        def clip_frames(image):  # the frames a clip adds (upstream's slicing of its decode)
            image = image[:, :, -infer_frames:]
            return image[:, :, 3:] if drop else image
        image, band = self.vae.decode(torch.cat([before, latents], dim=2), self.split, self.inputs.height, clip_frames)
        if image is not None:
            self.last_frames = self._roll(self.last_frames, image)
        if band is not None:
            self.last_band = self._roll(self.last_band, band)
        if self.sink is not None:  # the frames leave the loop: it keeps only the last ones, as float
            self.sink.frames(r, image.cpu(), self.num_clips)

    def _roll(self, last, image):
        """Upstream's update of the last ``motion_frames`` frames."""
        overlap = min(self.s2v.motion_frames, image.shape[2])
        if last is None:  # a resume's, where this clip's frames replace every one of them (ClipState)
            assert overlap == self.s2v.motion_frames, "a resume without the last frames it reads"
            last = image[:, :, -overlap:]
        else:
            last = torch.cat([last[:, :, overlap:], image[:, :, -overlap:]], dim=2)
        return last.to(dtype=self.motion_latents.dtype, device=self.motion_latents.device)

    def _next_motion(self, r: int) -> None:
        if self.vae_here:
            self.hooks.stage(Stage.MOTION_ENCODE, unit=ProgressUnit.CLIP, clip=r + 1, clips=self.num_clips)
            self.motion_latents = (self.vae.encode(self.last_band, True, self.inputs.height) if self.split
                                   else self.vae.encode(self.last_frames, False))
        if self.plan.layout.world_size > 1 and not self.split:
            self.motion_latents = broadcast_tensors({"m": self.motion_latents} if self.plan.decodes else {},
                                                    src=self.plan.layout.decoding_rank, device=self.device)["m"]

    def _pose_condition(self):
        """The pose video's per-clip condition (:mod:`~wan_s2v_runner.rank.pose`), encoded by this
        rank's share of the VAE work."""
        from wan_s2v_runner.rank.pose import PoseCondition

        split, height = self.split, self.inputs.height
        band = self.vae.own_band if split else (lambda x: x)
        return PoseCondition(self.req.pose_video, (height, self.inputs.width), self.req.infer_frames,
                             self.num_clips, self.driver.param_dtype, self.device, band=band,
                             encode=lambda px: self.vae.encode(px, split, height if split else None))

    def close(self) -> None:
        if self.pose is not None:
            self.pose.close()
