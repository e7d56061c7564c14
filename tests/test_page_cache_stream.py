"""``--dit-stream-from page-cache``: the streamed DiT's bytes written once to a cache file and
memory-mapped (``wan_s2v_runner.loading.dit_cache``), each unit copied through two staging
buffers (``block_stream``, ``mapped``), and ``auto``'s rule (``shared.stream_source``).

Proven here, on the CPU (the staging a plain copy on a thread of its own): frames streamed from the
page cache equal the resident run's and the memory stream's exactly, in full precision, fp8 (its
row scales kept in the file) and with LoRAs (merged as the file is written, never twice); the file
is written once and reused untouched, another --dit-quant or LoRA names another; its pages are a
file mapping, not anonymous memory; the mapping is never pinned, only the staging; a crashed
writer's temporary and a truncated file are never used, a full disk fails in one line and leaves
nothing; two local ranks write it once and both map it.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.conftest import cpu_engine
from tests.test_block_stream import BLOCKS, _run, generate, passes, streamed
from wan_s2v_runner.loading import block_stream, dit_cache, lean_load
from wan_s2v_runner.shared.layout import DitQuant, StreamSource

GiB = 2**30


@pytest.fixture(scope="module")
def five(tiny_assets, tmp_path_factory):
    """The demo's inputs with a 5-block tiny DiT (as tests/test_block_stream.py's)."""
    from wan_s2v_runner.demo.tiny_checkpoint import build_tiny_checkpoint
    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("five") / "ckpt", dit_layers=BLOCKS)
    return SimpleNamespace(ckpt_dir=ckpt, image=tiny_assets.image, audio=tiny_assets.audio)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "dit-cache"
    monkeypatch.setenv("WAN_S2V_DIT_CACHE_DIR", str(d))
    return d


def paged(resident: int = 0, **more) -> dict:
    return {**streamed(resident), "dit_stream_from": StreamSource.PAGE_CACHE, **more}


def mapping_of(path) -> dict:
    """This process's /proc/self/smaps figures (kB) summed over the mappings of ``path``."""
    out: dict = {}
    current = False
    for line in open("/proc/self/smaps", encoding="utf-8"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            current = len(head) >= 6 and head[5] == str(path)
            out["mappings"] = out.get("mappings", 0) + current
            if current:
                out.setdefault("perms", set()).add(head[1])
        elif current and head and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
            out[head[0][:-1]] = out.get(head[0][:-1], 0) + int(head[1])
    return out


def test_the_auto_rule():
    """Memory while the whole DiT beside the rest fits 85% of the available RAM, else the page cache
    (a 32 GB machine with a bf16 or an fp8 DiT); the RAM unknown: memory, as before."""
    from wan_s2v_runner.shared.stream_source import HOST_FILL, choose, staging_bytes
    assert choose(16 * GiB, 4 * GiB, 64 * GiB)[0] is StreamSource.MEMORY  # a 64 GB box, fp8
    where, why = choose(int(30.4 * GiB), 12 * GiB, 28 * GiB, local_ranks=1, slot_bytes=int(1.02 * GiB))
    assert where is StreamSource.PAGE_CACHE and "28.0 GiB" in why and "14.0 GiB" in why  # 12 + 2 x 1.02
    assert choose(int(16.1 * GiB), 12 * GiB, 28 * GiB)[0] is StreamSource.PAGE_CACHE  # 32 GB, fp8 + T5
    edge = int(HOST_FILL * 40 * GiB)
    assert choose(edge - GiB, GiB, 40 * GiB)[0] is StreamSource.MEMORY
    assert choose(edge - GiB + 1, GiB, 40 * GiB)[0] is StreamSource.PAGE_CACHE
    assert choose(100 * GiB, 0, None)[0] is StreamSource.MEMORY
    assert "tight even so" in choose(30 * GiB, 30 * GiB, 20 * GiB, 2, GiB)[1]
    assert staging_bytes(GiB) == 2 * GiB


def test_the_setting_needs_a_streamed_dit(five, monkeypatch):
    """page-cache without --dit-offload blocks is refused (cause + fix); auto and memory are the
    vocabulary's other words; the environment sets it."""
    from pydantic import ValidationError

    from wan_s2v_runner.loading.components import LoadSettings
    from wan_s2v_runner.shared.spec import RunSpec
    base = dict(ckpt_dir=five.ckpt_dir, image=five.image, audio=five.audio, prompt="p", device="cpu")
    with pytest.raises(ValidationError, match="add --dit-offload blocks or drop it"):
        RunSpec(**base, dit_stream_from="page-cache")
    assert RunSpec(**base).dit_stream_from is StreamSource.AUTO
    assert RunSpec(**base, dit_stream_from="memory").dit_stream_from is StreamSource.MEMORY
    spec = RunSpec(**base, dit_offload="blocks", dit_stream_from="page-cache")
    assert LoadSettings.of(spec).stream_from is StreamSource.PAGE_CACHE
    assert LoadSettings.of(RunSpec(**base, dit_stream_from="auto")).stream_from is StreamSource.MEMORY  # not streamed


def test_page_cache_frames_equal_and_the_file_is_written_once(five, cache):
    """(a) every block streamed from the page cache == resident == streamed from memory, the same
    copies; (c) the file's pages are a file mapping of this process, no anonymous page in it,
    the staging two slots; (b) a second run reuses the file (not written: same inode, mtime, size;
    the DiT not read), with the same frames."""
    from wan_s2v_runner.loading.ckpt_read import SafetensorsFiles
    with cpu_engine(five) as engine:
        want, _ = generate(engine)
        memory, mem_parts = generate(engine, **streamed(0), dit_stream_from="memory")
        got, parts = generate(engine, **paged(0))
        assert torch.equal(memory, want) and torch.equal(got, want)
        report = parts.load_report.as_dict()
        entry = report["strategy"]["dit_cache"]
        assert report["strategy"]["dit"] == "page-cache" and entry["action"] == "written"
        path = cache / os.path.basename(entry["path"])
        assert path.is_file() and list(cache.glob("dit-*.bin")) == [path]
        s, m = parts.streamer, mem_parts.streamer
        assert s.copies == m.copies == BLOCKS * passes() + 1
        d = s.describe()
        assert (d["host"], d["mapped_bytes"], d["staging_bytes"]) == ("page-cache", entry["bytes"], 2 * s.slot_bytes)
        assert m.describe()["host"] == "pageable" and m.describe()["staging_bytes"] == 0
        # (c) every page of the mapping was touched (every unit copied): all file-backed, none anonymous
        smaps = mapping_of(path)
        assert smaps.get("mappings", 0) >= 1, "the cache file is not mapped: its bytes were copied"
        assert smaps["Size"] * 1024 >= entry["bytes"]
        assert smaps["Rss"] * 1024 >= s.host_bytes  # the streamed units' pages are in, as the file's
        assert smaps["Anonymous"] == 0, smaps  # nothing was written into it (no private copy of a page)
        # read-only and shared: a private writable mapping is charged whole against the commit limit
        assert smaps["perms"] == {"r--s"}, smaps
        before = path.stat()
        weights_written = report["bytes_read"]["weights"]
        again, parts2 = generate(engine, **paged(0))
        assert torch.equal(again, want)
        entry2 = parts2.load_report.strategy["dit_cache"]
        assert entry2["action"] == "reused" and entry2["path"] == entry["path"]
        after = path.stat()
        assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
        with SafetensorsFiles.in_dir(five.ckpt_dir) as dit_files:  # the DiT's files are not read again
            assert weights_written - parts2.load_report.as_dict()["bytes_read"]["weights"] == dit_files.tensor_bytes()


def test_fp8_and_loras_make_files_of_their_own(five, cache, tmp_path):
    """(b) --dit-quant fp8 names another file, a LoRA another again; fp8's row scales come back
    from the file (a reused fp8 file gives the same frames); a full-precision LoRA is merged as
    the file is written and not again by patches.lora_merge: every case equals its memory run."""
    from patches import lora_merge
    from tests.test_fp8 import comfy_lora
    from wan_s2v_runner.loading.lora import merger
    from wan_s2v_runner.shared.spec import LoraRef
    lora = [LoraRef.model_validate(str(comfy_lora(five.ckpt_dir, tmp_path / "lora.safetensors")))]
    with cpu_engine(five) as engine:
        files = []
        for extra in ({"dit_quant": DitQuant.FP8}, {"dit_quant": DitQuant.FP8, "lora": lora}):
            want, _ = generate(engine, num_clips=1, **extra)
            got, parts = generate(engine, num_clips=1, **paged(1), **extra)
            assert torch.equal(got, want), extra
            files.append(parts.load_report.strategy["dit_cache"]["path"])
            again, parts = generate(engine, num_clips=1, **paged(2), **extra)  # reused: scales from the file
            assert parts.load_report.strategy["dit_cache"]["action"] == "reused"
            assert torch.equal(again, want), extra
        plain, _ = generate(engine, num_clips=1)
        lora_merge.apply(engine[0], merger(lora))  # what apply_for_run does for a full-precision run with a LoRA
        try:
            want, _ = generate(engine, lora=lora, num_clips=1, **streamed(0), dit_stream_from="memory")
            got, parts = generate(engine, lora=lora, num_clips=1, **paged(0))
            files.append(parts.load_report.strategy["dit_cache"]["path"])
            again, _ = generate(engine, lora=lora, num_clips=1, **paged(0))
        finally:
            lora_merge.restore(engine[0])
        assert torch.equal(got, want) and torch.equal(again, want) and not torch.equal(want, plain)
        _, parts = generate(engine, num_clips=1, **paged(0))
        files.append(parts.load_report.strategy["dit_cache"]["path"])
    assert len(set(files)) == 4, files
    assert sorted(str(p) for p in cache.glob("dit-*.bin")) == sorted(files)


class Toy(nn.Module):
    """Three 'blocks' (the streamer's unit is a block: ``model.blocks``), run in turn."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def test_the_streamer_pins_the_staging_never_the_mapping(tmp_path):
    """A model whose weights are a file's private mapping, streamed ``mapped``: the pinner is handed
    the two staging buffers and nothing of the mapping; the output equals the plain model's; the
    mapping's bytes are unchanged (its private pages never written)."""
    torch.manual_seed(0)
    plain = Toy()
    layout, total = lean_load._layout(plain)
    path = tmp_path / "toy.bin"
    storage = torch.UntypedStorage.from_file(str(path), True, total)  # write it through a shared mapping
    views = lean_load._views(storage, layout)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            views[name].copy_(p)
    del views, storage
    before = path.read_bytes()
    with torch.device("meta"):
        model = Toy()
    mapped = torch.UntypedStorage.from_file(str(path), False, total)
    model.load_state_dict(lean_load._views(mapped, layout), strict=True, assign=True)
    handed = []

    def pinner(tensors, read_only):
        handed.extend(tensors)
        return sum(t.numel() * t.element_size() for t in tensors), [], []

    s = block_stream.attach(model, "cpu", 0, pinner=pinner, mapped=True)
    try:
        x = torch.randn(5, 16)
        for _ in range(3):
            assert torch.equal(model(x), plain(x))
        assert [t.data_ptr() for t in handed] == [t.data_ptr() for t in s.staging]
        assert mapped.data_ptr() not in {t.untyped_storage().data_ptr() for t in handed}
        d = s.describe()
        assert d["pinned_bytes"] == d["staging_bytes"] == 2 * s.slot_bytes and not d["pageable"]
        assert s.copies == 3 * 3 + 1
    finally:
        s.detach()
    assert path.read_bytes() == before


class FakeSource:
    """A checkpoint source of a model's parameters (random values), counting what it reads."""

    def __init__(self, model, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.values = {n: torch.randn(p.shape, generator=g).to(p.dtype) for n, p in model.named_parameters()}
        self.read = 0

    def read_flat(self, name, start, out, purpose="weights"):
        out.copy_(self.values[name].reshape(-1)[start:start + out.numel()])
        self.read += out.numel()


def _toy_layout():
    with torch.device("meta"):
        model = Toy()
    return model, *lean_load._layout(model)


def test_a_crashed_writers_leftovers_are_never_used(tmp_path):
    """(d) A dead writer's half-written temporary is removed (a live process's is left alone), a
    truncated file under the final name is rewritten: what is mapped is whole and right."""
    from wan_s2v_runner.shared import atomic
    model, layout, total = _toy_layout()
    src = FakeSource(model)
    key = "k" * 32
    dest = dit_cache.path_for(tmp_path, key)
    done = subprocess.Popen(["true"])
    done.wait()
    dead = atomic.temp_name(dest, pid=done.pid)
    live = atomic.temp_name(dest, pid=os.getppid())
    tmp_path.mkdir(exist_ok=True)
    for p in (dead, live):
        p.write_bytes(b"\x00" * (total // 2))
    dest.write_bytes(b"\x01" * total)  # the right size, no trailer: a copy cut short
    found = dit_cache.ensure(tmp_path, key, layout, total, src)
    assert found.action == "written" and src.read > 0
    assert not dead.exists() and live.exists()
    with torch.device("meta"):
        got = Toy()
    dit_cache.map_into(got, found, layout)
    for name, p in got.named_parameters():
        assert torch.equal(p, src.values[name]), name
    src.read = 0
    assert dit_cache.ensure(tmp_path, key, layout, total, src).action == "reused" and src.read == 0
    # another layout (or a foreign file) under the name is not taken for this one
    assert dit_cache.read(dest, total, "another layout") is None


def test_a_full_disk_fails_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """Too little free space: refused before reading anything; ENOSPC while writing: the temporary
    removed, no file under the final name; both say the cause and the fix in one line."""
    model, layout, total = _toy_layout()
    src = FakeSource(model)
    Usage = namedtuple("Usage", "total used free")
    with monkeypatch.context() as m:
        m.setattr(dit_cache.shutil, "disk_usage", lambda p: Usage(10**12, 10**12, 1000))
        with pytest.raises(dit_cache.DitCacheError) as e:
            dit_cache.ensure(tmp_path, "a" * 32, layout, total, src)
    assert src.read == 0 and "\n" not in str(e.value)
    assert "Fix: free space" in str(e.value) and "$WAN_S2V_DIT_CACHE_DIR" in str(e.value)

    calls = []

    def full(fd, data, offset):
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        os.pwrite(fd, data, offset)

    monkeypatch.setattr(dit_cache, "_pwrite", full)
    with pytest.raises(dit_cache.DitCacheError, match="Fix: free space") as e:
        dit_cache.ensure(tmp_path, "b" * 32, layout, total, src)
    assert "\n" not in str(e.value)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".bin"] == []  # no temporary, no file


@pytest.mark.slow(seconds=15)
def test_two_local_ranks_write_it_once_and_both_map_it(five, tmp_path):
    """(e) Real ranks over gloo, ulysses at 2 ranks, every block streamed from the page cache:
    local rank 0 writes the file, local rank 1 waits and maps it (one file); the frames equal
    one resident process's."""
    cache = tmp_path / "cache"
    r = _run(five, tmp_path / "two", "--nproc", "2", "--dit-offload", "blocks", "--dit-stream-from", "page-cache",
             env={"WAN_S2V_DIT_CACHE_DIR": str(cache)})
    assert r.returncode == 0, r.output
    with cpu_engine(five) as engine:
        want, _ = generate(engine)
    assert torch.equal(torch.load(tmp_path / "two" / "f.pt"), want)
    files = list(cache.glob("dit-*.bin"))
    assert len(files) == 1 and not [p for p in cache.iterdir() if p.name.startswith(".") and p.suffix == ".bin"]
    run_dir = next((tmp_path / "two" / "runs").glob("*"))
    actions = []
    for rank in range(2):
        events = (run_dir / "events" / f"rank{rank}.jsonl").read_text()
        loaded = next(json.loads(e) for e in events.splitlines() if '"loaded"' in e)
        assert loaded["strategy"]["dit"] == "page-cache", rank
        assert loaded["strategy"]["dit_cache"]["path"] == str(files[0])
        assert loaded["strategy"]["dit_stream"]["host"] == "page-cache"
        actions.append(loaded["strategy"]["dit_cache"]["action"])
    assert actions == ["written", "mapped (written by the node's leading rank)"], actions


def test_auto_asks_the_rule_with_what_the_rank_measures(five, cache, monkeypatch):
    """--dit-stream-from auto on the rank: the rule on MemAvailable (here a machine far too small
    for the DiT beside its encoders: the page cache, said why; a large one: memory)."""
    from wan_s2v_runner.shared import procfs
    with cpu_engine(five) as engine:
        want, _ = generate(engine, num_clips=1)
        monkeypatch.setattr(procfs, "mem_available", lambda: 2**20)
        got, parts = generate(engine, num_clips=1, **streamed(0), dit_stream_from="auto")
        assert torch.equal(got, want)
        assert parts.load_report.strategy["dit"] == "page-cache"
        assert parts.load_report.strategy["dit_stream_from"].startswith("auto: page-cache: the DiT's")
        monkeypatch.setattr(procfs, "mem_available", lambda: 2**40)
        _, parts = generate(engine, num_clips=1, **streamed(0), dit_stream_from="auto")
        assert parts.load_report.strategy["dit"] == "private (one buffer)"
        assert parts.load_report.strategy["dit_stream_from"].startswith("auto: memory: the DiT's")
