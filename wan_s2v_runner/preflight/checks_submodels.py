"""Group ``checkpoint``, check ``ckpt.submodels``: the sub-models fit the DiT and each other.

``ckpt.*`` before it prove each file is complete and readable; this check reads what each
sub-model *is* (from headers, configs and tokenizer files, no tensors) and compares it with what
the DiT's weights expect, so a part swapped in from another model is refused before any rank
loads it (where it would fail as a shape error deep in a forward, or run and give noise):

* audio encoder (``wav2vec2-large-xlsr-53-english``): its config parses; its weight table has the
  config's layer count and width; the DiT's audio encoder reads ``num_hidden_layers + 1`` hidden
  states (``casual_audio_encoder.weights``) of ``hidden_size`` channels (``audio_dim``, the
  ``conv1_local`` input);
* T5: its width equals the DiT's text input (``text_embedding.0.weight``);
* tokenizer: it loads (``tokenizers``), and its ids fit T5's embedding table;
* VAE: its latent channels equal the DiT's ``in_dim`` and the pose condition's ``cond_dim``.
Each refusal names the file and the fix.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from wan_s2v_runner.loading.ckpt_tables import CheckpointFileError, read_pth_shapes, read_safetensors_header
from wan_s2v_runner.shared.ckpt_layout import (
    DIT_CONFIG,
    T5_FILE,
    T5_TOKENIZER_JSON,
    VAE_FILE,
    W2V_CONFIG,
    W2V_WEIGHTS,
    W2V_WEIGHTS_BIN,
    WAV2VEC_DIR,
)

from .core import fail, ok, skip

FIX_PART = ("put back {what} from the Wan2.2-S2V-14B release: huggingface-cli download Wan-AI/Wan2.2-S2V-14B "
            "--local-dir CKPT_DIR --include '{glob}'")


def _fix(what: str, glob: str) -> str:
    return FIX_PART.format(what=what, glob=glob)


def _w2v_shapes(ckpt: Path) -> Optional[dict[str, tuple[int, ...]]]:
    if (ckpt / W2V_WEIGHTS).is_file():
        return {k: tuple(s) for k, (_, s) in read_safetensors_header(ckpt / W2V_WEIGHTS).tensors.items()}
    if (ckpt / W2V_WEIGHTS_BIN).is_file():
        return {k: tuple(s) for k, (s, _) in read_pth_shapes(ckpt / W2V_WEIGHTS_BIN).items()}
    return None


def _audio_encoder(ckpt: Path, dit: dict, cfg: dict) -> tuple[Optional[tuple[str, str, str]], str]:
    """(refusal (file, cause, fix) or None, finding)."""
    fix = _fix("the audio encoder", f"{WAV2VEC_DIR}/*")
    try:
        w2v = json.loads((ckpt / W2V_CONFIG).read_text(encoding="utf-8"))
        hidden, layers = int(w2v["hidden_size"]), int(w2v["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return (W2V_CONFIG, f"is not a wav2vec2 config ({type(e).__name__}: {e})", fix), ""
    try:
        shapes = _w2v_shapes(ckpt)
    except (CheckpointFileError, OSError) as e:
        return (W2V_WEIGHTS, str(e), fix), ""
    if shapes is not None:
        found = {int(m.group(1)) for k in shapes if (m := re.search(r"encoder\.layers\.(\d+)\.", k))}
        proj = next((s for k, s in shapes.items() if k.endswith("feature_projection.projection.weight")), None)
        if len(found) != layers or (proj is not None and proj[0] != hidden):
            return (W2V_WEIGHTS, f"holds {len(found)} layers of width {proj[0] if proj else '?'}, its config.json "
                    f"says {layers} of {hidden}", fix), ""
    want_states = dit.get("casual_audio_encoder.weights")
    want_width = dit.get("casual_audio_encoder.encoder.conv1_local.conv.weight")
    if want_width is not None and want_width[1] != hidden:
        return (W2V_CONFIG, f"hidden_size {hidden}, but the DiT's audio layers take {want_width[1]}-wide features",
                fix), ""
    if cfg.get("audio_dim") not in (None, hidden):
        return (DIT_CONFIG, f"audio_dim {cfg['audio_dim']}, but the audio encoder gives {hidden}-wide features",
                "restore config.json from the Wan2.2-S2V-14B release"), ""
    if want_states is not None and want_states[1] != layers + 1:
        return (W2V_CONFIG, f"{layers} layers give {layers + 1} hidden states, the DiT's audio encoder weighs "
                f"{want_states[1]}", fix), ""
    return None, f"audio encoder {layers} layers x {hidden} (the DiT reads {layers + 1} states)"


def _text(ckpt: Path, dit: dict, t5_shapes: Optional[dict]) -> tuple[Optional[tuple[str, str, str]], str]:
    found = []
    text_in = dit.get("text_embedding.0.weight")
    emb = (t5_shapes or {}).get("token_embedding.weight")
    if emb is not None:
        vocab, width = emb
        if text_in is not None and text_in[1] != width:
            return (T5_FILE, f"T5 width {width}, the DiT's text_embedding takes {text_in[1]}",
                    _fix("the T5 encoder", T5_FILE)), ""
        found.append(f"T5 width {width}")
        tok = ckpt / T5_TOKENIZER_JSON
        if tok.is_file():
            try:
                from tokenizers import Tokenizer
                size = Tokenizer.from_file(str(tok)).get_vocab_size(with_added_tokens=True)
            except Exception as e:  # noqa: BLE001 - the library's parse errors are plain Exceptions
                return (T5_TOKENIZER_JSON, f"does not load as a tokenizer ({e})",
                        _fix("the tokenizer", "google/umt5-xxl/*")), ""
            if size > vocab:
                return (T5_TOKENIZER_JSON, f"has {size} tokens, T5's embedding table {vocab} rows (ids past it "
                        "index out of range)", _fix("the tokenizer", "google/umt5-xxl/*")), ""
            found.append(f"tokenizer {size} tokens <= {vocab}")
    return None, ", ".join(found)


def _vae(dit: dict, cfg: dict, vae_dims: Optional[dict]) -> tuple[Optional[tuple[str, str, str]], str]:
    if not vae_dims:
        return None, ""
    z = vae_dims.get("z_dim")
    for what, want in (("in_dim", cfg.get("in_dim")), ("cond_dim", cfg.get("cond_dim"))):
        if want is not None and z != want:
            return (VAE_FILE, f"{z} latent channels, the DiT's {what} is {want}", _fix("the VAE", VAE_FILE)), ""
    return None, f"VAE {z} latent channels = DiT in_dim/cond_dim"


def check_submodels(ctx):
    ckpt = ctx.spec.ckpt_dir
    if ckpt is None or not ckpt.is_dir():
        return skip("ckpt.submodels", "no checkpoint directory (see ckpt.dir)")
    st = ctx.cache.setdefault("ckpt", {})
    dit, cfg = st.get("dit_shapes"), st.get("config")
    if dit is None or cfg is None:
        return skip("ckpt.submodels", "needs the DiT's weights and config.json (see ckpt.safetensors, ckpt.config)")
    findings = []
    parts = [lambda: _audio_encoder(ckpt, dit, cfg) if (ckpt / W2V_CONFIG).is_file() else (None, ""),
             lambda: _text(ckpt, dit, {k: s for k, (s, _) in st["t5_shapes"].items()} if "t5_shapes" in st else None),
             lambda: _vae(dit, cfg, st.get("vae_dims"))]
    for part in parts:
        refusal, finding = part()
        if refusal:
            file, cause, fix = refusal
            return fail("ckpt.submodels", f"{file}: {cause}", fix, file=file)
        if finding:
            findings.append(finding)
    return ok("ckpt.submodels", "; ".join(findings) or "nothing to compare")
