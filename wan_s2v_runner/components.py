"""Load the engine's parts a rank needs, the way ``WanS2V.__init__`` does, and no more.

Upstream's ``__init__`` loads T5, the VAE, the DiT and wav2vec2 on every rank. We replay its
steps (same classes from ``wan.speech2video``, same arguments, same ``_configure_model`` for the
DiT: Ulysses rebinding, barrier, FSDP sharding), but only for the parts this rank's plan needs
(:class:`~wan_s2v_runner.parallel.RankPlan`): rank 0 loads T5 (unless it is FSDP-sharded, when
every rank does), wav2vec2 and the VAE; every rank loads the DiT. The result is a ``WanS2V``
built with ``__new__`` and the same attributes, so our loop calls upstream's own helper methods
(``encode_audio``, ``get_gen_size``, ...) on it. The DiT gets ``patches.context_cache``: its text
embedding and cross-attention keys/values are computed once per context, not at every step.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from patches import context_cache
from wan_s2v_runner.ckpt_layout import WAV2VEC_DIR

log = logging.getLogger("wan_s2v.components")


@dataclass
class Components:
    shell: Any  # a WanS2V (made with __new__) holding the loaded parts and their settings

    @property
    def noise_model(self):
        return self.shell.noise_model

    @property
    def device(self) -> torch.device:
        return self.shell.device

    @property
    def param_dtype(self) -> torch.dtype:
        return self.shell.param_dtype


def load(wan, config, ckpt_dir: str, plan, device: torch.device, device_id: int) -> Components:
    """The parts ``plan`` needs, loaded as ``WanS2V.__init__`` would load them."""
    s2v_mod = wan.speech2video
    lay = plan.layout
    self = s2v_mod.WanS2V.__new__(s2v_mod.WanS2V)
    self.device = device
    self.config = config
    self.rank = plan.rank
    self.t5_cpu = lay.t5_cpu
    self.init_on_cpu = True
    self.num_train_timesteps = config.num_train_timesteps
    self.param_dtype = config.param_dtype
    if lay.t5_fsdp or lay.dit_fsdp or lay.use_sp:
        self.init_on_cpu = False
    # looked up at call time: patches.fsdp_no_sync rebinds shard_model in wan.speech2video
    shard_fn = partial(_shard, s2v_mod, device_id=device_id)

    self.text_encoder = None
    if plan.needs_t5:
        self.text_encoder = s2v_mod.T5EncoderModel(
            text_len=config.text_len, dtype=config.t5_dtype, device=torch.device('cpu'),
            checkpoint_path=os.path.join(ckpt_dir, config.t5_checkpoint),
            tokenizer_path=os.path.join(ckpt_dir, config.t5_tokenizer),
            shard_fn=shard_fn if lay.t5_fsdp else None)
    self.vae = None
    if plan.needs_vae:
        self.vae = s2v_mod.Wan2_1_VAE(vae_pth=os.path.join(ckpt_dir, config.vae_checkpoint), device=self.device)
    if not lay.dit_fsdp:
        noise_model = s2v_mod.WanModel_S2V.from_pretrained(ckpt_dir, torch_dtype=self.param_dtype,
                                                           device_map=self.device)
    else:
        noise_model = s2v_mod.WanModel_S2V.from_pretrained(ckpt_dir, torch_dtype=self.param_dtype)
    self.noise_model = self._configure_model(model=noise_model, use_sp=lay.use_sp, dit_fsdp=lay.dit_fsdp,
                                             shard_fn=shard_fn, convert_model_dtype=False)
    context_cache.apply(self.noise_model)
    self.audio_encoder = None
    if plan.needs_audio_encoder:
        self.audio_encoder = s2v_mod.AudioEncoder(model_id=os.path.join(ckpt_dir, WAV2VEC_DIR))
    self.sp_size = lay.sp_degree
    self.sample_neg_prompt = config.sample_neg_prompt
    self.motion_frames = config.transformer.motion_frames
    self.drop_first_motion = config.drop_first_motion
    self.fps = config.sample_fps
    self.audio_sample_m = 0
    log.info("rank %d loaded %s", plan.rank, ", ".join(plan.describe()["loads"]))
    return Components(self)


def _shard(s2v_mod, model, device_id, **kwargs):
    return s2v_mod.shard_model(model, device_id=device_id, **kwargs)
