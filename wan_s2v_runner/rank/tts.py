"""Rank side of ``--tts-text``: the first rank speaks the text with CosyVoice2, as upstream's
``WanS2V.tts`` does, and writes it beside the output (``OUTPUT.speech.wav``, by temporary name);
that file is the run's audio (encoded for the DiT, muxed into the mp4).

Upstream: ``load_wav(prompt, 16000)``, then ``inference_zero_shot(text, prompt_text, prompt)``
with a prompt transcript or ``inference_cross_lingual(text, prompt)`` without, the chunks'
``tts_speech`` concatenated and saved at ``cosyvoice.sample_rate`` as ``tts.wav`` in the working
directory (two runs in one directory overwrite each other's speech). Here: the code and model
come from the directories the user named (nothing is downloaded; preflight checked they import),
the model is dropped again once the speech is written (the DiT needs the memory), and a resumed
run keeps the speech it made before (a sampled voice would differ, and the clips already made
speak the first one).
"""
from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

from wan_s2v_runner.shared import atomic
from wan_s2v_runner.shared.cosyvoice import code_paths
from wan_s2v_runner.shared.spec import RunSpec

log = logging.getLogger("wan_s2v.tts")


def make_speech(spec: RunSpec, resuming: bool = False, commit_if=None) -> Path:
    """Speak ``spec.tts_text``; returns the wav (``spec.tts_speech_path``, renamed into place when
    ``commit_if`` says so: :func:`~wan_s2v_runner.shared.atomic.atomic_write`)."""
    out = spec.tts_speech_path
    if resuming and out.is_file():
        log.info("tts: keeping the speech of the run being resumed (%s)", out)
        return out
    import numpy as np
    import soundfile as sf
    import torch

    code_dir, model_dir = spec.cosyvoice_paths
    for entry in reversed(code_paths(code_dir)):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    from cosyvoice.cli.cosyvoice import CosyVoice2
    from cosyvoice.utils.file_utils import load_wav

    model = CosyVoice2(str(model_dir))
    prompt = load_wav(str(spec.tts_prompt_audio), 16000)
    if spec.tts_prompt_text is not None:
        chunks = model.inference_zero_shot(spec.tts_text, spec.tts_prompt_text, prompt)
    else:
        chunks = model.inference_cross_lingual(spec.tts_text, prompt)
    speech = torch.concat([c["tts_speech"] for c in chunks], dim=1)  # [channels, samples]
    rate = int(model.sample_rate)
    data = np.ascontiguousarray(speech.detach().float().cpu().numpy().T)
    atomic.atomic_write(out, lambda p: sf.write(str(p), data, rate, subtype="FLOAT", format="WAV"),
                        commit_if=commit_if)
    log.info("tts: %.2f s of speech at %d Hz -> %s", data.shape[0] / rate, rate, out)
    del model, chunks, speech
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return out
