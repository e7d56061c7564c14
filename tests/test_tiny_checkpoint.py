"""The tiny checkpoint loads through the unmodified engine, only because of patches.checkpoint_dims.

Also: ``ckpt_layout`` names the files the engine opens; the patch reads the real checkpoint's
sizes as the upstream constants; builds are atomic and deterministic; the demo inputs (image,
speech-like audio) are what they claim to be.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from patches import checkpoint_dims  # noqa: E402
from wan_s2v_runner.demo import assets as demo_assets  # noqa: E402
from wan_s2v_runner.demo import synthetic_inputs  # noqa: E402
from wan_s2v_runner.demo import tiny_checkpoint as tc  # noqa: E402
from wan_s2v_runner.loading.ckpt_tables import find_entry  # noqa: E402
from wan_s2v_runner.shared import ckpt_layout  # noqa: E402

torch.set_num_threads(1)

# Non-default sizes everywhere, so nothing passes by matching a default by accident.
DIMS = dict(seed=3, dit_dim=48, dit_heads=4, dit_layers=3, vae_dim=16, t5_layers=2,
            t5_dim_attn=96, t5_dim_ffn=80, t5_heads=6, wav2vec_hidden=48)


def _import_wan():
    """`import wan` with this machine's pre-import fixes (wan_s2v_runner.loading.engine.import_wan)."""
    try:
        from wan_s2v_runner.loading.engine import import_wan
    except ImportError:  # engine module not there: the two workarounds inline
        if "wan" in sys.modules:
            return sys.modules["wan"]
        if not torch.cuda.is_available():
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _import_wan.lib = lib  # keep the schemas registered
            original = torch.cuda.current_device
            torch.cuda.current_device = lambda: 0
            try:
                import wan
            finally:
                torch.cuda.current_device = original
        else:
            import wan
        return wan
    return import_wan()


@pytest.fixture(scope="module")
def wan():
    return _import_wan()


@pytest.fixture(scope="module")
def ckpt(wan, tmp_path_factory) -> Path:
    return tc.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", **DIMS)


def _original(fn):
    return getattr(fn, "__wan_s2v_original__", fn)


def test_layout_is_the_real_one(ckpt):
    # Literal names on purpose: an independent check of ckpt_layout, not a restatement of it.
    for rel in ("config.json", "diffusion_pytorch_model.safetensors",
                "models_t5_umt5-xxl-enc-bf16.pth", "google/umt5-xxl/tokenizer_config.json",
                "Wan2.1_VAE.pth", "wav2vec2-large-xlsr-53-english/config.json",
                "wav2vec2-large-xlsr-53-english/vocab.json"):
        assert (ckpt / rel).is_file(), rel
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["_class_name"] == "WanModel_S2V"
    assert (cfg["dim"], cfg["num_heads"], cfg["num_layers"]) == (48, 4, 3)
    assert cfg["enable_adain"] and cfg["enable_framepack"] and not cfg["enable_motioner"]
    assert cfg["adain_mode"] == "attn_norm" and cfg["framepack_drop_mode"] == "padd"
    assert cfg["cond_dim"] == 16 and cfg["in_dim"] == 16 and cfg["out_dim"] == 16
    assert cfg["audio_dim"] == 48 and cfg["audio_inject_layers"] == [0, 2]
    assert tc.checkpoint_is_complete(ckpt)
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    assert size < 40e6
    # Nothing left behind next to it.
    assert [p.name for p in ckpt.parent.iterdir()] == ["ckpt"]


def test_layout_names_are_the_engines(wan):
    """ckpt_layout's names are the ones upstream and its loaders actually open."""
    import inspect

    import diffusers.utils.constants as dc
    import transformers.utils as tu
    from wan.configs import WAN_CONFIGS

    cfg = WAN_CONFIGS["s2v-14B"]
    assert (cfg.t5_checkpoint, cfg.t5_tokenizer, cfg.vae_checkpoint, cfg.wav2vec) == (
        ckpt_layout.T5_FILE, ckpt_layout.T5_TOKENIZER_DIR, ckpt_layout.VAE_FILE,
        ckpt_layout.WAV2VEC_DIR)
    # WanS2V.__init__ hard-codes the wav2vec2 folder instead of reading cfg.wav2vec.
    assert f'"{ckpt_layout.WAV2VEC_DIR}"' in inspect.getsource(wan.WanS2V.__init__)
    assert (dc.CONFIG_NAME, dc.SAFETENSORS_WEIGHTS_NAME, dc.SAFE_WEIGHTS_INDEX_NAME) == (
        ckpt_layout.DIT_CONFIG, ckpt_layout.DIT_WEIGHTS, ckpt_layout.DIT_INDEX)
    w2v = ckpt_layout.WAV2VEC_DIR + "/"
    assert (w2v + tu.CONFIG_NAME, w2v + tu.SAFE_WEIGHTS_NAME, w2v + tu.WEIGHTS_NAME,
            w2v + tu.FEATURE_EXTRACTOR_NAME, w2v + tu.PROCESSOR_NAME) == (
        ckpt_layout.W2V_CONFIG, ckpt_layout.W2V_WEIGHTS, ckpt_layout.W2V_WEIGHTS_BIN,
        ckpt_layout.W2V_PREPROCESSOR, ckpt_layout.W2V_PROCESSOR)


def test_tiny_checkpoint_has_every_layout_entry(ckpt, tmp_path):
    missing = [what for what, (alts, _) in ckpt_layout.LAYOUT.items() if find_entry(ckpt, alts) is None]
    assert missing == []
    # checkpoint_is_complete needs every REQUIRED_ENTRIES file, not just most of them.
    for rel in tc.REQUIRED_ENTRIES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    assert tc.checkpoint_is_complete(tmp_path)
    (tmp_path / ckpt_layout.W2V_VOCAB).unlink()
    assert not tc.checkpoint_is_complete(tmp_path)


def test_dims_read_from_files(ckpt):
    t5 = checkpoint_dims.read_t5_dims(ckpt / ckpt_layout.T5_FILE)
    assert t5 == dict(vocab_size=384, dim=4096, dim_attn=96, dim_ffn=80, num_heads=6,
                      num_layers=2, num_buckets=32, shared_pos=False)
    assert checkpoint_dims.read_vae_dims(ckpt / ckpt_layout.VAE_FILE) == dict(dim=16, z_dim=16)


def test_components_load_with_patch(wan, ckpt):
    checkpoint_dims.apply(wan)
    checkpoint_dims.apply(wan)  # idempotent
    assert checkpoint_dims.is_applied(wan)
    from wan.configs import WAN_CONFIGS
    from wan.modules.s2v.audio_encoder import AudioEncoder
    from wan.modules.s2v.model_s2v import WanModel_S2V
    from wan.modules.t5 import T5EncoderModel
    from wan.modules.vae2_1 import Wan2_1_VAE

    cfg = WAN_CONFIGS["s2v-14B"]
    # Exactly the calls WanS2V.__init__ makes (fp32 as on CPU).
    t5 = T5EncoderModel(text_len=cfg.text_len, dtype=torch.float32, device=torch.device("cpu"),
                        checkpoint_path=str(ckpt / cfg.t5_checkpoint),
                        tokenizer_path=str(ckpt / cfg.t5_tokenizer))
    enc = t5.model
    assert (enc.dim, enc.dim_attn, enc.dim_ffn, enc.num_heads, enc.num_layers,
            enc.num_buckets) == (4096, 96, 80, 6, 2, 32)
    assert enc.token_embedding.num_embeddings == 384
    assert next(enc.parameters()).dtype == torch.float32
    with torch.no_grad():
        ctx = t5(["a woman talking to the camera", cfg.sample_neg_prompt], torch.device("cpu"))
    assert ctx[0].shape == (7, 4096)  # 6 pieces + </s>
    assert all(torch.isfinite(c).all() and c.std() > 0 for c in ctx)

    vae = Wan2_1_VAE(vae_pth=str(ckpt / cfg.vae_checkpoint), device="cpu")
    assert vae.model.dim == 16 and vae.model.z_dim == 16
    with torch.no_grad():
        z = vae.encode([torch.zeros(3, 1, 16, 16)])[0]
    assert z.shape == (16, 1, 2, 2) and torch.isfinite(z).all()

    dit = WanModel_S2V.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    assert (dit.dim, dit.num_heads, dit.num_layers) == (48, 4, 3)
    assert len(dit.audio_injector.injector) == 2 and dit.enable_framepack
    # zero_init layers were re-randomized: nothing that feeds the output is all zeros.
    assert dit.head.head.weight.abs().sum() > 0
    assert all(inj.o.weight.abs().sum() > 0 for inj in dit.audio_injector.injector)

    audio = AudioEncoder(model_id=str(ckpt / ckpt_layout.WAV2VEC_DIR))
    wav = synthetic_inputs.make_speech_audio(ckpt.parent / "a.wav", seconds=0.5)
    feat = audio.extract_audio_feat(str(wav), return_all_layers=True)
    wav.unlink()
    assert feat.shape[0] == 25 and feat.shape[2] == 48  # 25 hidden states, width = audio_dim


def test_unpatched_engine_cannot_load_it(wan, ckpt):
    """Without the patch: upstream shapes differ from the file, loading fails (checked on meta)."""
    from wan.modules import t5 as t5_mod
    from wan.modules import vae2_1

    t5_file = ckpt / ckpt_layout.T5_FILE
    dims = checkpoint_dims.read_t5_dims(t5_file)
    assert dims != checkpoint_dims.UPSTREAM_T5
    # What T5EncoderModel builds upstream (on meta: no 5.7B allocation), then its strict load.
    upstream_t5 = _original(t5_mod.umt5_xxl)(encoder_only=True, return_tokenizer=False,
                                              dtype=torch.float32, device="meta")
    with pytest.raises(RuntimeError, match="size mismatch"):
        upstream_t5.load_state_dict(torch.load(t5_file, map_location="cpu"), assign=True)
    # Upstream _video_vae builds width 96 on meta and loads strictly.
    with pytest.raises(RuntimeError, match="size mismatch"):
        _original(vae2_1._video_vae)(pretrained_path=str(ckpt / ckpt_layout.VAE_FILE), z_dim=16)


def test_real_layout_reads_upstream_constants(wan):
    """For the real checkpoint's layout the patch reads exactly the upstream sizes."""
    from wan.modules import t5 as t5_mod
    from wan.modules.vae2_1 import WanVAE_

    real_t5 = _original(t5_mod.umt5_xxl)(encoder_only=True, return_tokenizer=False,
                                         dtype=torch.bfloat16, device="meta")
    shapes = {k: tuple(v.shape) for k, v in real_t5.state_dict().items()}
    assert checkpoint_dims.t5_dims_from_shapes(shapes) == checkpoint_dims.UPSTREAM_T5
    with torch.device("meta"):
        real_vae = WanVAE_(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                           attn_scales=[], temperal_downsample=[False, True, True])
    shapes = {k: tuple(v.shape) for k, v in real_vae.state_dict().items()}
    assert checkpoint_dims.vae_dims_from_shapes(shapes) == checkpoint_dims.UPSTREAM_VAE


def test_patch_keeps_explicit_and_pathless_calls(wan):
    checkpoint_dims.apply(wan)
    from wan.modules import t5 as t5_mod

    # No T5EncoderModel around it: no file to read, upstream sizes (plus explicit kwargs).
    m = t5_mod.umt5_xxl(encoder_only=True, return_tokenizer=False, device="meta",
                        encoder_layers=1)
    assert (m.dim_attn, m.num_heads, m.num_layers) == (4096, 64, 1)


def test_wrong_files_fail_clearly(wan, tmp_path):
    checkpoint_dims.apply(wan)
    from wan.modules.t5 import T5EncoderModel

    with pytest.raises(FileNotFoundError):
        T5EncoderModel(text_len=8, dtype=torch.float32, device=torch.device("cpu"),
                       checkpoint_path=str(tmp_path / "missing.pth"), tokenizer_path="x")
    bogus = tmp_path / "bogus.pth"
    torch.save({"w": torch.zeros(2)}, bogus)
    with pytest.raises(checkpoint_dims.CheckpointLayoutError, match="token_embedding"):
        checkpoint_dims.read_t5_dims(bogus)
    with pytest.raises(checkpoint_dims.CheckpointLayoutError, match="VAE"):
        checkpoint_dims.read_vae_dims(bogus)


def test_tokenizer_any_unicode(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt / ckpt_layout.T5_TOKENIZER_DIR))
    ids = tok(["画面模糊，最差质量 — héllo 🙂 <extra_id_0>"], padding="max_length",
              truncation=True, max_length=512, return_tensors="pt")
    assert ids.input_ids.shape == (1, 512)
    n = int(ids.attention_mask.sum())
    row = ids.input_ids[0]
    assert 2 in row[:n].tolist()  # <unk>
    assert row[n - 1] == 1 and (row[n:] == 0).all()  # </s>, then <pad>
    assert int(row.max()) < 384


def test_demo_assets_cached_and_deterministic(wan, tmp_path):
    t0 = time.perf_counter()
    assets = demo_assets.ensure_demo_assets(tmp_path / "cache")
    built_s = time.perf_counter() - t0
    assert built_s < 30
    assert tc.checkpoint_is_complete(assets.ckpt_dir)
    info = json.loads((assets.ckpt_dir / ckpt_layout.TINY_INFO_FILE).read_text())
    stamp = (assets.ckpt_dir / ckpt_layout.DIT_WEIGHTS).stat().st_mtime_ns

    # Reused: nothing rebuilt.
    again = demo_assets.ensure_demo_assets(tmp_path / "cache")
    assert again == assets
    assert (assets.ckpt_dir / ckpt_layout.DIT_WEIGHTS).stat().st_mtime_ns == stamp

    # Same seed -> byte-identical files.
    other = tc.build_tiny_checkpoint(tmp_path / "other", seed=0)
    assert json.loads((other / ckpt_layout.TINY_INFO_FILE).read_text())["sha256"] == info["sha256"]

    # Marker gone (e.g. an interrupted build) -> rebuilt; a rebuilt dir replaces the old one.
    os.remove(tmp_path / "cache" / ".demo_assets_ok")
    (assets.ckpt_dir / "stale").write_text("x")
    demo_assets.ensure_demo_assets(tmp_path / "cache")
    assert not (assets.ckpt_dir / "stale").exists()
    assert tc.checkpoint_is_complete(assets.ckpt_dir)
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if ".tmp" in p.name
                 or ".old-" in p.name]  # any temporary naming (atomic.temp_name or the build dir's)
    assert leftovers == []


def test_speech_audio(tmp_path):
    import librosa

    path = synthetic_inputs.make_speech_audio(tmp_path / "s.wav", seconds=1.5, sample_rate=16000, seed=1)
    y, sr = librosa.load(str(path), sr=16000)
    assert sr == 16000 and abs(len(y) / sr - 1.5) < 1e-3
    assert np.abs(y).max() > 0.3 and float(np.sqrt(np.mean(y ** 2))) > 0.02
    # Voiced: the strongest periodicity is near 120 Hz (pitch 100-150 Hz).
    f0 = librosa.yin(y, fmin=60, fmax=400, sr=sr)
    assert 95 < float(np.median(f0)) < 155
    # Syllable-like: the energy envelope rises and falls (not a steady tone).
    rms = librosa.feature.rms(y=y, frame_length=400, hop_length=160)[0]
    assert rms.max() > 4 * np.percentile(rms, 10)
    # Same seed, same bytes.
    again = synthetic_inputs.make_speech_audio(tmp_path / "t.wav", seconds=1.5, seed=1)
    assert again.read_bytes() == path.read_bytes()


def test_reference_image(tmp_path):
    from PIL import Image

    path = synthetic_inputs.make_reference_image(tmp_path / "r.png", width=96, height=80, seed=2)
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (96, 80) and im.mode == "RGB"
        arr = np.asarray(im)
    assert len(np.unique(arr.reshape(-1, 3), axis=0)) > 8  # a drawing, not a blank
