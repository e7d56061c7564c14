"""The engine patches that have no end-to-end test of their own: the two pre-import patches
(fresh processes, since they act on import) and the CPU device proxy; and the context cache's
bookkeeping (its exactness end to end is in test_generation's upstream-parity test)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT, cpu_torch_only


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
@cpu_torch_only
def test_cuda_torchvision_imports_only_with_the_schema_patch():
    assert torch.version.cuda is None  # the pinned CPU torch, with the CUDA torchvision build
    bare = _py("import torchvision")
    assert bare.returncode != 0 and "torchvision::nms does not exist" in bare.stderr
    patched = _py(
        "from patches import torchvision_cpu\n"
        "assert torchvision_cpu.apply() is True and torchvision_cpu.apply() is False\n"
        "import torch, torchvision.transforms as T\n"
        "x = T.CenterCrop(4)(T.Resize(6)(torch.rand(3, 8, 10)))\n"
        "assert tuple(x.shape) == (3, 4, 4)\n")
    assert patched.returncode == 0, patched.stderr


@pytest.mark.slow
@cpu_torch_only
def test_wan_imports_on_cpu_and_current_device_is_restored():
    bare = _py("from patches import torchvision_cpu; torchvision_cpu.apply(); import wan")
    assert bare.returncode != 0  # t5.py's import-time torch.cuda.current_device()
    patched = _py(
        "import torch\n"
        "orig = torch.cuda.current_device\n"
        "from wan_s2v_runner.loading.engine import import_wan\n"
        "wan = import_wan()\n"
        "assert hasattr(wan, 'WanS2V')\n"
        "assert torch.cuda.current_device is orig\n"
        "assert not torch.cuda.is_initialized()\n")  # the node's agent imports it, then forks the ranks
    assert patched.returncode == 0, patched.stderr


@cpu_torch_only
def test_cpu_device_proxy_maps_cuda_calls_and_leaves_torch_alone():
    from patches import cpu_device
    from wan_s2v_runner.loading.engine import import_wan

    wan = import_wan()
    s2v = wan.speech2video
    try:
        assert cpu_device.apply(wan) is True and cpu_device.apply(wan) is False
        t = s2v.torch
        assert t.device("cuda:0") == torch.device("cpu") and t.device("cpu").type == "cpu"
        assert torch.device("cuda:0").type == "cuda"  # real torch untouched
        t.cuda.empty_cache()
        t.cuda.synchronize()
        with t.amp.autocast("cuda", dtype=torch.bfloat16):
            y = torch.ones(2, 2) @ torch.ones(2, 2)
        assert y.dtype == torch.float32  # no autocast happened
        g = t.Generator(device=t.device("cuda:0"))
        assert t.randn(3, generator=g.manual_seed(1)).shape == (3,)  # everything else is torch's
    finally:
        s2v.torch = torch


def test_context_cache_serves_equal_contexts_bounded_and_steps_aside_under_grad():
    from patches import attention, context_cache
    from wan_s2v_runner.loading.engine import import_wan

    wan = import_wan()
    attention.apply(wan, "sdpa")
    torch.manual_seed(0)
    attn = wan.modules.model.WanCrossAttention(32, 4, qk_norm=True).eval()
    emb = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 32))
    x = torch.randn(1, 6, 32)
    raw = [torch.randn(1, 5, 8) for _ in range(3)]  # prompt, negative prompt, a third context
    with torch.no_grad():
        want = [attn(x, emb(r), None) for r in raw]  # upstream, uncached
    emb_memo = context_cache.memo_text_embedding(emb)
    kv_memo = context_cache.memo_cross_attention(attn)
    with torch.no_grad():
        for _step in range(3):
            for r, w in zip(raw[:2], want):
                assert torch.equal(attn(x, emb(r.clone()), None), w)  # an equal input, a new object
    assert (emb_memo.hits, emb_memo.misses, kv_memo.hits, kv_memo.misses) == (4, 2, 4, 2)
    with torch.no_grad():
        assert torch.equal(attn(x, emb(raw[2]), None), want[2])
    assert len(emb_memo.entries) == len(kv_memo.entries) == 2  # the oldest context was dropped
    got = attn(x, emb(raw[0]), None)  # grad enabled (training): upstream's path, nothing stored
    assert got.requires_grad and torch.equal(got.detach(), want[0])
    assert (emb_memo.misses, kv_memo.misses) == (3, 3)
    context_cache.clear(torch.nn.ModuleList([emb, attn]))  # between a rank group's jobs
    assert emb_memo.entries == kv_memo.entries == []
    with torch.no_grad():
        assert torch.equal(attn(x, emb(raw[0]), None), want[0]) and kv_memo.misses == 4


@pytest.mark.slow(seconds=30)
def test_16k_mono_speech_is_read_as_librosa_reads_it_without_its_first_load(tmp_path):
    """patches.audio_load: a 16 kHz mono wav and flac give librosa.load's samples and rate, read
    directly (no numba or scipy.signal imported: a fresh process); a 22.05 kHz file, a stereo
    file and other arguments go to librosa and give its result."""
    import numpy as np
    import soundfile as sf
    code = (
        "import sys\n"
        "from wan_s2v_runner.loading.engine import import_wan\n"
        "from patches import audio_load\n"
        "wan = import_wan()\n"
        "assert audio_load.apply(wan) and not audio_load.apply(wan)\n"
        "proxy = wan.modules.s2v.audio_encoder.librosa\n"
        f"y, sr = proxy.load({str(tmp_path / 'mono16k.wav')!r}, sr=16000)\n"
        "assert sr == 16000 and proxy.direct == 1, (sr, proxy.direct)\n"
        "print(sorted(m for m in ('numba', 'scipy.signal') if m in sys.modules))\n"
        "import numpy as np\n"
        f"np.save({str(tmp_path / 'direct.npy')!r}, y)\n")
    rng = np.random.default_rng(0)
    speech = (rng.standard_normal(16000) * 3000).astype(np.int16)
    sf.write(tmp_path / "mono16k.wav", speech, 16000, subtype="PCM_16")
    sf.write(tmp_path / "mono16k.flac", speech, 16000)
    sf.write(tmp_path / "mono22k.wav", speech, 22050, subtype="PCM_16")
    sf.write(tmp_path / "stereo16k.wav", np.stack([speech, speech[::-1]], axis=1), 16000, subtype="PCM_16")
    r = _py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout  # librosa's lazy parts were not imported

    import librosa

    from patches.audio_load import LibrosaProxy
    proxy = LibrosaProxy(librosa)
    for name, direct in (("mono16k.wav", 1), ("mono16k.flac", 1), ("mono22k.wav", 0), ("stereo16k.wav", 0)):
        before = proxy.direct
        got, sr = proxy.load(str(tmp_path / name), sr=16000)
        want, want_sr = librosa.load(str(tmp_path / name), sr=16000)
        assert sr == want_sr and got.dtype == want.dtype and np.array_equal(got, want), name
        assert proxy.direct - before == direct, name
    assert np.array_equal(np.load(tmp_path / "direct.npy"), librosa.load(str(tmp_path / "mono16k.wav"), sr=16000)[0])
    assert proxy.load(str(tmp_path / "mono16k.wav"), sr=16000, offset=0.5)[0].shape == (8000,)  # other args: librosa's


def test_the_registry_applies_what_each_run_needs_in_order(tiny_assets, tmp_path):
    """Each post-import patch declares when a run needs it (``Patch.applies``); the registry lists
    them in the order they apply. Which apply to a CPU run at one and two Ulysses ranks, an
    FSDP one, a LoRA one, and a GPU run (read from the patches' own declarations)."""
    from patches import REGISTRY_ORDER, registry
    from patches.patch import Patch, PatchContext
    from wan_s2v_runner.shared.spec import RunSpec

    patches = registry()
    assert [p.name for p in patches] == list(REGISTRY_ORDER) and all(isinstance(p, Patch) for p in patches)
    lora = tmp_path / "x.safetensors"
    lora.write_bytes(b"")

    def needed(**fields) -> list[str]:
        spec = RunSpec(ckpt_dir=tiny_assets.ckpt_dir, image=tiny_assets.image, audio=tiny_assets.audio,
                       prompt="p", **fields)
        return [p.name for p in patches if p.applies(PatchContext(spec, torch.float32))]

    every = ["checkpoint_dims", "attention", "audio_load", "sp_dtype"]
    assert needed(device="cpu") == [*every, "cpu_device"]
    assert needed(device="cpu", nproc=2, mode="ulysses") == [*every, "local_audio", "cpu_device"]
    assert needed(device="cpu", nproc=2, mode="fsdp-fixed") == [*every, "fsdp_no_sync", "cpu_device"]
    assert needed(device="cpu", lora=[str(lora)]) == [*every, "lora_merge", "cpu_device"]
    assert needed(device="cuda") == every
    assert all(p.restore is not None for p in patches)  # each can be undone (next test)


_UNDONE = r"""
import sys, torch
from patches import apply_for_run, registry
from wan_s2v_runner.loading.engine import import_wan
from wan_s2v_runner.loading.lora import merger
from wan_s2v_runner.shared.spec import RunSpec

ckpt, image, audio, lora = sys.argv[1:5]
wan = import_wan()


def engine():  # every name the engine's modules and their classes hold, by identity
    out = {}
    for name, mod in list(sys.modules.items()):
        if name == "wan" or name.startswith("wan."):
            for k, v in list(vars(mod).items()):
                out[(name, k)] = id(v)
                if isinstance(v, type) and v.__module__ == name:
                    out.update({(name, k, kk): id(vv) for kk, vv in vars(v).items()})
    return out


before = engine()
for fields in ({"nproc": 2, "mode": "ulysses", "lora": [lora]}, {"nproc": 2, "mode": "fsdp-fixed"}):
    spec = RunSpec(ckpt_dir=ckpt, image=image, audio=audio, prompt="p", device="cpu", **fields)
    applied = apply_for_run(wan, spec, torch.float32, merge_loras=merger(spec.lora) if spec.lora else None)
    after_apply = engine()
    assert any(after_apply.get(k) != v for k, v in before.items()), "nothing applied?"
    for patch in reversed(registry()):
        patch.restore(wan)
    after = engine()
    changed = sorted(str(k) for k, v in before.items() if after.get(k) != v)
    assert not changed, (sorted(applied), changed)
print("undone")
"""


@pytest.mark.slow
def test_every_patch_is_undone_to_the_engine_as_imported(tiny_assets, tmp_path):
    """Applied for a 2-rank Ulysses run with a LoRA and for an FSDP one, then restored in reverse
    order: every name of the engine's modules and classes is the object it was after import (a
    fresh process: the suite's own has patched its engine)."""
    lora = tmp_path / "x.safetensors"
    lora.write_bytes(b"")
    out = subprocess.run([sys.executable, "-c", _UNDONE, str(tiny_assets.ckpt_dir), str(tiny_assets.image),
                          str(tiny_assets.audio), str(lora)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip().endswith("undone"), out.stderr[-3000:]
