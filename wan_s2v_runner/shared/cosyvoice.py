"""Where CosyVoice2 comes from for ``--tts-text``: what its model directory holds and what goes on
``sys.path`` for its code (upstream adds the checkout and its ``third_party/Matcha-TTS``). Read by
preflight (``inputs.tts``) and by the rank that speaks the text (:mod:`wan_s2v_runner.rank.tts`).
"""
from __future__ import annotations

from pathlib import Path

#: what ``CosyVoice2(model_dir)`` reads from the model directory
MODEL_FILES = ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx")


def code_paths(code_dir: Path) -> list[str]:
    """The ``sys.path`` entries CosyVoice's code needs: the checkout and its Matcha-TTS."""
    return [str(code_dir), str(Path(code_dir) / "third_party" / "Matcha-TTS")]
