"""Random weights at any size without a second copy: a model built on the meta device, then each
parameter made directly on a device (a GPU makes 16 B parameters in seconds).

Used where the real sizes matter and the tiny checkpoint's way (build the whole model on the CPU,
then redraw every tensor in float64) would need tens of GB and minutes: the real-size random
checkpoint (:mod:`.real_checkpoint`) and ``bench/gpu_step.py``. Values: norm scales ~1, every
other tensor N(0, 0.02), seeded; the arithmetic, not the values, is what these weights are for.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from wan_s2v_runner.shared.dit_cost import motion_latent_frames


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules with parameters on meta; other tensors (the DiT's RoPE tables) stay real."""
    from accelerate import init_empty_weights
    with init_empty_weights():
        yield


def random_tensor(shape, name: str, dtype, device, gen):
    """One parameter's random value (``name`` ending in ``weight`` on a 1-D tensor: a norm scale)."""
    import torch
    t = torch.empty(shape, dtype=torch.float32, device=device)
    t.normal_(0.0, 0.02, generator=gen)
    if len(shape) == 1 and name.endswith("weight"):
        t.add_(1.0)
    return t.to(dtype)


def materialize(model, device, dtype, seed: int = 0) -> int:
    """Give every (meta) parameter of ``model`` a random value made on ``device`` in ``dtype``
    (assigned, so nothing is copied). Returns the weights' bytes."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    sd, total = {}, 0
    for name, p in model.named_parameters():
        sd[name] = random_tensor(p.shape, name, dtype, device, gen)
        total += sd[name].numel() * sd[name].element_size()
    model.load_state_dict(sd, strict=True, assign=True)
    return total


def dit_kwargs(wan, **sizes) -> dict:
    """``WanModel_S2V`` keyword arguments: the engine's S2V-14B transformer config, with ``sizes``
    (dim, ffn_dim, num_heads, num_layers, audio_inject_layers, audio_dim ...) replacing its own."""
    cfg = dict(wan.configs.WAN_CONFIGS["s2v-14B"].transformer)
    cfg.pop("__name__", None)
    cfg.update(sizes)
    return cfg


def random_dit(wan, device, dtype, seed: int = 0, **sizes):
    """(the S2V DiT on ``device`` with random weights, their bytes); ``sizes`` as :func:`dit_kwargs`."""
    import torch
    from wan.modules.s2v.model_s2v import WanModel_S2V

    with on_meta():
        model = WanModel_S2V(**dit_kwargs(wan, **sizes))
    torch.nn.Module.to(model, dtype)  # nn.Module.to: diffusers' .to() warns about fp32-kept modules
    weight_bytes = materialize(model, device, dtype, seed)
    return model.eval().requires_grad_(False), weight_bytes


def random_dit_inputs(audio_dim: int, motion_frames: int, tokens, infer_frames: int, device, dtype,
                      first_clip: bool):
    """(x, t, conditional kwargs, unconditional kwargs) of one DiT step as the generation loop
    passes them for a clip of ``tokens`` (:func:`wan_s2v_runner.preflight.geometry.token_counts`):
    random values, real shapes. ``audio_dim``, ``motion_frames``: the DiT config's (1024, 73);
    ``first_clip``: its motion tokens are dropped."""
    import torch
    lat_motion = motion_latent_frames(motion_frames)
    lh, lw = tokens.height // 8, tokens.width // 8
    f = tokens.latent_frames
    g = torch.Generator(device=device).manual_seed(1)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    audio = rnd(1, 25, audio_dim, infer_frames)
    common = {"seq_len": f * lh * lw // 4, "cond_states": torch.zeros(1, 16, f, lh, lw, dtype=dtype, device=device),
              "motion_latents": rnd(1, 16, lat_motion, lh, lw), "ref_latents": rnd(1, 16, 1, lh, lw),
              "motion_frames": [motion_frames, lat_motion], "drop_motion_frames": first_clip}
    cond = {**common, "context": [rnd(80, 4096)], "audio_input": audio}
    uncond = {**common, "context": [rnd(120, 4096)], "audio_input": 0.0 * audio}
    x = [rnd(16, f, lh, lw)]
    t = torch.tensor([999.0], device=device)
    return x, t, cond, uncond
