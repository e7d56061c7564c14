"""The live recipe's step driver (``--mode live``): LiveAvatar's causal few-step S2V, block by block,
the denoising steps pipelined over the ranks, the video written as each block decodes. Driven by the
job shell (:mod:`~wan_s2v_runner.rank.job_shell`: inputs, DiT join, precision, end).

Per job:

1. **What the shell encodes**: wav2vec2 features for 12-frame blocks; the reference encoded as
   LiveAvatar does (5 copies of the image, the second latent frame kept) and the initial motion
   latents (the reference repeated over the 73 motion frames, encoded: never refreshed afterwards);
   the prompt's T5 context (no CFG: no negative prompt).
2. **The sink** (:class:`DitStage`, every rank that runs steps): the condition tokens' keys and
   values, once per job.
3. **The blocks**, through the layout's stages (``Layout.stages``): a block's noise is LiveAvatar's
   (a 4-block window's worth drawn from ``seed + window``, the block's 3 frames sliced) made by the
   rank of the first step; each rank runs its steps against its own step caches and sends the
   block on (``isend``: a rank never waits for the next one to take it). Every link carries one
   buffer a block: the block's step message (:mod:`~wan_s2v_runner.rank.step_control`) and its
   latents (:data:`~wan_s2v_runner.rank.step_control.LINK_DTYPE`), and the stream of a job ends with
   one terminal message that says why (done, cancelled, lost, or a fault and where).
4. **The decoding rank** (:class:`Decoder`) bounds what is in flight (:class:`InFlight`: as many
   blocks as the pipeline has stages, none more): it starts a block (its own first steps, or a
   token to the rank of the first step in a 5-rank pipeline whose decoding rank runs no step) only
   while fewer are in flight; it decodes the final latents with the streaming VAE (the first 7
   motion latents decoded first to fill its causal cache) and hands the frames to the sink; at each
   block it asks the job's source whether to stop (a served job: a local read of the inbox) and
   reads the faults the blocks carry. It alone decides the stream's terminal message, once: at a
   stop or a fault (the blocks in flight then arrive and are dropped), or once every block is back
   decoded; every rank passes it on and ends the job as it says. So a served
   group overlaps its blocks as ``run`` does, and a stop or an fp16 fault on any stage reaches
   every rank with the data, leaving nothing in flight for the group's next job.
5. **Reports**: each rank reports the blocks it finished (progress in blocks); the decoding rank,
   the time to the first frame and the frames per second so far (``live`` events, :meth:`record`).

Sends and receives between the two ranks of a 2-rank pipeline are posted in one order on both sides
(the decoding rank posts the receive of the oldest block in flight before its next send): NCCL runs a
pair's operations in turn, and a send can wait for its receive. A resume is not supported (the caches
are the state: a stopped live job runs again from its start); the preflight says so before a live
resume spawns.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from wan_s2v_runner.rank import step_control as sc
from wan_s2v_runner.rank.clip_steps import reference_pixels
from wan_s2v_runner.rank.job_contract import Inputs, Reference, Request, SpeechSpan
from wan_s2v_runner.rank.live_decode import StreamDecoder
from wan_s2v_runner.rank.live_dit import LiveDiT
from wan_s2v_runner.rank.step_control import Signal, StepMessage
from wan_s2v_runner.shared import live_recipe as recipe
from wan_s2v_runner.shared.dit_cost import motion_latent_frames
from wan_s2v_runner.shared.events import ProgressUnit
from wan_s2v_runner.shared.speech_timeline import Decision, Verdict
from wan_s2v_runner.shared.stages import Stage

BLOCK = ProgressUnit.BLOCK


class Schedule:
    """The distilled 4-step schedule: diffusers' ``FlowMatchEulerDiscreteScheduler(shift=3)``'s
    timesteps and sigmas, its Euler update applied per step (a stage runs any step without the
    scheduler's internal step counter)."""

    def __init__(self, num_train_timesteps: int, steps: int = recipe.STEPS, shift: float = recipe.SHIFT):
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
        sched.set_timesteps(steps)
        self.timesteps, self.sigmas = sched.timesteps, sched.sigmas

    def step(self, i: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """diffusers' ``step`` at index ``i`` (deterministic sampling)."""
        dt = self.sigmas[i + 1] - self.sigmas[i]
        return (sample.to(torch.float32) + dt * model_output).to(model_output.dtype)


@dataclass(frozen=True)
class Geometry:
    """A live job's sizes, and what a link between its ranks carries for a block: its latents and
    its speech features."""

    height: int
    width: int
    #: the job's blocks where known from the start (a file's); 0: known when the speech ends (a session)
    blocks: int
    param_dtype: torch.dtype
    device: torch.device
    #: a block's speech features' (layers, dim): wav2vec2's hidden states and their width
    speech: tuple[int, int] = (0, 0)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (16, recipe.BLOCK_LATENT_FRAMES, self.height // 8, self.width // 8)

    @property
    def speech_shape(self) -> tuple[int, int, int, int]:
        return (1, *self.speech, recipe.BLOCK_FRAMES)

    @property
    def numel(self) -> int:
        """Values a link's buffer carries after its header: the block's latents, then its speech features."""
        return math.prod(self.block_shape) + math.prod(self.speech_shape)

    def payload(self, latents: Optional[torch.Tensor], speech: torch.Tensor) -> torch.Tensor:
        """A block's latents (None: not made yet, zeros) and speech features as one flat tensor."""
        n = math.prod(self.block_shape)
        flat = torch.zeros(self.numel, dtype=sc.LINK_DTYPE, device=self.device)
        if latents is not None:
            flat[:n] = latents.reshape(-1).to(sc.LINK_DTYPE)
        flat[n:] = speech.reshape(-1).to(sc.LINK_DTYPE)
        return flat

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A link's payload as (latents in :data:`~step_control.LINK_DTYPE`, speech features in the
        compute's param dtype: exact, the features were made in it)."""
        n = math.prod(self.block_shape)
        return flat[:n].view(self.block_shape), flat[n:].view(self.speech_shape).to(self.param_dtype)

    @property
    def blocks_text(self) -> Optional[int]:
        return self.blocks or None


class BlockPipeline:
    """The live recipe's driver (:class:`~wan_s2v_runner.rank.job_contract.StepDriver`)."""

    unit = BLOCK
    flag_names = ()

    def __init__(self, shell):
        """``shell``: the :class:`~wan_s2v_runner.rank.job_shell.JobShell` it runs in."""
        self.shell, self.parts, self.plan, self.hooks = shell, shell.parts, shell.plan, shell.hooks
        self.s2v, self.device, self.param_dtype = shell.s2v, shell.device, shell.param_dtype
        self.stages = self.plan.layout.stages
        if self.stages is None:
            raise ValueError(recipe.stage_problem(self.plan.layout.world_size))
        #: the decoding rank: the job's live figures (time to the first frame, frames per second)
        self.figures = LiveFigures(self.hooks)
        #: the decoding rank: the job's speech (:meth:`open_speech`)
        self.source = None

    # ----- what the shell encodes
    #: the speech is not encoded with the inputs: each block's features are made as it starts
    encodes_speech = False

    def texts(self, req: Request) -> tuple[str]:
        return (req.prompt,)

    def speech_frames(self, req: Request) -> int:
        return recipe.BLOCK_FRAMES

    def open_speech(self, req: Request) -> tuple[torch.Tensor, int]:
        """The encoding rank (which decodes too): the job's speech opened (:attr:`source`: a file's,
        or the session's events the hooks hold). Returns what the shell broadcasts in place of the
        features: an empty tensor whose shape [1, layers, dim, 0] says the features' size, and the
        job's blocks (0: a session's, known when it ends)."""
        from wan_s2v_runner.rank import speech_source as ss
        from wan_s2v_runner.shared.speech_timeline import Pace
        from wan_s2v_runner.shared.speech_windows import SpeechWindow

        layout = self.plan.layout
        if layout.encoding_rank != layout.decoding_rank:
            raise ValueError("the live recipe's speech is read where its blocks start: the encoding rank must decode")
        encoder = self.parts.audio_encoder()
        events = self.hooks.speech_events
        pace = Pace.SPEECH if events is None else events.pace
        if events is None:
            events = ss.FileEvents(ss.file_samples(encoder, req.audio_path))
        self.source = ss.BlockSpeech(encoder, SpeechWindow(lookahead_s=req.speech_lookahead), pace, events,
                                     self.device, self.param_dtype)
        cfg = encoder.model.config
        template = torch.zeros(1, cfg.num_hidden_layers + 1, cfg.hidden_size, 0, dtype=self.param_dtype)
        return template, self.source.peek_blocks()

    def reference(self, req: Request, size, split: bool) -> Reference:
        """LiveAvatar's reference and initial motion latents (``causal_s2v_pipeline.generate``): the
        image 5 times, encoded, its second latent frame; the 5 over the 73 motion frames, encoded."""
        vae = self.s2v.vae
        ref = reference_pixels(req.ref_image_path, size, vae).repeat(1, 1, 5, 1, 1)
        with torch.no_grad():
            ref_latents = torch.stack(vae.encode(ref))[:, :, 1:]
            motion = torch.stack(vae.encode(ref.repeat(1, 1, self.s2v.motion_frames, 1, 1)))
        return Reference({"ref": ref_latents, "motion": motion})

    # ----- the job
    def run(self, req: Request, inputs: Inputs, sink, resuming: bool, resume) -> None:
        if resuming:
            raise ValueError("a live job cannot be resumed: run it again")
        started = time.monotonic()
        speech = tuple(inputs.audio_emb.shape[1:3])
        geo = Geometry(inputs.height, inputs.width, inputs.units, self.param_dtype, self.device, speech)
        stage = DitStage(self, req, inputs, geo) if self.plan.steps else None
        if self.plan.decodes:
            from wan_s2v_runner.rank.encoders import audio_encoder_on
            from wan_s2v_runner.shared.encoder_placement import AudioEncoderDevice

            # wav2vec2 makes each block's features as it starts: on the GPU for the job where there is one
            where = AudioEncoderDevice.GPU if self.device.type == "cuda" else AudioEncoderDevice.CPU
            try:
                with audio_encoder_on(self.parts.audio_encoder(), where, self.device):
                    Decoder(self, inputs, geo, stage, sink, started).run()
            finally:
                self.source.close()
                self.parts.release_audio_encoder()  # --release-encoders: wav2vec2 let go
        else:
            StageRank(self, geo, stage).run()

    def record(self) -> dict:
        return {"live": self.figures.record}


# --------------------------------------------------------------------------- a rank's steps
class DitStage:
    """This rank's denoising steps of every block: the sink pass once, a step cache per step."""

    def __init__(self, driver: BlockPipeline, req: Request, inputs: Inputs, geo: Geometry):
        from patches.live_kv import StepKV

        self.driver, self.geo, self.hooks = driver, geo, driver.hooks
        self.steps = driver.plan.steps
        self.first = self.steps[0] == 0  # this rank makes each block's noise
        self.seed, self.inputs = req.seed, inputs
        s2v = driver.s2v
        self.schedule = Schedule(s2v.num_train_timesteps)
        self.motion_frames = [s2v.motion_frames, motion_latent_frames(s2v.motion_frames)]
        self.hooks.stage(Stage.DENOISE, what="sink")
        self.guard = driver.parts.guard
        self.dit = LiveDiT(driver.parts.noise_model, self.guard, geo.param_dtype, geo.device.type)
        self.ctx = self.dit.context(inputs.contexts[0][0:1])
        self.cond = self.dit.sink(inputs.latents["ref"], inputs.latents["motion"], self.ctx)
        self.kvs = {i: StepKV(len(self.dit.model.blocks)) for i in self.steps}
        self.cond_states = torch.zeros(geo.block_shape, dtype=geo.param_dtype, device=geo.device)
        self._window: tuple[int, Optional[torch.Tensor]] = (-1, None)

    def noise(self, g: int) -> torch.Tensor:
        """Block ``g``'s noise: its slice of its window's, drawn from ``seed + window``."""
        w, b = divmod(g, recipe.WINDOW_BLOCKS)
        if self._window[0] != w:
            gen = torch.Generator(device=self.geo.device)
            gen.manual_seed(self.seed + w)
            lat_h, lat_w = self.geo.block_shape[2:]
            self._window = (w, torch.randn(16, recipe.WINDOW_BLOCKS * recipe.BLOCK_LATENT_FRAMES, lat_h, lat_w,
                                           dtype=self.geo.param_dtype, device=self.geo.device, generator=gen))
        f = recipe.BLOCK_LATENT_FRAMES
        return self._window[1][:, b * f:(b + 1) * f]

    def denoise(self, g: int, x: torch.Tensor, speech: torch.Tensor,
                message: StepMessage) -> tuple[torch.Tensor, StepMessage]:
        """Block ``g``'s latents through this rank's steps, hearing ``speech`` (the block's features);
        the message marked where a step's output held inf or NaN (fp16's guard: the rest of the
        steps are not run)."""
        for i in self.steps:
            t = torch.stack([self.schedule.timesteps[i]]).to(self.geo.device)
            v = self.dit.block(x, t, self.kvs[i], g, recipe.ref_distance(self.seed, g, i), speech, self.cond_states,
                               self.motion_frames, self.ctx, self.cond)
            message = message.with_fault(sc.guard_fault(self.guard), i, g)
            if message.fault is not None:
                return x, message
            x = self.schedule.step(i, v, x)
        return x, message


class Links:
    """This rank's point-to-point sends (``isend``: kept until done) and receives of link buffers;
    every buffer of a job is one size (:attr:`Geometry.numel`)."""

    def __init__(self, geo: Geometry):
        self.geo = geo
        self.pending: list = []

    def send(self, message: StepMessage, dst: int, latents: Optional[torch.Tensor] = None,
             speech: Optional[torch.Tensor] = None) -> None:
        """``message`` with a block's latents and speech (None: a message alone, e.g. the stream's end)."""
        geo = self.geo
        flat = geo.payload(latents, speech) if speech is not None else None
        buf = sc.pack(message, flat, geo.numel, geo.device)
        self.pending = [p for p in self.pending if not p.is_completed()]
        self.pending.append(dist.isend(buf, dst=dst))

    def recv(self, src: int) -> tuple[StepMessage, torch.Tensor, torch.Tensor]:
        buf = sc.empty(self.geo.numel, self.geo.device)
        dist.recv(buf, src=src)
        return self.read(buf)

    def read(self, buf: torch.Tensor) -> tuple[StepMessage, torch.Tensor, torch.Tensor]:
        """A received buffer as (its message, the block's latents, its speech features)."""
        message, flat = sc.unpack(buf, (self.geo.numel,))
        return (message, *self.geo.split(flat))

    def post(self, src: int):
        """A receive of a block's buffer posted now, waited for later: (buffer, work)."""
        buf = sc.empty(self.geo.numel, self.geo.device)
        return buf, dist.irecv(buf, src=src)

    def drain(self) -> None:
        for p in self.pending:
            p.wait()
        self.pending = []


def terminal(stop: Optional[StepMessage]) -> StepMessage:
    """The stream's last message: the stop's (cancelled, lost, a fault) or the end of the blocks."""
    if stop is None:
        return StepMessage(Signal.END)
    return stop if stop.signal is not Signal.GO else StepMessage(Signal.END, stop.fault, stop.fault_step,
                                                                  stop.fault_at)


def is_terminal(message: StepMessage) -> bool:
    return message.signal is not Signal.GO


def end(message: StepMessage) -> None:
    """Every rank, at its stream's end: the job's error, if the terminal message carries one."""
    error = message.error(recipe.STEPS, BLOCK.value)
    if error is not None:
        raise error


class StageRank:
    """A rank that runs steps and does not decode: it takes each block from the rank before it (or,
    running the first step, a token from the decoding rank and the block's noise), with the block's
    speech features, runs its steps and passes the block on, until the stream's terminal message,
    which it passes on too."""

    def __init__(self, driver: BlockPipeline, geo: Geometry, stage: DitStage):
        self.driver, self.geo, self.stage, self.hooks = driver, geo, stage, driver.hooks
        stages, rank = driver.stages, driver.plan.rank
        first, last = stage.steps[0], stage.steps[-1]
        self.prev = driver.plan.layout.decoding_rank if first == 0 else stages.rank_of_step(first - 1)
        self.next = stages.rank_of_step(last + 1) if last + 1 < recipe.STEPS else driver.plan.layout.decoding_rank
        self.rank = rank

    def run(self) -> None:
        links, stage, geo = Links(self.geo), self.stage, self.geo
        faulted: Optional[StepMessage] = None  # this rank's own fault: later blocks pass uncomputed
        g = 0
        while True:
            message, x, speech = links.recv(self.prev)
            if is_terminal(message):
                links.send(message, self.next)
                links.drain()
                return end(message)
            if faulted is None and message.fault is None:
                self.hooks.stage(Stage.DENOISE, unit=BLOCK, block=g + 1, blocks=geo.blocks_text)
                x, message = stage.denoise(g, stage.noise(g) if stage.first else x, speech, message)
                faulted = message if message.fault is not None else None
            message = message if faulted is None else message.with_fault(faulted.fault, faulted.fault_step,
                                                                         faulted.fault_at)
            links.send(message, self.next, x if message.fault is None else None, speech)
            if message.fault is None:  # a block passed on uncomputed (the job fails) is not progress
                self.hooks.step(unit=BLOCK, block=g + 1, blocks=geo.blocks_text)
            g += 1


# --------------------------------------------------------------------------- the decoding rank
class InFlight:
    """The blocks the decoding rank started and has not yet received back: at most ``depth``, each
    with its span of the speech, whether it is the job's last, and the receive of its final latents
    once posted."""

    def __init__(self, depth: int):
        self.depth = depth
        self.blocks: deque = deque()  # [block, span, last, posted receive or None]

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def full(self) -> bool:
        return len(self.blocks) >= self.depth

    def add(self, g: int, span, last: bool) -> None:
        self.blocks.append([g, span, last, None])

    def unposted(self) -> list[list]:
        """The blocks in flight whose receive is not posted yet, oldest first."""
        return [b for b in self.blocks if b[3] is None]

    def pop(self) -> list:
        return self.blocks.popleft()


class Decoder:
    """The decoding rank (rank 0): starts blocks as the job's speech says (:class:`~wan_s2v_runner.
    rank.speech_source.BlockSpeech`: now, later, or no more) while fewer than the pipeline's stages
    are in flight (running its own steps when it has some), decodes the final latents, asks for a stop."""

    def __init__(self, driver: BlockPipeline, inputs: Inputs, geo: Geometry, stage: Optional[DitStage], sink,
                 started: float):
        self.driver, self.geo, self.stage, self.sink, self.hooks = driver, geo, stage, sink, driver.hooks
        stages, layout = driver.stages, driver.plan.layout
        self.source = driver.source
        self.alone = layout.world_size == 1
        self.last = stages.rank_of_step(recipe.STEPS - 1)
        # where a block starts: this rank's own first steps, or a token to the rank of the first step
        self.to = stages.rank_of_step(stage.steps[-1] + 1) if stage is not None and not self.alone else (
            None if self.alone else stages.rank_of_step(0))
        self.in_flight = InFlight(len(stages.dit_ranks))
        self.links = Links(geo)
        self.decoder = StreamDecoder(driver.s2v.vae)
        self.decoder.decode(inputs.latents["motion"][:, :, :recipe.PRIME_LATENTS])  # fills its causal cache
        self.issued = self.decoded = 0
        self.speech_done = False  # the speech said no block follows
        self.stop: Optional[StepMessage] = None
        self.started = started

    def run(self) -> None:
        self.source.begin()
        try:
            self._alone() if self.alone else self._pipeline()
        finally:
            self.decoder.close()
            self.links.drain()

    def _next(self) -> tuple[Decision, Optional[tuple]]:
        """The speech's word on the next block, and, where it says start, the block's (features, span,
        last); with END or the last block, :attr:`speech_done`."""
        decision = self.source.next()
        block = None
        if decision.verdict is Verdict.START:
            speech, samples, runs = self.source.block(self.issued)
            block = (speech, SpeechSpan(samples, decision.ready_at, runs), decision.last)
        self.speech_done = self.speech_done or decision.verdict is Verdict.END or decision.last
        return decision, block

    def _alone(self) -> None:
        """One rank: every step of a block, then its decode, block after block."""
        while not self.speech_done:
            decision, block = self._next()
            if block is None:
                if decision.verdict is Verdict.WAIT:
                    self._idle(decision)
                    if self.stop is not None:
                        return end(terminal(self.stop))
                continue
            g, (speech, span, last) = self.issued, block
            self.issued += 1
            self.hooks.stage(Stage.DENOISE, unit=BLOCK, block=g + 1, blocks=self.geo.blocks_text)
            x, message = self.stage.denoise(g, self.stage.noise(g), speech, StepMessage())
            if message.fault is not None:
                return end(terminal(message))
            self._decode(g, x, span, last)
            self._ask_stop()
            if self.stop is not None:
                return end(terminal(self.stop))

    def _idle(self, decision) -> None:
        """No block can start yet: a short wait, and the job's source asked whether to stop."""
        self.source.wait(decision)
        self._ask_stop()

    def _pipeline(self) -> None:
        """Start blocks while the pipeline has room and the speech says so, receive the oldest
        otherwise; end the stream once a stop or a fault is known (the blocks in flight are dropped),
        or once the speech said no block follows and every block is back: the terminal message is
        decided here alone, so every rank ends the job alike."""
        ended = False
        while True:
            if not ended and (self.stop is not None or (self.speech_done and not self.in_flight)):
                self._send(terminal(self.stop))
                ended = True
            elif not ended and not self.speech_done and not self.in_flight.full:
                decision, block = self._next()
                if block is not None:
                    self._start(*block)
                    continue
                if decision.verdict is Verdict.END:
                    continue
                if not self.in_flight:  # waiting, nothing to receive: look again
                    self._idle(decision)
                    continue
            if self.in_flight:
                self._receive()
                continue
            message = self.links.recv(self.last)[0]  # the terminal message, every rank passed it on
            assert is_terminal(message), "the live stream's blocks outran its end"
            return end(message)

    def _start(self, speech: torch.Tensor, span, last: bool) -> None:
        """The next block into the pipeline: a token (with its speech) to the first step's rank, or
        this rank's own steps."""
        g = self.issued
        self.issued += 1
        if self.stage is None:
            self._send(StepMessage(), None, speech)
            self.in_flight.add(g, span, last)
            return
        self.hooks.stage(Stage.DENOISE)
        x, message = self.stage.denoise(g, self.stage.noise(g), speech, StepMessage())
        if message.fault is not None:  # known here: the stream ends with it (the block is not sent)
            self.stop = self.stop or message
            return
        self._send(message, x, speech)
        self.in_flight.add(g, span, last)

    def _send(self, message: StepMessage, latents: Optional[torch.Tensor] = None,
              speech: Optional[torch.Tensor] = None) -> None:
        """A send down the pipeline; where it goes to the rank the blocks come back from (2 ranks),
        after the receives of the blocks in flight are posted (the module docstring: the pair's
        operations in one order on both sides: a block's send, then its receive)."""
        if self.to == self.last:
            for block in self.in_flight.unposted():
                block[3] = self.links.post(self.last)
        self.links.send(message, self.to, latents, speech)

    def _receive(self) -> None:
        """The oldest block in flight back: decoded (unless the job stops), the stop asked."""
        g, span, last, posted = self.in_flight.pop()
        if posted is not None:
            buf, work = posted
            work.wait()
            message, x, _ = self.links.read(buf)
        else:
            message, x, _ = self.links.recv(self.last)
        if message.fault is not None and self.stop is None:
            self.stop = message
        if self.stop is None:
            self._decode(g, x, span, last)
            self._ask_stop()

    def _decode(self, g: int, x: torch.Tensor, span, last: bool) -> None:
        blocks = self.geo.blocks_text
        self.hooks.stage(Stage.DECODE, unit=BLOCK, block=g + 1, blocks=blocks)  # in order: its position
        frames = self.decoder.decode(x.unsqueeze(0).to(self.driver.s2v.vae.dtype))[:, :, -recipe.BLOCK_FRAMES:]
        if g == 0:
            frames = frames[:, :, recipe.FIRST_BLOCK_DROP:]
        self.driver.figures.block(g, blocks, frames.shape[2], self.started)
        if self.sink is not None:
            self.sink.frames(g, frames.cpu(), g + 1 if last else blocks, speech=span)
        self.decoded += 1
        self.hooks.step(unit=BLOCK, block=g + 1, blocks=blocks, **self.driver.figures.progress())

    def _ask_stop(self) -> None:
        """The job's source: a served job's server may have cancelled or lost it (a local read)."""
        if self.hooks.stop_requested is not None and self.stop is None:
            signal = self.hooks.stop_requested()
            if signal is not None and signal is not Signal.GO:
                self.stop = StepMessage(signal)


class LiveFigures:
    """The decoding rank's live figures: the time to the first frame, the frames per second since."""

    def __init__(self, hooks):
        self.hooks = hooks
        self.record: dict = {}
        self._first_frames = 0

    def block(self, block: int, blocks: int, frames: int, started: float) -> None:
        now = time.monotonic()
        rec = self.record
        if block == 0:
            rec["first_frame_s"] = round(now - started, 3)
            rec["frames_made"] = 0
        rec["frames_made"] += frames
        rec["blocks"] = block + 1
        span = now - started - rec["first_frame_s"]
        if block > 0 and span > 0:
            rec["fps"] = round((rec["frames_made"] - self._first_frames) / span, 3)
        else:
            self._first_frames = rec["frames_made"]
        if self.hooks.live is not None:
            self.hooks.live(dict(rec, of=blocks))

    def progress(self) -> dict:
        return {k: self.record[k] for k in ("fps", "first_frame_s") if k in self.record}
