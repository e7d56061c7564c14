"""The Wan2.2-S2V-14B checkpoint directory: every file and folder name the engine reads from it.

``wan.WanS2V(config=WAN_CONFIGS['s2v-14B'], checkpoint_dir=D)`` (upstream ``wan/speech2video.py``,
``WanS2V.__init__``) reads, relative to ``D``:

* ``config.t5_checkpoint`` = :data:`T5_FILE` -> ``T5EncoderModel(checkpoint_path=...)``, a plain
  umt5-xxl encoder state dict (``wan/configs/wan_s2v_14B.py``);
* ``config.t5_tokenizer`` = :data:`T5_TOKENIZER_DIR` -> ``AutoTokenizer.from_pretrained`` (in
  ``wan/modules/tokenizers.py``): ``tokenizer_config.json`` plus ``tokenizer.json`` or a
  sentencepiece ``spiece.model``;
* ``config.vae_checkpoint`` = :data:`VAE_FILE` -> ``Wan2_1_VAE(vae_pth=...)``;
* ``D`` itself -> ``WanModel_S2V.from_pretrained(D)`` (diffusers): :data:`DIT_CONFIG` and either
  the single :data:`DIT_WEIGHTS` or the shard index :data:`DIT_INDEX` with the shards it names
  (diffusers' ``CONFIG_NAME``, ``SAFETENSORS_WEIGHTS_NAME``, ``SAFE_WEIGHTS_INDEX_NAME``);
* the literal ``"wav2vec2-large-xlsr-53-english"`` (also ``config.wav2vec``) = :data:`WAV2VEC_DIR`
  -> ``AudioEncoder(model_id=...)`` (``wan/modules/s2v/audio_encoder.py``), i.e.
  ``Wav2Vec2Processor`` + ``Wav2Vec2ForCTC.from_pretrained`` (transformers' file names).

:data:`LAYOUT` lists these entries with their accepted alternatives; the preflight checks it,
the tiny test checkpoint (``wan_s2v_runner.demo.tiny_checkpoint``) is built in it. All paths are
relative to the checkpoint directory, with ``/`` separators. Nothing here reads a file.
"""
from __future__ import annotations

# --------------------------------------------------------------------------- top-level entries
DIT_CONFIG = "config.json"
DIT_WEIGHTS = "diffusion_pytorch_model.safetensors"  # single-file DiT
DIT_INDEX = f"{DIT_WEIGHTS}.index.json"  # sharded DiT: weight_map tensor -> shard file name
T5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"
T5_TOKENIZER_DIR = "google/umt5-xxl"
VAE_FILE = "Wan2.1_VAE.pth"
WAV2VEC_DIR = "wav2vec2-large-xlsr-53-english"
#: Ours, not the engine's: marks a random-weight test checkpoint, tiny or at real sizes (dims, seed, hashes).
TINY_INFO_FILE = "tiny_checkpoint.json"

# --------------------------------------------------------------------------- inside the HF folders
T5_TOKENIZER_CONFIG = f"{T5_TOKENIZER_DIR}/tokenizer_config.json"
T5_TOKENIZER_JSON = f"{T5_TOKENIZER_DIR}/tokenizer.json"  # fast tokenizer
T5_SPIECE = f"{T5_TOKENIZER_DIR}/spiece.model"  # or sentencepiece model
W2V_CONFIG = f"{WAV2VEC_DIR}/config.json"
W2V_WEIGHTS = f"{WAV2VEC_DIR}/model.safetensors"
W2V_WEIGHTS_BIN = f"{WAV2VEC_DIR}/pytorch_model.bin"  # older downloads
W2V_VOCAB = f"{WAV2VEC_DIR}/vocab.json"
W2V_TOKENIZER_CONFIG = f"{WAV2VEC_DIR}/tokenizer_config.json"
W2V_PREPROCESSOR = f"{WAV2VEC_DIR}/preprocessor_config.json"  # transformers 4.x
W2V_PROCESSOR = f"{WAV2VEC_DIR}/processor_config.json"  # transformers 5.x

#: the LAYOUT entry a ``--dit-file`` stands in for
DIT_WEIGHTS_ENTRY = "dit weights"
#: entry -> (alternatives, any one present is enough; what reads it)
LAYOUT: dict[str, tuple[tuple[str, ...], str]] = {
    "dit config": ((DIT_CONFIG,), "WanModel_S2V.from_pretrained"),
    DIT_WEIGHTS_ENTRY: ((DIT_INDEX, DIT_WEIGHTS), "WanModel_S2V.from_pretrained"),
    "t5 weights": ((T5_FILE,), "T5EncoderModel"),
    "t5 tokenizer config": ((T5_TOKENIZER_CONFIG,), "AutoTokenizer"),
    "t5 tokenizer": ((T5_TOKENIZER_JSON, T5_SPIECE), "AutoTokenizer"),
    "vae weights": ((VAE_FILE,), "Wan2_1_VAE"),
    "wav2vec2 config": ((W2V_CONFIG,), "Wav2Vec2ForCTC"),
    "wav2vec2 weights": ((W2V_WEIGHTS, W2V_WEIGHTS_BIN), "Wav2Vec2ForCTC"),
    "wav2vec2 vocab": ((W2V_VOCAB,), "Wav2Vec2Processor"),
    "wav2vec2 preprocessor": ((W2V_PREPROCESSOR, W2V_PROCESSOR), "Wav2Vec2Processor"),
}
