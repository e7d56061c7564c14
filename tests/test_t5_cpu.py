"""``--t5-cpu`` (issue #73): T5 encodes the prompts on the CPU and never moves to the device, as the
hybrid mode's does, in any mode but fsdp-fixed (whose T5 is sharded on the GPUs); the memory plan
sets it where the GPU cannot hold T5 while it encodes (a 12 GB card: tests/test_owned_machines.py).

What is proven here, in-process on the CPU device (where T5 encodes on the CPU either way, so the
frames are equal by construction, and what is checked is that the flag reaches the rank, takes
the CPU path and moves nothing): the frames equal those without it; the loaded shell says
``t5_cpu``; the model's ``.to`` is never called; the text-encode stage says where T5 ran; an
FSDP-sharded T5 refuses it.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import cpu_engine, one_process_frames


def _load(engine, **updates):
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import engine_config
    from wan_s2v_runner.shared.layout import Layout, Mode
    wan, _, spec = engine
    spec = spec.model_copy(update=updates)
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    return components.load(wan, engine_config(wan, spec), str(spec.ckpt_dir), plan, torch.device("cpu"), 0,
                           components.LoadSettings.of(spec)), spec, plan


def test_the_setting_reaches_the_load():
    from wan_s2v_runner.loading.components import LoadSettings
    from wan_s2v_runner.shared.spec import GroupSpec
    assert LoadSettings.of(GroupSpec(ckpt_dir="/x", t5_cpu=True)).t5_cpu is True
    assert LoadSettings.of(GroupSpec(ckpt_dir="/x")).t5_cpu is False  # unset: the rank reads it as off
    assert LoadSettings.of(GroupSpec(ckpt_dir="/x", t5_cpu=False)).t5_cpu is False


@pytest.mark.slow(seconds=10)
def test_t5_on_the_cpu_changes_no_frame_and_never_moves(tiny_assets):
    from wan_s2v_runner.rank.job_shell import Hooks, JobShell
    from wan_s2v_runner.rank.worker import request_for
    with cpu_engine(tiny_assets) as engine:
        plain = one_process_frames(engine, num_clips=1)
        parts, spec, plan = _load(engine, num_clips=1, t5_cpu=True)
        assert parts.shell.t5_cpu is True
        model = parts.shell.text_encoder.model
        moved, seen = [], []
        to = model.to
        model.to = lambda *a, **k: (moved.append(a), to(*a, **k))[1]  # a spy on its moves
        hooks = Hooks(stage=lambda s, **k: seen.append(k) if str(s) == "text_encode" else None)
        frames = JobShell(parts, plan, hooks).generate(request_for(spec))
        kept, _, _ = _load(engine, num_clips=1)
        assert kept.shell.t5_cpu is False  # ulysses' own: T5 moves to the device to encode
    assert torch.equal(frames, plain)
    assert moved == [] and seen == [{"texts_encoded": 2, "t5_device": "cpu"}]


def test_an_fsdp_sharded_t5_refuses_it():
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.shared.layout import Layout, Mode
    class Shell:  # nothing is read: the setting is refused first
        pass
    wan = SimpleNamespace(speech2video=SimpleNamespace(WanS2V=Shell))
    plan = RankPlan(Layout.for_mode(Mode.FSDP_FIXED, 1), 0)
    with pytest.raises(ValueError, match="--t5-cpu keeps T5 whole on the CPU"):
        components.load(wan, None, "/x", plan, torch.device("cpu"), 0, components.LoadSettings(t5_cpu=True))
