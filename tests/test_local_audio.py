"""patches.local_audio: under Ulysses SP each rank injects the audio into its own tokens, with
no all-gather, and the result is upstream's bit for bit (fp32, CPU).

No process group: Ulysses SP is simulated by rebinding ``get_rank`` / ``get_world_size`` (and a
counting ``gather_forward``) in ``wan.modules.s2v.model_s2v``, and by handing each simulated rank
its ``torch.chunk`` of a hidden state, as ``WanModel_S2V.forward`` does. The model state the
injection reads (audio embeddings, original_seq_len, the full sequence length) comes from one real
forward of the tiny DiT."""
from __future__ import annotations

import pytest
import torch

# 5 latent frames of 4x4 tokens: original_seq_len 80 (n = 16 per frame), + 16 reference + 24
# motion tokens = 120. 2 ranks: [0, 60) ends mid-frame, [60, 120) starts mid-frame and holds all
# reference/motion tokens; 3 ranks: [40, 80) starts mid-frame, [80, 120) holds no audio token;
# 4 ranks: [30, 60) and [60, 90) start mid-frame, [60, 90) holds audio and reference tokens;
# 9 ranks: chunks of 14 tokens, shorter than a frame.
FRAMES, HW = 5, 8
DIMS = dict(seed=7, dit_dim=64, dit_heads=4, dit_layers=2, wav2vec_hidden=32)


@pytest.fixture(scope="module")
def wan():
    from patches import attention
    from wan_s2v_runner.loading.engine import import_wan
    w = import_wan()
    attention.apply(w, "sdpa")
    return w


@pytest.fixture(scope="module")
def local_audio(wan):
    from patches import local_audio
    applied = local_audio.apply(wan)
    yield local_audio
    if applied:  # leave the class as other tests in this process expect it
        local_audio.remove(wan)


@pytest.fixture(scope="module")
def ms(wan):
    return wan.modules.s2v.model_s2v


@pytest.fixture(scope="module")
def model(local_audio, ms, tmp_path_factory):
    """The tiny DiT after one (one-process) forward: the state after_transformer_block reads."""
    from wan_s2v_runner.demo.tiny_checkpoint import build_tiny_checkpoint
    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", **DIMS)
    dit = ms.WanModel_S2V.from_pretrained(str(ckpt), torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g)
    with torch.no_grad():
        dit([r(16, FRAMES, HW, HW)], t=torch.tensor([500.0]), context=[r(16, 4096)], seq_len=None,
            ref_latents=r(1, 16, 1, HW, HW), motion_latents=r(1, 16, 19, HW, HW),
            cond_states=torch.zeros(1, 16, FRAMES, HW, HW), audio_input=r(1, 25, 32, 4 * FRAMES),
            motion_frames=[73, 19], drop_motion_frames=False)
    return dit


def upstream(ms):
    return ms.WanModel_S2V.after_transformer_block.__wan_s2v_original__


@pytest.fixture
def sp(ms, model, monkeypatch):
    """Simulated Ulysses SP: ``sp.run(fn, block, h, world)`` -> each rank's output of
    ``fn(model, block, its chunk of h)``; ``sp.gathers`` counts gather_forward calls."""
    class SP:
        gathers = 0
        full = None  # what the counting gather_forward returns (the all-gathered sequence)

        def run(self, fn, block, h, world):
            self.full = h
            outs = []
            for rank in range(world):
                monkeypatch.setattr(ms, "get_rank", lambda rank=rank: rank)
                monkeypatch.setattr(ms, "get_world_size", lambda: world)
                with torch.no_grad():
                    outs.append(fn(model, block, torch.chunk(h, world, dim=1)[rank].clone()))
            return outs

    s = SP()

    def gather_forward(x, dim):
        s.gathers += 1
        return s.full.clone()
    monkeypatch.setattr(ms, "gather_forward", gather_forward)
    monkeypatch.setattr(model, "use_context_parallel", True)
    return s


def one_process(ms, model, block, h):
    model.use_context_parallel = False
    try:
        with torch.no_grad():
            return upstream(ms)(model, block, h.clone())
    finally:
        model.use_context_parallel = True


def hidden(model, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, model._wan_s2v_seq_len, model.dim, generator=g)


# --------------------------------------------------------------------------- exactness
CASES = [  # world, adain (else pre-norm), batch, torch threads
    (2, True, 1, 1), (3, True, 1, 1), (4, True, 1, 1), (9, True, 1, 1),
    (2, False, 1, 1), (3, False, 2, 1), (2, True, 2, 1), (3, True, 2, 1),
    (2, True, 1, 2), (2, False, 1, 2), (4, False, 1, 2), (3, True, 2, 2),
]


@pytest.mark.parametrize("world,adain,batch,threads", CASES,
                         ids=[f"w{w}-{'adain' if a else 'prenorm'}-b{b}-t{t}" for w, a, b, t in CASES])
def test_ranks_concatenated_equal_one_process_bitwise(ms, model, sp, monkeypatch, world, adain, batch,
                                                      threads):
    """BLAS picks its kernels by row count *and* thread count: on 1 thread, an adain embedding
    projection over the chunk's frames only already differs from upstream's; on 2 threads the
    audio k/v projections over the chunk's frames do too (so both cases are here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_ranks(ms, model, sp, monkeypatch, world, adain, batch)
    finally:
        torch.set_num_threads(before)


def _check_ranks(ms, model, sp, monkeypatch, world, adain, batch):
    orig, seq_len = int(model.original_seq_len), model._wan_s2v_seq_len
    n = orig // model.merged_audio_emb.shape[1]
    assert (orig, seq_len, n) == (80, 120, 16)
    starts = [sum(c.shape[1] for c in torch.chunk(torch.empty(1, seq_len), world, dim=1)[:r])
              for r in range(world)]
    ends = starts[1:] + [seq_len]
    assert any(s < orig and s % n for s in starts)  # a chunk starts mid-frame
    assert any(e > orig for e in ends)  # a chunk holds reference/motion tokens
    assert any(s < orig < e for s, e in zip(starts, ends)) == (world != 3)  # ... and audio ones
    if not adain:
        monkeypatch.setattr(model, "enbale_adain", False)
    if batch == 2:  # a second item with its own audio
        g = torch.Generator().manual_seed(3)
        for name in ("merged_audio_emb", "audio_emb_global"):
            a = getattr(model, name)
            monkeypatch.setattr(model, name, torch.cat([a, torch.randn(a.shape, generator=g)]))
    h = hidden(model, batch)
    for block in model.audio_injector.injected_block_id:
        full = one_process(ms, model, block, h)
        assert not torch.equal(full[:, :orig], h[:, :orig])  # the injection does something
        assert torch.equal(full[:, orig:], h[:, orig:])  # and nothing to reference/motion tokens
        outs = sp.run(ms.WanModel_S2V.after_transformer_block, block, h, world)
        assert [o.shape[1] for o in outs] == [e - s for s, e in zip(starts, ends)]
        y = torch.cat(outs, dim=1)
        assert torch.equal(y, full), (block, (y - full).abs().max().item())
    assert sp.gathers == 0


def test_equals_upstream_sp_path_per_rank_without_its_gather(ms, model, sp):
    """Against upstream's own SP path (its gather simulated): same chunk per rank, bitwise;
    upstream gathers once per rank and injection block, the patch never."""
    h = hidden(model, 1, seed=2)
    blocks = list(model.audio_injector.injected_block_id)
    for world in (2, 3):
        for block in blocks:
            ref = sp.run(upstream(ms), block, h, world)
            before = sp.gathers
            outs = sp.run(ms.WanModel_S2V.after_transformer_block, block, h, world)
            assert sp.gathers == before
            assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    assert sp.gathers == 2 * len(blocks) + 3 * len(blocks)  # upstream's calls only


# --------------------------------------------------------------------------- placement / fallback
def test_sequence_length_recorded_and_chunk_span_is_torch_chunk(model, local_audio):
    assert model._wan_s2v_seq_len == 120
    for length in (1, 5, 7, 119, 120, 121):
        for world in (1, 2, 3, 4, 8):
            sizes = [c.shape[1] for c in torch.chunk(torch.empty(1, length), world, dim=1)]
            spans = [local_audio.chunk_span(length, world, r) for r in range(world)]
            assert [e - s for s, e in spans[:len(sizes)]] == sizes
            assert all(s == e for s, e in spans[len(sizes):])  # torch.chunk gave fewer chunks


def test_unplaceable_call_runs_upstream(ms, model, sp, monkeypatch):
    """No recorded length (or a chunk that is not torch.chunk's): upstream's path, gather and all."""
    h = hidden(model, 1, seed=4)
    block = next(iter(model.audio_injector.injected_block_id))
    monkeypatch.delattr(model, "_wan_s2v_seq_len")
    outs = sp.run(ms.WanModel_S2V.after_transformer_block, block, h, 2)
    assert sp.gathers == 2
    assert torch.equal(torch.cat(outs, dim=1), one_process(ms, model, block, h))
    monkeypatch.setattr(model, "_wan_s2v_seq_len", 130, raising=False)  # chunks of 65, not 60
    sp.run(ms.WanModel_S2V.after_transformer_block, block, h, 2)
    assert sp.gathers == 4


def test_one_process_path_is_upstream_and_apply_is_idempotent(wan, ms, model, local_audio):
    assert local_audio.apply(wan) is False
    h = hidden(model, 1, seed=5)
    for block in (*model.audio_injector.injected_block_id, 99):
        with torch.no_grad():
            assert torch.equal(ms.WanModel_S2V.after_transformer_block(model, block, h.clone()),
                               upstream(ms)(model, block, h.clone()))
