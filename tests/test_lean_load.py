"""Lean loading (issue #9): the pieces, in this process, against what upstream's loading gives.

The distributed parts are proven end to end elsewhere, over real gloo ranks: fsdp-fixed and
hybrid at 2 ranks equal one process and each rank reads only its slices (test_parity.py, which
also checks a rank given a different checkpoint is refused), the 2-rank Ulysses demo shares one
DiT per node (test_parity.py), and the one-process loop on lean-loaded parts equals upstream
``WanS2V.generate`` on upstream-loaded ones (test_generation.py).
"""
from __future__ import annotations

import os

import pytest
import torch

from wan_s2v_runner.loading import ckpt_read, lean_load


@pytest.fixture(scope="module")
def dit_file(tiny_assets):
    return tiny_assets.ckpt_dir / "diffusion_pytorch_model.safetensors"


def test_read_flat_gives_the_files_elements_in_any_dtype_and_counts_bytes(dit_file, monkeypatch):
    from safetensors.torch import load_file
    monkeypatch.setattr(ckpt_read, "CHUNK_ELEMENTS", 7)  # conversion in many small chunks
    ref = load_file(str(dit_file))
    src = ckpt_read.SafetensorsFiles([dit_file])
    g = torch.Generator().manual_seed(0)
    expected = 0
    for key, t in list(ref.items())[:40]:
        flat = t.reshape(-1)
        start = int(torch.randint(0, flat.numel(), (1,), generator=g))
        n = int(torch.randint(1, flat.numel() - start + 1, (1,), generator=g))
        for dtype in (t.dtype, torch.float32):
            out = torch.empty(n, dtype=dtype)
            src.read_flat(key, start, out)
            assert torch.equal(out, flat[start:start + n].to(dtype)), key
            expected += n * t.element_size()
    assert src.counter.by_purpose == {"weights": expected}
    with pytest.raises(ValueError, match="outside"):
        src.read_flat(key, flat.numel(), torch.empty(1, dtype=t.dtype))
    src.close()


def test_pth_slices_equal_torch_load(tiny_assets):
    path = tiny_assets.ckpt_dir / "models_t5_umt5-xxl-enc-bf16.pth"
    ref = torch.load(path, weights_only=True)
    src = ckpt_read.PthFile(path)
    for key, t in ref.items():
        out = torch.empty(t.numel() - 1, dtype=torch.float32)
        src.read_flat(key, 1, out)
        assert torch.equal(out, t.float().reshape(-1)[1:]), key
    assert src.counter.total == sum((t.numel() - 1) * t.element_size() for t in ref.values())
    assert src.tensor_bytes() == sum(t.numel() * t.element_size() for t in ref.values())


def test_sample_windows_depend_on_the_key_only():
    a = ckpt_read.sample_windows([("x", 1000), ("y", 10)])
    assert a == ckpt_read.sample_windows([("x", 1000), ("y", 10)])
    assert a[1] == ("y", 0, 10)  # a small tensor is sampled whole
    assert 0 <= a[0][1] <= 1000 - 64 and a[0][2] == 64


def test_lean_dit_equals_upstreams_from_pretrained(engine_cpu, monkeypatch):
    """The meta-built DiT filled from the file (one process: the node's copy is its own) has
    exactly from_pretrained's parameters and RoPE table, and reads the file once."""
    wan, cfg, spec = engine_cpu
    for var in ("LOCAL_RANK", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as if not alone on the node: the shared path
    cls = wan.speech2video.WanModel_S2V
    ref = cls.from_pretrained(str(spec.ckpt_dir), torch_dtype=cfg.param_dtype)
    model = lean_load.empty_dit(cls, spec.ckpt_dir, cfg.param_dtype)
    assert all(p.is_meta for p in model.parameters())
    report = lean_load.LoadReport()
    with ckpt_read.SafetensorsFiles.in_dir(spec.ckpt_dir, counter=report.counter) as src:
        lean_load.check_same_keys(model, src, "DiT")
        assert lean_load.node_shared_weights(model, src, report, "dit") == "node-shared"
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert got[name].dtype == p.dtype and torch.equal(got[name], p), name
    assert torch.equal(model.freqs, ref.freqs)
    assert report.counter.total == src.tensor_bytes()  # each byte once
    # the weights live in a shared mapping (not private memory), copy-on-write for this process
    w = next(model.parameters())
    before = w.detach().clone()
    with torch.no_grad():
        w.add_(1.0)
    assert torch.equal(w, before + 1.0)


def test_check_same_keys_names_what_differs(engine_cpu):
    from patches.checkpoint_dims import CheckpointLayoutError
    wan, cfg, spec = engine_cpu
    model = lean_load.empty_dit(wan.speech2video.WanModel_S2V, spec.ckpt_dir, cfg.param_dtype)
    src = ckpt_read.SafetensorsFiles.in_dir(spec.ckpt_dir)
    key = next(iter(src.entries))
    del src.entries[key]
    with pytest.raises(CheckpointLayoutError, match=f"missing \\['{key}'\\]"):
        lean_load.check_same_keys(model, src, "DiT")


def test_in_turns_without_a_process_group_is_one_call():
    calls = []
    lean_load.in_turns(3, lambda: calls.append(os.getpid()))
    assert calls == [os.getpid()]


def _overlapped(engine_cpu, monkeypatch, read):
    """The tiny DiT loading on its thread (``components.load`` with ``LoadSettings(overlap=True)``,
    one rank), its weights read by ``read(real_read, *args)`` (``lean_load.device_weights``); (parts, plan, request)."""
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import request_for
    from wan_s2v_runner.shared.layout import Layout, Mode

    wan, cfg, spec = engine_cpu
    real = lean_load.device_weights
    monkeypatch.setattr(lean_load, "device_weights",  # the DiT's read (T5's is the main thread's)
                        lambda *a, **k: read(real, *a, **k) if a[-1] == "dit" else real(*a, **k))
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0,
                            components.LoadSettings(overlap=True))
    return parts, plan, request_for(spec)


def test_the_dit_loads_on_its_thread_while_the_encoders_run_and_the_frames_are_the_same(engine_cpu, reference_frames,
                                                                                       monkeypatch):
    """The DiT's read holds until the loop waits for it: every encoder ran while it was reading,
    on another thread; the loop joins it before the first step, and the frames are one process's
    with the DiT loaded first (the parity of 2-rank runs, whose loads overlap too, is test_parity's)."""
    import threading

    from wan_s2v_runner.rank.job_shell import Hooks, JobShell
    from wan_s2v_runner.shared.stages import Stage

    joined, readers = threading.Event(), []

    def read_until_joined(real, *a, **k):
        readers.append(threading.current_thread().name)
        assert joined.wait(120), "the loop never waited for the DiT"
        return real(*a, **k)

    parts, plan, req = _overlapped(engine_cpu, monkeypatch, read_until_joined)
    load = parts.pending
    assert parts.dit_loading and load.reading
    with pytest.raises(RuntimeError, match="still loading on its thread"):
        parts.noise_model  # noqa: B018 - a use before the join is a loud error, not a half-loaded model
    seen = []

    def stage(s, **data):
        seen.append((Stage(s), load.reading))
        if s is Stage.LOAD:  # the loop is about to wait for the DiT: let the read go on
            joined.set()

    frames = JobShell(parts, plan, Hooks(stage=stage)).generate(req)
    assert readers == ["wan-s2v-dit-load"]
    encoders = [(s, reading) for s, reading in seen if s in (Stage.AUDIO_ENCODE, Stage.REF_ENCODE, Stage.TEXT_ENCODE)]
    assert len(encoders) == 3 and all(reading for _, reading in encoders), seen
    order = [s for s, _ in seen]
    assert order.index(Stage.LOAD) > order.index(Stage.TEXT_ENCODE) and order.index(Stage.LOAD) < order.index(
        Stage.DENOISE)
    assert not parts.dit_loading and parts.load_report.strategy["dit_load"].startswith("while the encoders ran")
    assert set(parts.load_report.as_dict()["dit_overlap"]) == {"read_s", "waited_s", "finish_s"}
    monkeypatch.undo()
    assert torch.equal(frames, reference_frames)


def test_a_dit_load_that_fails_on_its_thread_fails_the_job_at_the_join(engine_cpu, monkeypatch):
    from wan_s2v_runner.rank.job_shell import Hooks, JobShell
    from wan_s2v_runner.shared.stages import Stage

    def fails(real, *a, **k):
        raise OSError(5, "Input/output error", "diffusion_pytorch_model.safetensors")

    parts, plan, req = _overlapped(engine_cpu, monkeypatch, fails)
    seen = []
    with pytest.raises(OSError, match="Input/output error"):
        JobShell(parts, plan, Hooks(stage=lambda s, **d: seen.append(Stage(s)))).generate(req)
    assert Stage.TEXT_ENCODE in seen and Stage.DENOISE not in seen  # raised where it was joined


def test_a_group_that_ends_before_using_its_dit_waits_for_the_read_without_finishing_it(engine_cpu, monkeypatch,
                                                                                         caplog):
    """A served group stopped before its first job: ``abandon`` waits for the thread (its collectives
    end on every rank) and neither finishes the DiT nor raises the read's error (logged); a read
    that ended well is reported all the same."""
    def fails(real, *a, **k):
        raise OSError(5, "Input/output error")

    parts, _, _ = _overlapped(engine_cpu, monkeypatch, fails)
    load = parts.pending
    with caplog.at_level("WARNING", logger="wan_s2v.components"):
        parts.abandon()
    assert not load.reading and not parts.dit_loading and "dit_overlap" not in parts.load_report.as_dict()
    assert "the DiT's load, never used, failed: OSError" in caplog.text

    reported = []
    monkeypatch.undo()  # the real read again
    parts, _, _ = _overlapped(engine_cpu, monkeypatch, lambda real, *a, **k: real(*a, **k))
    parts.when_ready(lambda: reported.append(parts.load_report.as_dict()))
    parts.abandon()
    assert reported[0]["strategy"]["dit_load"].endswith("on its thread, never used") and reported[0]["bytes_read"]
