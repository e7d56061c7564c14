"""Patch: speech already at 16 kHz mono is read with libsndfile directly, not through librosa's first load.

Upstream: ``AudioEncoder.extract_audio_feat`` (``wan/modules/s2v/audio_encoder.py``) calls
``librosa.load(audio_path, sr=16000)``. librosa's first ``load`` imports its lazy parts (numba,
scipy.signal: 1.7-2.8 s measured on this CPU, issue #48) even when the file is already at 16 kHz
and nothing is resampled; rank 0 pays it before the other ranks get the audio features.
Change: the name ``librosa`` in that module is bound to :class:`LibrosaProxy`, whose
``load(path, sr=16000)`` reads a 16 kHz mono file that libsndfile decodes with ``soundfile`` as
float32: what ``librosa.load`` itself does for such a file (it decodes with soundfile, and
neither mixes down nor resamples), so the samples are the same. Anything else (another rate,
several channels, a format libsndfile cannot read, other arguments) goes to ``librosa.load``
unchanged; every other attribute is librosa's.
Measured (tiny demo run, 1 rank, this CPU, two runs each): the ``audio_encode`` stage took
2.03-2.64 s before, 0.04 s after.
Proof: tests/test_patches.py (the same samples and rate as ``librosa.load`` for a 16 kHz mono
wav and flac; a 22.05 kHz file, a stereo file and other arguments go to librosa and give its
result; a patched load does not import numba or scipy.signal).
"""
from __future__ import annotations

import logging

from patches.patch import Patch, always

log = logging.getLogger("wan_s2v.audio_load")

#: the rate upstream asks for (wav2vec2's)
RATE = 16000


class LibrosaProxy:
    """``librosa`` for ``audio_encoder``: ``load`` short-cuts 16 kHz mono files; the rest is librosa's."""

    def __init__(self, librosa_module):
        self._librosa = librosa_module
        self.direct = 0  # loads served without librosa (tests and the log read it)

    def __getattr__(self, name):
        return getattr(self._librosa, name)

    def load(self, path, sr=22050, **kwargs):
        if sr == RATE and not kwargs:
            samples = read_16k_mono(path)
            if samples is not None:
                self.direct += 1
                return samples, RATE
        return self._librosa.load(path, sr=sr, **kwargs)


def read_16k_mono(path):
    """The float32 samples of a 16 kHz single-channel file libsndfile reads, else None."""
    try:
        import soundfile as sf
        with sf.SoundFile(path) as f:
            if f.samplerate != RATE or f.channels != 1:
                return None
            return f.read(dtype="float32", always_2d=False)
    except Exception:  # noqa: BLE001 - anything libsndfile cannot do is librosa's to do (audioread, ...)
        return None


def apply(wan_module) -> bool:
    """Bind the proxy in ``wan.modules.s2v.audio_encoder``. Returns False if already applied."""
    mod = wan_module.modules.s2v.audio_encoder
    if isinstance(mod.librosa, LibrosaProxy):
        return False
    mod.librosa = LibrosaProxy(mod.librosa)
    return True


def restore(wan_module) -> bool:
    mod = wan_module.modules.s2v.audio_encoder
    if not isinstance(mod.librosa, LibrosaProxy):
        return False
    mod.librosa = mod.librosa._librosa
    return True


def _for_run(wan_module, ctx) -> str:
    apply(wan_module)
    return "16 kHz mono speech read with libsndfile (librosa's first load skipped)"


PATCH = Patch("audio_load", applies=always, apply=_for_run, restore=restore)
