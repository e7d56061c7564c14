"""Tiny random-weight Wan2.2-S2V checkpoint in the real file layout, for tests and CPU smoke runs.

``build_tiny_checkpoint`` writes a directory in the *real* Wan2.2-S2V-14B file layout
(:mod:`wan_s2v_runner.shared.ckpt_layout`), loadable by the unmodified engine
(``wan.WanS2V(config=WAN_CONFIGS['s2v-14B'], checkpoint_dir=...)`` with ``param_dtype``/``t5_dtype``
set to float32 on CPU), but with tiny dimensions (~12 MB with the defaults, built in about a
second after ``import wan``)::

    DIT_CONFIG, DIT_WEIGHTS   WanModel_S2V (save_pretrained), bf16
    T5_FILE                   umt5 encoder state dict, bf16, width 4096
    T5_TOKENIZER_DIR          Unigram tokenizer (AutoTokenizer dir)
    VAE_FILE                  WanVAE_ state dict, fp32
    WAV2VEC_DIR               Wav2Vec2ForCTC + Wav2Vec2Processor, fp32
    TINY_INFO_FILE            dims, seed, hashes; ignored by the engine

File names, key names, dtypes and config semantics mirror the real checkpoint (adain,
framepack, motion frames, 25 wav2vec2 hidden states, the T5 width of 4096 that the DiT's text
projection expects). Two engine constants do not fit a tiny checkpoint: the umt5-xxl shape that
``T5EncoderModel`` builds and the VAE width 96; ``patches/checkpoint_dims.py`` makes the engine
read both from the files, so it must be applied before loading this checkpoint.

All weights are random but deterministic for a seed, and every tensor is re-randomized after
construction (upstream zero-inits several layers, which would make the DiT output exactly zero).
Demo inputs are in :mod:`wan_s2v_runner.demo.synthetic_inputs`, the demo cache in
:mod:`wan_s2v_runner.demo.assets`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import string
import uuid
from pathlib import Path
from typing import Iterator

from wan_s2v_runner.shared.ckpt_layout import (
    DIT_CONFIG,
    DIT_WEIGHTS,
    T5_FILE,
    T5_TOKENIZER_CONFIG,
    T5_TOKENIZER_DIR,
    T5_TOKENIZER_JSON,
    TINY_INFO_FILE,
    VAE_FILE,
    W2V_CONFIG,
    W2V_TOKENIZER_CONFIG,
    W2V_VOCAB,
    W2V_WEIGHTS,
    WAV2VEC_DIR,
)

__all__ = [
    "TINY_FORMAT_VERSION",
    "TINY_VAE_DIM",
    "REQUIRED_ENTRIES",
    "build_tiny_checkpoint",
    "checkpoint_is_complete",
    "dir_bytes",
]

#: Bump when the layout or the contents of what is built here change (invalidates caches).
TINY_FORMAT_VERSION = 2  # 2: the VAE 4 wide (was 8)
#: the tiny VAE's width (upstream's is 96). Every run decodes upstream's 73 motion frames with the
#: new ones and encodes them again each clip, so the VAE was ~75% of a tiny one-process generate at
#: width 8; at 4 its decode and encode take 0.56x and 0.58x (1 thread, this 2-core CPU), which is
#: most of what every launch in the suite computes.
TINY_VAE_DIM = 4

#: What a complete tiny checkpoint directory holds (relative paths): one of each
#: ``ckpt_layout.LAYOUT`` entry's alternatives, the wav2vec2 tokenizer config and our info file.
REQUIRED_ENTRIES = (
    DIT_CONFIG,
    DIT_WEIGHTS,
    T5_FILE,
    T5_TOKENIZER_JSON,
    T5_TOKENIZER_CONFIG,
    VAE_FILE,
    W2V_CONFIG,
    W2V_WEIGHTS,
    W2V_VOCAB,
    W2V_TOKENIZER_CONFIG,
    TINY_INFO_FILE,
)

T5_TEXT_DIM = 4096  # WanModel_S2V's text_dim: not in config.json, always 4096.
T5_VOCAB_SIZE = 384
T5_NUM_BUCKETS = 32
WAV2VEC_NUM_LAYERS = 24  # CausalAudioEncoder weighs 25 hidden states (embeddings + 24 layers).
VAE_Z_DIM = 16  # Wan2_1_VAE hard-codes z_dim 16 (and 16 latent means/stds).


# --------------------------------------------------------------------------------------------
# helpers


def _wan():
    """The engine, imported with this machine's pre-import fixes."""
    from wan_s2v_runner.loading.engine import import_wan

    return import_wan()


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's global RNG for module construction without disturbing the caller's RNG."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _rerandomize(module, seed: int) -> None:
    """Redraw every parameter from a seeded generator, keeping each tensor's scale.

    - tensors with spread (random inits): normal(mean, std) of the tensor's own values;
    - constant zero tensors (biases, zero-init layers): normal(0, 0.02);
    - other constant tensors (norm scales = 1, audio layer weights = 0.01): c * (1 + 0.1 * normal),
      so they keep their sign (CausalAudioEncoder divides by the sum of SiLU(weights)).
    Buffers are left alone (none of them is learned state).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            v = p.detach().to(torch.float64)
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.numel() > 1 and float(v.std()) > 0:
                new = float(v.mean()) + float(v.std()) * noise
            else:
                c = float(v.flatten()[0]) if p.numel() else 0.0
                new = 0.02 * noise if c == 0.0 else c * (1.0 + 0.1 * noise)
            p.copy_(new.to(p.dtype))


def _tokenizer_pieces(vocab_size: int) -> list[tuple[str, float]]:
    """A T5-style Unigram vocabulary: <pad>=0, </s>=1, <unk>=2, then pieces with log-prob scores."""
    pieces: list[tuple[str, float]] = [
        ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -4.0)]
    seen = {p for p, _ in pieces}

    def add(piece: str, score: float) -> None:
        if len(pieces) < vocab_size and piece not in seen:
            pieces.append((piece, score))
            seen.add(piece)

    for c in string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation:
        add(c, -9.0)
    for c in string.ascii_lowercase:
        add("\u2581" + c, -8.0)
    words = (
        "the a an of and to in is it that on with as for at by from this his her he she they "
        "we you i person man woman girl boy people talking speaking singing face video camera "
        "looking smiling mouth eyes head hair light background front close up clear high "
        "quality good natural soft warm bright dark room studio portrait young old standing "
        "sitting says said speech voice moving slowly gently calm happy blurry worst low "
        "static subtitle ugly bad hands fingers still messy many walking three legs"
    ).split()
    for i, w in enumerate(words):
        add("\u2581" + w, -5.0 - 0.01 * i)
    for a in "etaoinshrdlu":  # frequent English letter pairs, to fill up deterministically
        for b in "etaoinshrdlu":
            add(a + b, -7.0)
    for a in string.ascii_lowercase:
        for b in string.ascii_lowercase:
            add(a + b, -7.5)
    if len(pieces) != vocab_size:
        raise ValueError(f"tokenizer vocab_size {vocab_size} out of range (max {len(pieces)})")
    return pieces


def _write_t5_tokenizer(ckpt: Path, vocab_size: int, text_len: int = 512) -> None:
    """The T5 tokenizer folder (T5_TOKENIZER_DIR) inside the checkpoint directory ``ckpt``."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    out = ckpt / T5_TOKENIZER_DIR
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.Unigram(_tokenizer_pieces(vocab_size), unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" {2,}", " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always",
                                                 split=True)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    tok.save(str(ckpt / T5_TOKENIZER_JSON))
    specials = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (ckpt / T5_TOKENIZER_CONFIG).write_text(json.dumps({
        "tokenizer_class": "T5Tokenizer",
        **specials,
        "extra_ids": 0,  # real umt5 has sentinel tokens; a tiny vocab has none
        "additional_special_tokens": [],
        "model_max_length": text_len,
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def _write_t5(path: Path, wan, *, seed: int, vocab_size: int, layers: int, dim_attn: int,
              dim_ffn: int, num_heads: int) -> None:
    import torch
    from wan.modules.t5 import T5Encoder

    with _seeded(seed):
        model = T5Encoder(vocab=vocab_size, dim=T5_TEXT_DIM, dim_attn=dim_attn, dim_ffn=dim_ffn,
                          num_heads=num_heads, num_layers=layers, num_buckets=T5_NUM_BUCKETS,
                          shared_pos=False, dropout=0.1)
    _rerandomize(model, seed)
    # bf16 like the real file; T5EncoderModel's load_state_dict copies into its own dtype.
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    torch.save(sd, path)


def _write_vae(path: Path, wan, *, seed: int, dim: int) -> None:
    import torch
    from wan.modules.vae2_1 import WanVAE_

    with _seeded(seed):
        # Same cfg as wan.modules.vae2_1._video_vae, except the width.
        model = WanVAE_(dim=dim, z_dim=VAE_Z_DIM, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                        attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0)
    _rerandomize(model, seed)
    # fp32 like the real file: it is loaded with assign=True, so the file's dtype is the model's.
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, path)


def _inject_layers(num_layers: int) -> list[int]:
    """Audio injection layers: every other layer plus the last, like the real 0,4,...,36,39."""
    return sorted(set(range(0, num_layers, 2)) | {num_layers - 1})


def _write_dit(out: Path, wan, *, seed: int, dim: int, heads: int, layers: int,
               audio_dim: int) -> None:
    import torch
    from wan.modules.s2v.model_s2v import WanModel_S2V

    if dim % heads or (dim // heads) % 2:
        raise ValueError(f"dit_dim {dim} must be a multiple of dit_heads {heads} with an even "
                         "head size")
    if dim % 4:
        raise ValueError(f"dit_dim {dim} must be a multiple of 4 (4 audio tokens)")
    if not 1 <= layers <= 10:
        # AudioInjector_WAN matches blocks by substring ('transformer_blocks.1' also matches
        # '...blocks.10'); keep tiny models clear of that.
        raise ValueError(f"dit_layers must be 1..10, got {layers}")
    kwargs = dict(
        # Semantics of the real Wan2.2-S2V-14B config.json, scaled down.
        cond_dim=16,
        audio_dim=audio_dim,
        num_audio_token=4,
        enable_adain=True,
        adain_mode="attn_norm",
        audio_inject_layers=_inject_layers(layers),
        zero_init=True,
        zero_timestep=True,
        enable_motioner=False,
        add_last_motion=True,
        enable_tsm=False,
        trainable_token_pos_emb=False,
        enable_framepack=True,
        framepack_drop_mode="padd",
        model_type="s2v",
        patch_size=(1, 2, 2),
        text_len=512,
        in_dim=16,
        dim=dim,
        ffn_dim=2 * dim,
        freq_dim=256,
        out_dim=16,
        num_heads=heads,
        num_layers=layers,
        window_size=(-1, -1),
        qk_norm=True,
        cross_attn_norm=True,
        eps=1e-6,
    )
    with _seeded(seed):
        model = WanModel_S2V(**kwargs)
    _rerandomize(model, seed)
    # bf16 like the real shards (from_pretrained casts to param_dtype). nn.Module.to, not
    # ModelMixin.to, which warns about fp32-kept modules (there are none).
    torch.nn.Module.to(model, torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


# Real facebook/wav2vec2-large-xlsr-53-english CTC vocabulary layout (33 symbols there).
_W2V_VOCAB = ["<pad>", "<s>", "</s>", "<unk>", "|"] + list("ETAONISRHDLUMCWFGYPBVK'XJQZ")


def _write_wav2vec(ckpt: Path, wan, *, seed: int, hidden: int, heads: int = 4, intermediate: int = 0,
                   conv_dim: int = 16) -> None:
    """The wav2vec2 folder (WAV2VEC_DIR) inside the checkpoint directory ``ckpt``
    (``intermediate`` 0: twice ``hidden``; wav2vec2-large-xlsr-53 is 1024, 16, 4096, 512)."""
    from transformers import (
        Wav2Vec2Config,
        Wav2Vec2CTCTokenizer,
        Wav2Vec2FeatureExtractor,
        Wav2Vec2ForCTC,
        Wav2Vec2Processor,
    )

    if hidden % 4:
        raise ValueError(f"wav2vec_hidden {hidden} must be a multiple of 4")
    out = ckpt / WAV2VEC_DIR
    out.mkdir(parents=True, exist_ok=True)
    vocab = {s: i for i, s in enumerate(_W2V_VOCAB)}
    (ckpt / W2V_VOCAB).write_text(json.dumps(vocab))
    tokenizer = Wav2Vec2CTCTokenizer(str(ckpt / W2V_VOCAB), unk_token="<unk>", pad_token="<pad>",
                                     word_delimiter_token="|")
    feature_extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000,
                                                 padding_value=0.0, do_normalize=True,
                                                 return_attention_mask=True)
    cfg = Wav2Vec2Config(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=WAV2VEC_NUM_LAYERS,
        num_attention_heads=heads,
        intermediate_size=intermediate or 2 * hidden,
        # Real conv strides/kernels (20 ms frames, 50 Hz: the engine interpolates from 50 fps),
        # narrow channels by default. Layer-norm variant like xlsr-53.
        conv_dim=(conv_dim,) * 7,
        conv_stride=(5, 2, 2, 2, 2, 2, 2),
        conv_kernel=(10, 3, 3, 3, 3, 2, 2),
        conv_bias=True,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
        num_conv_pos_embeddings=128,
        num_conv_pos_embedding_groups=math.gcd(16, hidden),  # 16 in xlsr-53
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with _seeded(seed):
        model = Wav2Vec2ForCTC(cfg)
    _rerandomize(model, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    Wav2Vec2Processor(feature_extractor=feature_extractor, tokenizer=tokenizer).save_pretrained(
        str(out))
    # preprocessor_config.json too, for transformers 4.x readers of the same directory.
    feature_extractor.save_pretrained(str(out))


def _dir_digest(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != TINY_INFO_FILE:
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def dir_bytes(root: Path) -> int:
    """Bytes of every file under ``root``."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def checkpoint_is_complete(ckpt_dir: Path) -> bool:
    """Whether ``ckpt_dir`` holds every file a tiny checkpoint built here has."""
    ckpt_dir = Path(ckpt_dir)
    return all((ckpt_dir / rel).is_file() for rel in REQUIRED_ENTRIES)


def _replace_dir(tmp: Path, dest: Path) -> None:
    """Move the finished ``tmp`` onto ``dest``; an existing ``dest`` is moved aside first."""
    trash = None
    if dest.exists() or dest.is_symlink():
        trash = dest.parent / f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.replace(dest, trash)
    os.replace(tmp, dest)
    if trash is not None:
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# public API


def build_tiny_checkpoint(out_dir: Path, *, seed: int = 0, dit_dim: int = 32, dit_heads: int = 4,
                          dit_layers: int = 2, vae_dim: int = TINY_VAE_DIM, t5_layers: int = 1,
                          wav2vec_hidden: int = 32, t5_dim_attn: int = 64, t5_dim_ffn: int = 64,
                          t5_heads: int = 4, t5_vocab: int = T5_VOCAB_SIZE) -> Path:
    """Write a random tiny checkpoint in the real Wan2.2-S2V-14B layout to ``out_dir``.

    Built in a temporary sibling directory and moved into place with ``os.replace``: ``out_dir``
    is either the old contents or the complete new checkpoint, never half-written. Byte-identical
    for the same arguments (seeded). Returns ``out_dir``. Loading it needs
    ``patches.checkpoint_dims.apply(wan)`` (T5 and VAE sizes come from the files).
    """
    import torch

    out_dir = Path(out_dir).absolute()
    if t5_dim_attn % t5_heads:
        raise ValueError(f"t5_dim_attn {t5_dim_attn} must be a multiple of t5_heads {t5_heads}")
    wan = _wan()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with _torch_threads(1):
            # One derived seed per component: changing one component's dims leaves the others'
            # weights as they were.
            _write_dit(tmp, wan, seed=seed * 1000 + 1, dim=dit_dim, heads=dit_heads,
                       layers=dit_layers, audio_dim=wav2vec_hidden)
            _write_t5(tmp / T5_FILE, wan, seed=seed * 1000 + 2, vocab_size=t5_vocab,
                      layers=t5_layers, dim_attn=t5_dim_attn, dim_ffn=t5_dim_ffn,
                      num_heads=t5_heads)
            _write_t5_tokenizer(tmp, t5_vocab)
            _write_vae(tmp / VAE_FILE, wan, seed=seed * 1000 + 3, dim=vae_dim)
            _write_wav2vec(tmp, wan, seed=seed * 1000 + 4, hidden=wav2vec_hidden)
        info = {
            "format_version": TINY_FORMAT_VERSION,
            "kind": "wan-s2v tiny random checkpoint (not a trained model)",
            "seed": seed,
            "dit": {"dim": dit_dim, "num_heads": dit_heads, "num_layers": dit_layers,
                    "ffn_dim": 2 * dit_dim, "audio_inject_layers": _inject_layers(dit_layers)},
            "t5": {"vocab_size": t5_vocab, "dim": T5_TEXT_DIM, "dim_attn": t5_dim_attn,
                   "dim_ffn": t5_dim_ffn, "num_heads": t5_heads, "num_layers": t5_layers,
                   "num_buckets": T5_NUM_BUCKETS},
            "vae": {"dim": vae_dim, "z_dim": VAE_Z_DIM},
            "wav2vec2": {"hidden_size": wav2vec_hidden, "num_hidden_layers": WAV2VEC_NUM_LAYERS},
            "torch": torch.__version__,
            "sha256": _dir_digest(tmp),
        }
        (tmp / TINY_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


if __name__ == "__main__":  # python -m wan_s2v_runner.demo.tiny_checkpoint OUT_DIR
    import sys
    import time

    t0 = time.perf_counter()
    got = build_tiny_checkpoint(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-s2v-ckpt"))
    size = dir_bytes(got)
    print(f"{got} ({size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)")
