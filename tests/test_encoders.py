"""rank/encoders.py: a group's T5 encodings kept and evicted as the loop needs them; wav2vec2
moved to the GPU for an encode and always back (a fake module records where it was sent: the
moves are the contract, and no GPU is needed to check them); a GPU out of memory falls back to
upstream's CPU encode."""
from __future__ import annotations

import pytest
import torch

from wan_s2v_runner.rank import encoders
from wan_s2v_runner.rank.encoders import TextContexts, audio_encoder_on
from wan_s2v_runner.shared.encoder_placement import AudioEncoderDevice

GPU = torch.device("cuda", 0)


def test_texts_of_one_call_never_evict_each_other():
    """keep=2: the negative prompt, the oldest entry, survives a new prompt of the same call; T5
    runs exactly for ``new``."""
    memo, calls = TextContexts(keep=2), []

    def t5(text):
        calls.append(text)
        return [text.upper()]

    assert memo.get_all(["a", "neg"], t5) == [["A"], ["NEG"]] and calls == ["a", "neg"]
    assert memo.get_all(["c", "c"], t5) == [["C"], ["C"]] and calls[-1] == "c"  # "a" or "neg" goes
    memo = TextContexts(keep=2)
    memo.get_all(["a", "neg"], t5)
    memo.get_all(["neg", "x"], t5)  # "neg" marked used first: "a" is evicted, not "neg"
    assert memo.new(["b", "neg"]) == ["b"] and "a" not in memo
    before = len(calls)
    memo.get_all(["b", "neg"], t5)
    assert calls[before:] == ["b"] and memo.hits == 2 and memo.misses == 4


class FakeWav2Vec2:
    """Records where ``.to`` sends it; ``fail_to`` makes a move to that device raise."""

    def __init__(self, fail_to=None):
        self.moves, self.fail_to = [], fail_to

    def to(self, device):
        self.moves.append(torch.device(device).type)
        if self.fail_to == torch.device(device).type:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return self


class FakeEncoder:
    def __init__(self, model):
        self.model = model


def test_wav2vec2_goes_back_to_the_cpu_whatever_happens():
    model = FakeWav2Vec2()
    with audio_encoder_on(FakeEncoder(model), AudioEncoderDevice.GPU, GPU):
        assert model.moves == ["cuda"]
    assert model.moves == ["cuda", "cpu"]
    model = FakeWav2Vec2()
    with pytest.raises(RuntimeError, match="in the encode"):
        with audio_encoder_on(FakeEncoder(model), AudioEncoderDevice.GPU, GPU):
            raise RuntimeError("in the encode")
    assert model.moves == ["cuda", "cpu"]
    model = FakeWav2Vec2(fail_to="cuda")  # the move itself runs out of memory half way
    with pytest.raises(torch.OutOfMemoryError):
        with audio_encoder_on(FakeEncoder(model), AudioEncoderDevice.GPU, GPU):
            pass
    assert model.moves == ["cuda", "cpu"]
    model = FakeWav2Vec2()
    with audio_encoder_on(FakeEncoder(model), AudioEncoderDevice.CPU, GPU):
        pass
    assert model.moves == []  # upstream's placement: never moved


def test_an_encode_out_of_gpu_memory_runs_again_on_the_cpu(monkeypatch):
    """The rule looked at free memory; another process can take it before the encode: the encode
    then runs on the CPU, as upstream's, and the job goes on."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)  # no CUDA here: nothing to free
    model = FakeWav2Vec2(fail_to="cuda")

    class Shell:
        audio_encoder = FakeEncoder(model)
        encoded_on = []

        def encode_audio(self, path, infer_frames):
            self.encoded_on.append(model.moves[-1] if model.moves else "cpu")
            return "features", 1

    shell = Shell()
    assert encoders.encode_audio(shell, AudioEncoderDevice.GPU, GPU, "speech.wav", 8) == ("features", 1)
    assert model.moves == ["cuda", "cpu"] and shell.encoded_on == ["cpu"]
    with pytest.raises(torch.OutOfMemoryError):  # on the CPU already: nothing to fall back to
        def oom(*a, **k):
            raise torch.OutOfMemoryError("host (test)")
        shell.encode_audio = oom
        encoders.encode_audio(shell, AudioEncoderDevice.CPU, torch.device("cpu"), "speech.wav", 8)


def test_placement_on_the_cpu_is_upstreams():
    where, why = encoders.placement(FakeEncoder(FakeWav2Vec2()), torch.device("cpu"), "/no/such.wav")
    assert where is AudioEncoderDevice.CPU and "as upstream" in why
