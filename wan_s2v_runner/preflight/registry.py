"""The check registry: every preflight check, in one explicit ordered list, and how to run them.

Which groups a run needs follows from its layout (:func:`groups_for`): every run gets the
common groups; a sequence-parallel mode adds ``ulysses_degree``; a mode that shards weights
adds ``fsdp``; the step pipeline (``--mode live``) adds ``live``. Order here is display order
(groups in :class:`CheckGroup` order, then the order below). A check that raises is reported as
a warning naming the exception: a bug in a check must neither block a run nor hide the other
results.
"""
from __future__ import annotations

import time
from typing import Iterable

from wan_s2v_runner.shared.layout import MODES, Mode

from . import (
    checks_cache,
    checks_checkpoint,
    checks_comm,
    checks_compile,
    checks_dit_file,
    checks_engine,
    checks_gpu,
    checks_inputs,
    checks_live,
    checks_lora,
    checks_memory,
    checks_parallel,
    checks_python,
    checks_sampling,
    checks_submodels,
    checks_t5_file,
    checks_time,
    checks_tts,
)
from .core import CheckFn, CheckGroup, CheckResult, warn

G = CheckGroup
#: (group, check) in display order within each group
CHECKS: tuple[tuple[CheckGroup, CheckFn], ...] = (
    (G.PYTHON_TORCH, checks_python.check_python),
    (G.PYTHON_TORCH, checks_python.check_torch),
    (G.PYTHON_TORCH, checks_python.check_cuda_driver),
    (G.PYTHON_TORCH, checks_python.check_torchvision),
    (G.PYTHON_TORCH, checks_python.check_packages),
    (G.GPUS, checks_gpu.check_visible),
    (G.GPUS, checks_gpu.check_count),
    (G.GPUS, checks_gpu.check_arch),
    (G.GPUS, checks_gpu.check_bf16),
    (G.GPUS, checks_gpu.check_busy),
    (G.GPUS, checks_gpu.check_fp8_matmul),
    (G.COMMUNICATION, checks_comm.check_backend),
    (G.COMMUNICATION, checks_comm.check_topology),
    (G.COMMUNICATION, checks_comm.check_consumer_p2p),
    (G.COMMUNICATION, checks_comm.check_deprecated_env),
    (G.COMMUNICATION, checks_comm.check_alloc_conf),
    (G.COMMUNICATION, checks_comm.check_shm),
    (G.COMMUNICATION, checks_comm.check_master_port),
    (G.COMMUNICATION, checks_comm.check_master_addr),
    (G.COMMUNICATION, checks_comm.check_slurm),
    (G.ATTENTION, checks_gpu.check_fa2),
    (G.ATTENTION, checks_gpu.check_fa3),
    (G.ATTENTION, checks_gpu.check_fa4),
    (G.ATTENTION, checks_gpu.check_capability),
    (G.ATTENTION, checks_gpu.check_backend),
    (G.ENGINE, checks_engine.check_located),
    (G.ENGINE, checks_engine.check_fingerprint),
    (G.ENGINE, checks_engine.check_deps),
    (G.ENGINE, checks_compile.check_compile),
    (G.MEDIA, checks_engine.check_ffmpeg),
    (G.MEDIA, checks_engine.check_encode),
    (G.CHECKPOINT, checks_checkpoint.check_dir),
    (G.CHECKPOINT, checks_checkpoint.check_files),
    (G.CHECKPOINT, checks_checkpoint.check_index),
    (G.CHECKPOINT, checks_checkpoint.check_safetensors),
    (G.CHECKPOINT, checks_dit_file.check_dit_file),
    (G.CHECKPOINT, checks_checkpoint.check_pth),
    (G.CHECKPOINT, checks_t5_file.check_t5_file),
    (G.CHECKPOINT, checks_checkpoint.check_config),
    (G.CHECKPOINT, checks_submodels.check_submodels),
    (G.LORA, checks_lora.check_loras),
    (G.INPUTS, checks_inputs.check_flags),
    (G.INPUTS, checks_inputs.check_prompt),
    (G.INPUTS, checks_inputs.check_image),
    (G.INPUTS, checks_inputs.check_size),
    (G.INPUTS, checks_inputs.check_audio),
    (G.INPUTS, checks_tts.check_tts),
    (G.INPUTS, checks_inputs.check_pose_video),
    (G.INPUTS, checks_sampling.check_passes),
    (G.MEMORY, checks_memory.check_plan),
    (G.MEMORY, checks_memory.check_gpu),
    (G.MEMORY, checks_memory.check_host),
    (G.MEMORY, checks_memory.check_pinned),
    (G.MEMORY, checks_time.check_time),
    (G.OUTPUT, checks_inputs.check_output_dir),
    (G.OUTPUT, checks_inputs.check_disk),
    (G.OUTPUT, checks_cache.check_dit_cache),
    (G.OUTPUT, checks_inputs.check_runs_root),
    (G.OUTPUT, checks_inputs.check_frames_out),
    (G.ULYSSES_DEGREE, checks_parallel.check_degree),
    (G.ULYSSES_DEGREE, checks_parallel.check_heads),
    (G.ULYSSES_DEGREE, checks_parallel.check_tokens),
    (G.FSDP, checks_parallel.check_t5_placement),
    (G.FSDP, checks_parallel.check_fsdp_world),
    (G.LIVE, checks_live.check_stages),
    (G.LIVE, checks_live.check_recipe),
    (G.LIVE, checks_live.check_memory),
    (G.LIVE, checks_live.check_fps),
    (G.LIVE, checks_live.check_session),
)

#: groups every run needs
COMMON_GROUPS = (G.PYTHON_TORCH, G.GPUS, G.COMMUNICATION, G.ATTENTION, G.ENGINE, G.MEDIA,
                 G.CHECKPOINT, G.LORA, G.INPUTS, G.MEMORY, G.OUTPUT)


def groups_for(mode: Mode) -> tuple[CheckGroup, ...]:
    """The check groups a mode needs, from what the mode does (:data:`~wan_s2v_runner.shared.layout.MODES`)."""
    t = MODES[Mode(mode)]
    return (COMMON_GROUPS + ((G.ULYSSES_DEGREE,) if t.sequence_parallel else ())
            + ((G.FSDP,) if t.dit_fsdp or t.t5_fsdp else ()) + ((G.LIVE,) if t.step_pipeline else ()))


def run_checks(ctx, groups: Iterable = tuple(CheckGroup)) -> list[CheckResult]:
    """Run every check of ``groups`` (in :class:`CheckGroup` order) against ``ctx``."""
    wanted = {CheckGroup(g) for g in groups}  # ValueError names an unknown group
    by_group = sorted((i for i, (g, _) in enumerate(CHECKS) if g in wanted),
                      key=lambda i: (list(CheckGroup).index(CHECKS[i][0]), i))
    out: list[CheckResult] = []
    for i in by_group:
        group, fn = CHECKS[i]
        t0 = time.perf_counter()
        try:
            got = fn(ctx)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            got = warn(f"{group.value}.{fn.__name__.removeprefix('check_')}",
                       f"the check itself crashed: {type(e).__name__}: {e}",
                       "report this as a wan-s2v bug; run with --skip-preflight only if sure")
        ms = (time.perf_counter() - t0) * 1000
        results = got if isinstance(got, list) else ([got] if got is not None else [])
        for r in results:
            r.group = group
            r.ms = round(ms / len(results), 2)
            out.append(r)
    return out
