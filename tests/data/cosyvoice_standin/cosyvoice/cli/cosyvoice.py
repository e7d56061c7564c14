"""Stand-in of cosyvoice.cli.cosyvoice.CosyVoice2 (tests only): a known waveform per sentence."""
import hashlib
import os
import re

import numpy as np
import torch

SAMPLE_RATE = 24000
SECONDS_PER_CHAR = 0.06


def sentences(text):
    return [s for s in re.split(r"(?<=[.!?。！？])\s*", text) if s.strip()]


def expected_speech(text, prompt_rms):
    """The stand-in's speech for ``text`` and a prompt of RMS ``prompt_rms``: [1, T] float32."""
    chunks = []
    for s in sentences(text):
        n = int(round(SECONDS_PER_CHAR * len(s) * SAMPLE_RATE))
        f = 120 + int(hashlib.sha256(s.encode()).hexdigest()[:4], 16) % 200
        t = np.arange(n, dtype=np.float64) / SAMPLE_RATE
        env = np.sin(np.pi * np.arange(n) / max(1, n - 1)) ** 2
        wave = (np.sin(2 * np.pi * f * t) + 0.5 * np.sin(2 * np.pi * 2.7 * f * t)) * env
        chunks.append(torch.from_numpy((min(0.9, 4 * prompt_rms) * wave / 1.5).astype(np.float32)).unsqueeze(0))
    return chunks


class CosyVoice2:
    def __init__(self, model_dir, load_jit=False, load_trt=False, fp16=False):
        if not os.path.isfile(os.path.join(model_dir, "cosyvoice2.yaml")):
            raise ValueError(f"{model_dir}/cosyvoice2.yaml not found")
        self.sample_rate = SAMPLE_RATE

    def _speak(self, text, prompt_speech_16k):
        rms = float(prompt_speech_16k.pow(2).mean().sqrt())
        for chunk in expected_speech(text, rms):
            yield {"tts_speech": chunk}

    def inference_zero_shot(self, tts_text, prompt_text, prompt_speech_16k, stream=False, speed=1.0):
        assert prompt_text, "zero-shot needs the prompt's transcript"
        yield from self._speak(tts_text, prompt_speech_16k)

    def inference_cross_lingual(self, tts_text, prompt_speech_16k, stream=False, speed=1.0):
        yield from self._speak(tts_text, prompt_speech_16k)
