"""Load the engine's parts a rank needs, the way ``WanS2V.__init__`` does, and no more.

Upstream's ``__init__`` loads T5, the VAE, the DiT and wav2vec2 on every rank. We replay its
steps (same classes from ``wan.speech2video``, same arguments, same ``_configure_model`` for the
DiT: Ulysses rebinding, barrier, FSDP sharding), but only for the parts this rank's plan needs
(:class:`~wan_s2v_runner.rank.parallel.RankPlan`): rank 0 loads T5 (unless it is FSDP-sharded, when
every rank does), wav2vec2 and the VAE; every rank loads the DiT. The result is a ``WanS2V``
built with ``__new__`` and the same attributes, so our loop calls upstream's own helper methods
(``encode_audio``, ``get_gen_size``, ...) on it. The DiT gets ``patches.context_cache``: its text
embedding and cross-attention keys/values are computed once per context, not at every step.

How the weights get there is the run's ``--load`` strategy: ``lean`` (default; models built on
meta, FSDP shards read slice by slice, a replicated CPU DiT read once per node: see
:mod:`wan_s2v_runner.loading.lean_load`) or ``full`` (upstream's constructors: every rank reads every file
it needs whole). What a rank read is in :attr:`Components.load_report`.

Where the plan says so (:func:`~wan_s2v_runner.shared.layout.dit_load_overlap`), the DiT's weights
are read on a thread of their own (:class:`DitLoad`), with their collectives on a process group of
their own, while the first job's encoders run on the main thread; :meth:`Components.ready` joins
it, on every rank at the same point (before the first denoising step), and finishes the DiT as
upstream does (``_configure_model``: its collectives on the main thread, after the join).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any, Callable, Optional

import torch

from patches import context_cache
from wan_s2v_runner.loading import block_stream, dit_cache, lean_load
from wan_s2v_runner.loading.ckpt_read import PthFile, open_dit
from wan_s2v_runner.loading.quantize import Fp8Source
from wan_s2v_runner.shared.ckpt_layout import WAV2VEC_DIR
from wan_s2v_runner.shared.layout import DitOffload, DitQuant, LoadStrategy, StreamSource
from wan_s2v_runner.shared.procfs import trim_heap
from wan_s2v_runner.shared.quant import Fp8Matmul
from wan_s2v_runner.shared.stages import Stage

log = logging.getLogger("wan_s2v.components")


class DitLoad:
    """The DiT's weights being read on a thread of their own (``read()`` fills ``model``, built on
    meta); :meth:`wait` waits for it and raises what it raised; ``finish()`` (the main thread's,
    after the wait) returns the DiT ready to run."""

    def __init__(self, model, read: Callable[[], None], finish: Callable[[], Any], device: torch.device,
                 deferred: bool = False):
        self.model, self.finish, self._error = model, finish, None
        self.started, self.read_s = time.perf_counter(), None
        self.deferred = deferred
        if deferred:  # read on the main thread when joined: after the encoders were let go
            self._read, self._thread = read, None
            return

        def run():
            try:
                if device.type == "cuda":  # a thread starts on device 0
                    torch.cuda.set_device(device)
                read()
            except BaseException as e:  # noqa: BLE001 - raised on the main thread by join()
                self._error = e
            finally:
                self.read_s = time.perf_counter() - self.started

        self._thread = threading.Thread(target=run, name="wan-s2v-dit-load", daemon=True)
        self._thread.start()

    @property
    def reading(self) -> bool:
        return self.deferred or self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the read to end (deferred: read now); raise what it raised."""
        if self.deferred:
            self.started = time.perf_counter()
            try:
                self._read()
            finally:
                self.read_s = time.perf_counter() - self.started
            return
        self._thread.join()
        if self._error is not None:
            raise self._error


class DitPlacement(str, Enum):
    """Where a rank's DiT lives while a job's steps run (the loop reads it; nothing on the model says it)."""

    DEVICE = "device"  # on the rank's device (whole, or its FSDP shards), as upstream
    HOST = "host"  # in host memory, moved to the device for a clip's steps (upstream's init_on_cpu, --offload-model)
    STREAMED = "streamed"  # its blocks copied to the device as they run (--dit-offload blocks: ``streamer``)
    NONE = "none"  # this rank runs no step (a 5-rank live pipeline's decoding rank)


class NoDit:
    """The pending DiT of a rank that holds none: nothing to read; its finish is upstream's
    ``_configure_model`` barrier, which the ranks that hold one take at the same point: at load
    (a DiT read before the encoders), at the first join (read after the encoders let go:
    ``deferred``), or at the join or an idle poll (read on its thread while they run)."""

    model = None
    reading = False
    read_s = 0.0

    def __init__(self, deferred: bool = False):
        self.deferred = deferred

    def wait(self) -> None:
        pass

    def finish(self):
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
        return None, None


@dataclass
class Components:
    shell: Any  # a WanS2V (made with __new__) holding the loaded parts and their settings
    load_report: lean_load.LoadReport = None
    pending: Optional[DitLoad] = None  # the DiT still loading on its thread (joined by ready())
    #: the streamed DiT's streamer (``loading.block_stream.BlockStreamer``), or None
    streamer: Any = None
    #: whether this rank holds a DiT at all (its plan's ``needs_dit``)
    holds_dit: bool = True
    _when_ready: list = field(default_factory=list)
    #: ``--release-encoders``: a whole T5 and wav2vec2 are let go after they encode, and built again
    #: (these loaders) when a later job needs them (:meth:`text_encoder`, :meth:`audio_encoder`)
    releases_encoders: bool = False
    _load_t5: Optional[Callable[[], Any]] = None
    _load_w2v: Optional[Callable[[], Any]] = None

    def text_encoder(self):
        """T5, built again first when it was let go."""
        if self.shell.text_encoder is None and self._load_t5 is not None:
            t0 = time.perf_counter()
            self.shell.text_encoder = self._load_t5()
            log.info("T5 built again for a new text in %.2f s", time.perf_counter() - t0)
        return self.shell.text_encoder

    def audio_encoder(self):
        """wav2vec2, built again first when it was let go."""
        if self.shell.audio_encoder is None and self._load_w2v is not None:
            self.shell.audio_encoder = self._load_w2v()
        return self.shell.audio_encoder

    def release_text_encoder(self) -> None:
        """With :attr:`releases_encoders`: let a whole T5 go (its encodings stay in the group's text
        memo); an FSDP-sharded T5 (a shard per rank, its reload collective) is kept."""
        if self.releases_encoders and self._load_t5 is not None and self.shell.text_encoder is not None:
            self.shell.text_encoder = None
            trim_heap()

    def release_audio_encoder(self) -> None:
        """With :attr:`releases_encoders`: let wav2vec2 go after the speech is encoded."""
        if self.releases_encoders and self._load_w2v is not None and self.shell.audio_encoder is not None:
            self.shell.audio_encoder = None
            trim_heap()

    @property
    def noise_model(self):
        if self.pending is not None:
            raise RuntimeError("the DiT is still loading on its thread: Components.ready() joins it first")
        return self.shell.noise_model

    @property
    def placement(self) -> DitPlacement:
        """Where the DiT lives (:class:`DitPlacement`)."""
        if not self.holds_dit:
            return DitPlacement.NONE
        if self.streamer is not None:
            return DitPlacement.STREAMED
        if self.shell.init_on_cpu and self.pending is None:  # upstream's: held on the host unless read onto the device
            first = next(self.shell.noise_model.parameters(), None)
            if first is not None and first.device.type != self.device.type:
                return DitPlacement.HOST
        return DitPlacement.DEVICE

    @property
    def guard(self):
        """fp16's non-finite guard of this rank's DiT (``patches.fp16_compute.Guard``), or None."""
        from patches import fp16_compute
        model = None if self.pending is not None or not self.holds_dit else self.shell.noise_model
        return fp16_compute.guard_of(model) if model is not None else None

    @property
    def dit_loading(self) -> bool:
        """Whether the DiT is still to be joined (:meth:`ready`)."""
        return self.pending is not None

    def dit_attr(self, name: str, default=None):
        """An attribute of the DiT's config (``num_heads``, ``blocks``...), loaded or not."""
        return getattr(self.pending.model if self.pending is not None else self.shell.noise_model, name, default)

    def when_ready(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the DiT is loaded (now, if it is)."""
        if self.pending is None:
            fn()
        else:
            self._when_ready.append(fn)

    def ready(self) -> None:
        """Join the DiT's load, if it runs on its thread, and finish the DiT. Every rank calls it at
        the same point of its work (it ends in upstream's barrier)."""
        if self.pending is None:
            return
        load, t0 = self.pending, time.perf_counter()
        load.wait()  # a read that fails leaves the DiT pending (not loaded), never half-loaded
        self.pending = None
        waited = time.perf_counter() - t0
        self.shell.noise_model, self.streamer = load.finish()  # upstream's configure (its barrier), a LoRA merge
        trim_heap()  # what the reader thread freed (its staging, fp8's float32 copies) stays in its arena
        if self.holds_dit:
            self.load_report.strategy["dit_load"] = (f"after the encoders were let go: read in {load.read_s:.2f} s"
                                                     if load.deferred else
                                                     f"while the encoders ran: read in {load.read_s:.2f} s, "
                                                     f"then {waited:.2f} s waited for it")
            self.load_report.dit_overlap = {"read_s": round(load.read_s, 3), "waited_s": round(waited, 3),
                                            "finish_s": round(time.perf_counter() - t0 - waited, 3)}
        self._loaded()

    def abandon(self) -> None:
        """A group that ends without using the DiT: wait for its read (every rank's thread ends its
        collectives), without finishing it. An error of the read is logged: the group is ending."""
        if self.pending is None:
            return
        load, self.pending = self.pending, None
        if load.deferred:  # not begun: nothing to wait for, nothing to read
            return
        try:
            load.wait()
        except Exception as e:  # noqa: BLE001 - nothing will use this DiT
            log.warning("the DiT's load, never used, failed: %s: %s", type(e).__name__, e)
            return
        if self.holds_dit:
            self.load_report.strategy["dit_load"] = f"read in {load.read_s:.2f} s on its thread, never used"
        self._loaded()  # what it read is reported all the same

    def _loaded(self) -> None:
        for fn in self._when_ready:
            fn()
        self._when_ready.clear()

    @property
    def device(self) -> torch.device:
        return self.shell.device

    @property
    def param_dtype(self) -> torch.dtype:
        return self.shell.param_dtype


@dataclass(frozen=True)
class LoadSettings:
    """How a rank loads its parts: the rank group's loading settings in one object
    (:meth:`of` reads them from a spec; the defaults load as upstream would, leanly).

    * ``strategy``: ``lean`` (models built on meta, same modules and values, less memory and
      reading) or ``full`` (upstream's constructors); ``waves`` > 1 reads in turns of local ranks.
    * ``compiled``: the DiT's blocks will be compiled (``--compile``): an FSDP-sharded DiT is
      wrapped with ``use_orig_params=True`` (upstream's own LoRA setting,
      ``shard_model(use_lora=True)``), the FSDP form torch.compile can trace; the values are the
      same flat shards either way.
    * ``dit_file``: the DiT's weights come from this single file (``--dit-file``; lean loading
      only), its config and everything else from the checkpoint directory.
    * ``t5_file``: the T5 encoder's weights come from this single file (``--t5-file``; lean
      loading only: :mod:`wan_s2v_runner.loading.t5_file`), its tokenizer from the checkpoint directory.
    * ``dit_quant`` fp8: the DiT's big Linears are held in float8_e4m3fn (``patches.fp8_linear``;
      lean loading only), and ``loras`` (LoraRef items) are merged into them as they are read,
      before quantizing (with full precision, ``patches.lora_merge`` merges them and these are not
      used); ``fp8_matmul`` how they multiply (``--fp8-matmul``, checked on this rank's device by
      ``fp8_linear.resolve_matmul``).
    * ``overlap`` (a replicated DiT, lean loading): the DiT is read on its own thread, its
      collectives on the load's own process group, and joined by :meth:`Components.ready`.
    * ``resident_blocks`` (a replicated DiT, lean loading; None: not streamed): the DiT is read
      into host memory and streamed block by block (``--dit-offload blocks``:
      :mod:`wan_s2v_runner.loading.block_stream`), its first ``resident_blocks`` blocks kept on
      the device.
    * ``stream_from`` (a streamed DiT; ``--dit-stream-from``): its host bytes in ``memory`` (one
      buffer, pinned whole), in the ``page-cache`` (a cache file in ``cache_dir``, None: the
      default, ``shared.stream_source.cache_dir``, memory-mapped: :mod:`wan_s2v_runner.loading.dit_cache`),
      or ``auto`` (``shared.stream_source.choose`` on what the node's local rank 0 measures).
    * ``t5_cpu`` (``--t5-cpu``, or the memory plan's): T5 encodes on the CPU and never moves to the
      device, as the hybrid mode's does (not with an FSDP-sharded T5).
    """
    strategy: LoadStrategy = LoadStrategy.LEAN
    waves: int = 1
    compiled: bool = False
    dit_file: Optional[Any] = None
    t5_file: Optional[Any] = None
    dit_quant: DitQuant = DitQuant.NONE
    fp8_matmul: Fp8Matmul = Fp8Matmul.DEQUANT
    loras: tuple = ()
    lora_allow_partial: bool = False
    overlap: bool = False
    resident_blocks: Optional[int] = None
    fp32_blocks: tuple = ()
    stream_from: StreamSource = StreamSource.MEMORY
    cache_dir: Optional[Any] = None
    release_encoders: bool = False
    t5_cpu: bool = False

    def __post_init__(self):  # a spelling ("fp8", "lean") is its enum, as the spec's fields are
        for name, vocabulary in (("strategy", LoadStrategy), ("dit_quant", DitQuant), ("fp8_matmul", Fp8Matmul),
                                 ("stream_from", StreamSource)):
            object.__setattr__(self, name, vocabulary(getattr(self, name)))

    @classmethod
    def of(cls, spec, overlap: bool = False) -> "LoadSettings":
        """A group spec's (or a run spec's) loading settings. A streamed DiT keeps
        ``--resident-blocks`` on the device (the launcher fills it from the memory plan; without a
        plan, ``--skip-preflight`` or the CPU, every block streams)."""
        streamed = spec.dit_offload is DitOffload.BLOCKS
        return cls(strategy=spec.load, waves=spec.load_waves or 1, compiled=spec.compile,
                   dit_file=spec.dit_file, t5_file=spec.t5_file, dit_quant=spec.dit_quant, fp8_matmul=spec.fp8_matmul,
                   loras=tuple(spec.lora), lora_allow_partial=spec.lora_allow_partial, overlap=overlap,
                   resident_blocks=(spec.resident_blocks or 0) if streamed else None,
                   stream_from=spec.dit_stream_from if streamed else StreamSource.MEMORY,
                   fp32_blocks=tuple(spec.fp32_blocks), release_encoders=bool(spec.release_encoders),
                   t5_cpu=bool(spec.t5_cpu), cache_dir=dit_cache.place_of(spec))


def load(wan, config, ckpt_dir: str, plan, device: torch.device, device_id: int,
         how: LoadSettings = LoadSettings(), on_event=None, load_group=None) -> Components:
    """The parts ``plan`` needs, loaded as ``WanS2V.__init__`` would load them, as ``how`` says
    (:class:`LoadSettings`). ``on_event(stage, **data)`` enters a stage; ``load_group``: the
    process group of a DiT read on its own thread (``how.overlap``)."""
    s2v_mod = wan.speech2video
    lay = plan.layout
    self = s2v_mod.WanS2V.__new__(s2v_mod.WanS2V)
    self.device = device
    self.config = config
    self.rank = plan.rank
    if how.t5_cpu and lay.t5_fsdp:
        raise ValueError("--t5-cpu keeps T5 whole on the CPU; an FSDP-sharded T5 (fsdp-fixed) is on the GPUs")
    self.t5_cpu = lay.t5_cpu or bool(how.t5_cpu)  # the mode's (hybrid), or --t5-cpu (the memory plan's)
    self.init_on_cpu = True
    self.num_train_timesteps = config.num_train_timesteps
    self.param_dtype = config.param_dtype
    if lay.t5_fsdp or lay.dit_fsdp or lay.use_sp:
        self.init_on_cpu = False
    # looked up at call time: patches.fsdp_no_sync rebinds shard_model in wan.speech2video
    shard_fn = partial(_shard, s2v_mod, device_id=device_id)
    dit_shard_fn = partial(shard_fn, use_lora=True) if how.compiled else shard_fn

    lean = how.strategy is LoadStrategy.LEAN
    report = lean_load.LoadReport(waves=how.waves)
    on_event = on_event or (lambda *a, **k: None)

    if how.t5_file is not None and not lean:
        raise ValueError("--t5-file is read by lean loading only")
    self.text_encoder = None
    load_t5 = load_w2v = None
    if plan.needs_t5 and lean:
        self.text_encoder = _lean_t5(wan, config, ckpt_dir, lay, shard_fn, report, on_event, t5_file=how.t5_file)
        if how.release_encoders and not lay.t5_fsdp:
            load_t5 = partial(_lean_t5, wan, config, ckpt_dir, lay, shard_fn, lean_load.LoadReport(),
                              lambda *a, **k: None, t5_file=how.t5_file)
    elif plan.needs_t5:
        self.text_encoder = s2v_mod.T5EncoderModel(
            text_len=config.text_len, dtype=config.t5_dtype, device=torch.device('cpu'),
            checkpoint_path=os.path.join(ckpt_dir, config.t5_checkpoint),
            tokenizer_path=os.path.join(ckpt_dir, config.t5_tokenizer),
            shard_fn=shard_fn if lay.t5_fsdp else None)
    self.vae = None
    if plan.needs_vae:
        self.vae = s2v_mod.Wan2_1_VAE(vae_pth=os.path.join(ckpt_dir, config.vae_checkpoint), device=self.device)
    if (how.dit_file is not None or how.dit_quant is not DitQuant.NONE) and not lean:
        raise ValueError("--dit-file and --dit-quant are read by lean loading only")
    if how.resident_blocks is not None and (not lean or lay.dit_fsdp):
        raise ValueError("a streamed DiT (--dit-offload blocks) is a replicated DiT read by lean loading")
    import torch.distributed as dist
    if how.overlap and load_group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("a DiT loaded on its thread needs a process group of its own (load_group): its "
                         "collectives would race the encoders'")
    pending, streamer = None, None
    if not plan.needs_dit:  # a live pipeline's decoding rank: no step, no DiT; upstream's barrier all the same
        self.noise_model = None
        pending = NoDit(deferred=how.release_encoders)
        if not how.overlap and not how.release_encoders:  # the holders configure theirs now: so does it
            pending.finish()
            pending = None
        report.strategy["dit"] = "none: this rank runs no denoising step"
    elif lean:
        dit = _lean_dit(self, s2v_mod, ckpt_dir, lay, dit_shard_fn, report, on_event, how, group=load_group)
        if isinstance(dit, DitLoad):
            pending, self.noise_model = dit, None
        else:
            self.noise_model, streamer = dit
    else:
        if not lay.dit_fsdp:
            noise_model = s2v_mod.WanModel_S2V.from_pretrained(ckpt_dir, torch_dtype=self.param_dtype,
                                                               device_map=self.device)
        else:
            noise_model = s2v_mod.WanModel_S2V.from_pretrained(ckpt_dir, torch_dtype=self.param_dtype)
        self.noise_model = self._configure_model(model=noise_model, use_sp=lay.use_sp, dit_fsdp=lay.dit_fsdp,
                                                 shard_fn=dit_shard_fn, convert_model_dtype=False)
        report.strategy["dit"] = "full"
    if pending is None and self.noise_model is not None:
        context_cache.apply(self.noise_model)
        _compute(self, report, how)
    self.audio_encoder = None
    if plan.needs_audio_encoder:
        load_w2v = partial(s2v_mod.AudioEncoder, model_id=os.path.join(ckpt_dir, WAV2VEC_DIR))
        self.audio_encoder = load_w2v()
    self.sp_size = lay.sp_degree
    self.sample_neg_prompt = config.sample_neg_prompt
    self.motion_frames = config.transformer.motion_frames
    self.drop_first_motion = config.drop_first_motion
    self.fps = config.sample_fps
    self.audio_sample_m = 0
    log.info("rank %d loaded %s (%s read%s)", plan.rank, ", ".join(plan.describe()["loads"]),
             lean_load.describe_bytes(report.counter.total) if lean else "whole files",
             "" if pending is None else " so far: the DiT is read after the encoders" if pending.deferred
             else " so far: the DiT goes on loading on its thread")
    parts = Components(self, report, pending, streamer, holds_dit=plan.needs_dit)
    if how.release_encoders:
        parts.releases_encoders, parts._load_t5, parts._load_w2v = True, load_t5, load_w2v
        report.strategy["encoders"] = ("let go after they encode" + (", the DiT read after them" if pending is not None
                                                                     and pending.deferred else ""))
    return parts


def _lean_dit(self, s2v_mod, ckpt_dir, lay, shard_fn, report, on_event, how: LoadSettings, group=None):
    """The DiT built on meta and filled as the layout needs (see ``lean_load``), from the
    checkpoint directory's DiT files or from ``how.dit_file``; with fp8, its target Linears
    quantized as they are read (:mod:`wan_s2v_runner.loading.quantize`). ``how.overlap`` (a
    replicated DiT): a :class:`DitLoad` reading it on its thread, its collectives on ``group``.
    ``how.resident_blocks`` (not None): read into host memory (one buffer, or the node's shared
    copy) and streamed, its first blocks on the device (:mod:`wan_s2v_runner.loading.block_stream`);
    ``how.stream_from`` the page cache (or ``auto`` choosing it): its bytes written once to a cache
    file and mapped (:mod:`wan_s2v_runner.loading.dit_cache`), the LoRAs merged as it is written."""
    from patches import fp8_linear, lora_merge
    model = lean_load.empty_dit(s2v_mod.WanModel_S2V, ckpt_dir, self.param_dtype)
    fp8, resident = how.dit_quant is DitQuant.FP8, how.resident_blocks

    @contextlib.contextmanager
    def source():  # the DiT's weights as this rank reads them (fp8: quantized as they are read)
        with open_dit(ckpt_dir, how.dit_file, counter=report.counter) as src:
            if how.dit_file is not None:
                report.strategy["dit_file"] = src.layout.describe()
            if fp8:
                shapes = {n: shape for n, (_, shape) in src.table().items()}
                src = Fp8Source(src, fp8_linear.convert(model), _lora_deltas(shapes, how, "before quantizing"))
                report.strategy["dit_quant"] = _describe_fp8(src)
                matmul, why = fp8_linear.resolve_matmul(how.fp8_matmul, self.device)
                fp8_linear.set_matmul(model, matmul)
                report.strategy["fp8_matmul"] = f"{matmul.value} ({why})"
            lean_load.check_same_keys(model, src, "DiT")
            yield src

    if not lay.dit_fsdp:
        def read():
            with source() as src:
                if resident is not None and _page_cache(src):
                    return
                if self.device.type == "cpu" or resident is not None:
                    lean_load.node_shared_weights(model, src, report, "dit", group=group, packed=resident is not None)
                else:
                    lean_load.in_turns(report.waves, lambda: lean_load.device_weights(model, src, self.device,
                                                                                      report, "dit"), group=group)
                if fp8:
                    src.share_scales(group)
                    fp8_linear.set_scales(model, src.row_scales(), self.device)

        def _page_cache(src) -> bool:
            """Stream from the page cache (``how.stream_from``, ``auto`` decided here): the DiT's
            bytes mapped from its cache file (written once, the LoRAs merged in). Whether it did."""
            layout, total = lean_load._layout(model)
            where, why = dit_cache.resolve(how.stream_from, total, max(block_stream.unit_bytes(model), default=0),
                                           ckpt_dir, group)
            report.strategy["dit_stream_from"] = why
            if where is not StreamSource.PAGE_CACHE:
                return False
            inner = src.inner if fp8 else src
            deltas = None if fp8 else _lora_deltas({n: tuple(p.shape) for n, p in model.named_parameters()}, how,
                                                   "into the DiT's page-cache file")
            scales = dit_cache.node_cached_weights(
                model, src, report, "dit", cache_dir=how.cache_dir, deltas=deltas, group=group, why=why,
                scales_of=src.row_scales if fp8 else None,
                key_of=lambda lay_: dit_cache.cache_key(inner, lay_, dit_file=how.dit_file, quant=how.dit_quant,
                                                        loras=how.loras, param_dtype=self.param_dtype))
            if fp8:
                fp8_linear.set_scales(model, scales, self.device)
            if how.loras:  # in the file's bytes: patches.lora_merge does not merge them again
                setattr(model, lora_merge.MERGED, True)
            return True

        def finish():  # upstream's: Ulysses rebinding, barrier (the main thread's collectives)
            placed = self.init_on_cpu
            if resident is not None:  # upstream's configure leaves it in host memory: streamed below
                self.init_on_cpu = True
            dit = self._configure_model(model=model, use_sp=lay.use_sp, dit_fsdp=False, shard_fn=shard_fn,
                                        convert_model_dtype=False)
            streamer = None
            if resident is not None:  # after a LoRA merge: the bytes streamed are the merged ones
                streamer = block_stream.attach(dit, self.device, resident,
                                               read_only=report.strategy.get("dit") == "node-shared",
                                               mapped=report.strategy.get("dit") == "page-cache")
                report.strategy["dit_stream"] = streamer.describe()
                self.init_on_cpu = placed  # the loop never moves a streamed DiT whole (DitPlacement.STREAMED)
            context_cache.apply(dit)
            _compute(self, report, how, dit)
            return dit, streamer

        if how.release_encoders:  # the encoders and the DiT's host copy are never held together (no overlap)
            return DitLoad(model, read, finish, self.device, deferred=True)
        if how.overlap:
            return DitLoad(model, read, finish, self.device)
        read()
        return finish()
    # the LoRAs (full precision: fp8 merged them as it read), checked against the DiT's shapes
    # before it is wrapped, and added to the slices this rank holds once they are filled
    deltas = None if fp8 else _lora_deltas({n: tuple(p.shape) for n, p in model.named_parameters()}, how,
                                           "into this rank's FSDP shards")
    with source() as src:
        model = self._configure_model(model=model, use_sp=lay.use_sp, dit_fsdp=True, shard_fn=shard_fn,
                                      convert_model_dtype=False)  # wraps on meta: shards allocated
        on_event(Stage.FINGERPRINT, what="WanModel_S2V")
        lean_load.verify_same_checkpoint(src.inner if fp8 else src, "DiT")
        on_event(Stage.LOAD, what="WanModel_S2V shards")
        if fp8:
            lean_load.in_turns(report.waves, lambda: src.measure(lean_load.shard_slices(model)))
            src.agree_scales(self.device)
        lean_load.in_turns(report.waves, lambda: lean_load.fill_fsdp_shards(model, src))
        if fp8:
            fp8_linear.set_scales(model, src.row_scales(), self.device)
    if deltas is not None:
        lean_load.merge_deltas_into_shards(model, deltas)
    report.strategy["dit"] = "fsdp shards"
    return model, None


def _compute(self, report, how: LoadSettings, dit=None) -> None:
    """The DiT computes in the run's dtype: fp16 with its fp32 layers and guard, a half dtype on
    the CPU under the CPU's autocast (``patches.fp16_compute``; bf16 and fp32 on CUDA: upstream's)."""
    from patches import fp16_compute
    dit = self.noise_model if dit is None else dit
    done = fp16_compute.apply(dit, self.param_dtype, how.fp32_blocks, self.device.type)
    if done:
        report.strategy["compute"] = f"{self.param_dtype}: " + ", ".join(f"{k} {v}" for k, v in done.items())


def _lora_deltas(shapes: dict, how: LoadSettings, where: str):
    """The run's LoRAs (``how.loras``) as fp32 deltas checked against the DiT's full-precision
    ``shapes`` (its parameter names), merged by the caller ``where`` it says (None without any)."""
    if not how.loras:
        return None
    from wan_s2v_runner.loading.lora import LoraDeltas, LoraSource
    deltas = LoraDeltas([LoraSource(ref.path, ref.strength) for ref in how.loras], shapes, how.lora_allow_partial)
    for r in deltas.records:
        log.info("LoRA %s (%s, strength %g): %d modules merged %s", r["path"], r["format"],
                 r["strength"], r["matched_modules"], where)
    return deltas


def _describe_fp8(src) -> str:
    out = f"fp8: {len(src.shapes)} Linears in float8_e4m3fn, one scale per row"
    if src.as_is:
        out += f"; {len(src.as_is)} used as the file holds them"
    if src.deltas is not None:
        out += f"; LoRAs merged before quantizing ({len(src.deltas.names)} parameters)"
    if src.requantized:
        out += (f"; {len(src.requantized)} of the file's fp8 weights a LoRA changes were dequantized, merged "
                "and requantized")
    return out


def _lean_t5(wan, config, ckpt_dir, lay, shard_fn, report, on_event, t5_file=None):
    """``T5EncoderModel`` as upstream's ``__init__`` builds it, with the weights read leanly:
    FSDP shards (``t5_fsdp``) or one private copy (the rank that encodes the prompt). ``t5_file``
    (``--t5-file``): the weights from that single file, under wan's names
    (:mod:`wan_s2v_runner.loading.t5_file`), the model of its dims; the tokenizer is still the
    checkpoint directory's."""
    cls = wan.modules.t5.T5EncoderModel
    te = cls.__new__(cls)
    te.text_len, te.dtype, te.device = config.text_len, config.t5_dtype, torch.device("cpu")
    te.tokenizer_path = os.path.join(ckpt_dir, config.t5_tokenizer)
    if t5_file is None:
        te.checkpoint_path = os.path.join(ckpt_dir, config.t5_checkpoint)
        model = lean_load.empty_t5(wan, te.checkpoint_path, te.dtype)
        opened = PthFile(te.checkpoint_path, counter=report.counter)
    else:
        from wan_s2v_runner.loading import t5_file as t5f
        opened = t5f.open_t5_file(t5_file, counter=report.counter)
        te.checkpoint_path = str(t5_file)
        model = t5f.empty_t5(wan, opened.layout.dims, te.dtype)
        report.strategy["t5_file"] = opened.layout.describe()
    with opened as src:
        lean_load.check_same_keys(model, src, "T5")
        if lay.t5_fsdp:
            model = shard_fn(model, sync_module_states=False)
            on_event(Stage.FINGERPRINT, what="T5Encoder")
            lean_load.verify_same_checkpoint(src, "T5")
            on_event(Stage.LOAD, what="T5Encoder shards")
            lean_load.in_turns(report.waves, lambda: lean_load.fill_fsdp_shards(model, src))
            report.strategy["t5"] = "fsdp shards"
        else:
            lean_load.device_weights(model, src, te.device, report, "t5")
    te.model = model
    te.tokenizer = wan.modules.t5.HuggingfaceTokenizer(name=te.tokenizer_path, seq_len=te.text_len,
                                                       clean="whitespace")
    return te


def _shard(s2v_mod, model, device_id, **kwargs):
    from patches import fp8_linear, fp16_compute
    # an fp8 DiT's weights are units of their own; fp16: the root's inputs are not cast
    with fp8_linear.own_fsdp_units(model), fp16_compute.fsdp_inputs_kept(model):
        return s2v_mod.shard_model(model, device_id=device_id, **kwargs)
