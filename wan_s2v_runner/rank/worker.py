"""One rank of a run: :func:`rank_main` (``SPEC_JSON``), which the node's agent
(:mod:`wan_s2v_runner.rank.agent`) runs in each rank it forks.

Reads the group's spec the launcher wrote (:func:`~wan_s2v_runner.shared.spec.read_spec`: a
group spec, or a run's spec with its one job), joins the process group (gloo on CPU, nccl on
CUDA, with an explicit timeout), imports the engine, applies the patches, builds the engine's
``WanS2V`` with the mode's settings once (from the group's settings alone), then makes the rank
group's jobs (:class:`RankGroup`) from the source its launcher chose and recorded in spec.json
(:mod:`wan_s2v_runner.rank.job_sources`): the run's own job, the launcher's ``jobs.jsonl``
(``wan-s2v batch``), or whatever a server posts to the inbox until it says stop (``wan-s2v
serve``); each job runs as ``RunSpec.of(group, job.spec)``. Rank 0 writes
each job's mp4 with audio. Stages and progress go to the run directory's event files; a failure
is recorded by torch elastic's ``@record`` (per-rank error file) and as an ``error`` event naming
the stage.
"""
from __future__ import annotations

import contextlib
import copy
import faulthandler
import gc
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from wan_s2v_runner.loading import engine
from wan_s2v_runner.rank import fork_gate, job_errors, job_sources
from wan_s2v_runner.rank.cpu_binding import cpu_binding
from wan_s2v_runner.rank.job_sources import JobEnd
from wan_s2v_runner.rank.lease import JobLost, LeaseGate
from wan_s2v_runner.rank.memory_peaks import StagePeaks
from wan_s2v_runner.rank.step_control import JobCancelled, WriteFailed
from wan_s2v_runner.shared import atomic, disk, resume
from wan_s2v_runner.shared.events import RANK_LOG_FORMAT, EventKind, EventWriter, position
from wan_s2v_runner.shared.job_source import JobSource, read_source
from wan_s2v_runner.shared.jobs import Job
from wan_s2v_runner.shared.procfs import pin_mmap_threshold, trim_heap
from wan_s2v_runner.shared.spec import GroupSpec, RunSpec, read_spec
from wan_s2v_runner.shared.stages import Stage

log = logging.getLogger("wan_s2v.worker")


class JobFailed(Exception):
    """A job's own error, where no peer can be waiting for this rank in a collective: its inputs
    or its speech before the ranks start it, or rank 0's writing after they finished it. The job
    fails with this cause; the same ranks take the next job."""


def input_problem(spec) -> Optional[str]:
    """Why ``spec``'s input files cannot be read as the job needs them now (None: they can): a
    file removed, emptied or replaced by something else since the job was accepted."""
    from PIL import Image

    files = {"image": spec.image, "audio": spec.audio, "pose_video": spec.pose_video,
             "tts_prompt_audio": spec.tts_prompt_audio}
    for name, path in files.items():
        if path is None:
            continue
        try:
            if not path.is_file() or path.stat().st_size == 0:
                return f"{name} {path} is gone or empty (changed since the job was accepted)"
            if name == "image":
                with Image.open(path) as im:
                    im.verify()
            else:
                with open(path, "rb") as f:
                    f.read(1)
        except Exception as e:  # whatever the file does, it is this job's cause
            return f"{name} {path} cannot be read ({type(e).__name__}: {e})"
    return None


class RankEvents(EventWriter):
    """EventWriter that also reports this rank's memory: peaks per stage (``stage_peak`` records,
    :mod:`.memory_peaks`) and in heartbeats. A worker module of one's own (``$WAN_S2V_RANK_WORKER``) may
    subclass it and pass it to :func:`main` (the tests' fault injection acts at its stage changes)."""

    def __init__(self, run_dir: Path, rank: int, peaks: StagePeaks):
        super().__init__(run_dir, rank, mem_fn=lambda: memory_figures(peaks, heartbeat=True),
                         stage_peak_fn=peaks.take)
        self.peaks = peaks
        self.error_reported = False
        self.job = 1  # the rank group's job in progress (1-based)
        self.job_prompt = ""  # its prompt

    @classmethod
    def starting(cls, rank: int) -> None:
        """Called once the rank's logging and stack dumps are set up, before its first event
        (nothing here; a subclass may act)."""

    def error(self, e: BaseException) -> None:
        """Record the rank's failure once, as early as possible (before comms are torn down)."""
        if not self.error_reported:
            self.error_reported = True
            self.emit(EventKind.ERROR, error_type=type(e).__name__, message=str(e)[:2000], disk=disk.describe(e))


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=RANK_LOG_FORMAT.replace("{rank}", str(rank)),
        stream=sys.stdout, force=True)


def _register_stack_dump(run_dir: Path, rank: int):
    """Python stacks of every thread, written by faulthandler's C handler (works while the main
    thread is blocked in a collective): on SIGUSR1 (the launcher's hang watchdog) and on a fatal
    signal (SIGSEGV, SIGABRT, ...) to stacks/rank{r}.txt; on SIGTERM (the run being stopped) to
    stacks/rank{r}.at-stop.txt, then the default action (exit). Empty files are removed by the
    launcher at the end of the run."""
    d = run_dir / "stacks"
    d.mkdir(parents=True, exist_ok=True)
    f = open(d / f"rank{rank}.txt", "w", encoding="utf-8")
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    faulthandler.enable(file=f, all_threads=True)
    f_stop = open(d / f"rank{rank}.at-stop.txt", "w", encoding="utf-8")
    faulthandler.register(signal.SIGTERM, file=f_stop, all_threads=True, chain=True)
    return f, f_stop


def group_capabilities(spec: GroupSpec) -> list:
    """Every rank's GPU compute capability (one all-gather over the group, after its process group
    is up; [] on the CPU): ``--dtype auto`` is resolved on the oldest, so every rank computes in
    the same dtype (a group of mixed generations would otherwise mix bf16 and fp16 ranks)."""
    import torch.distributed as dist

    if spec.device != "cuda" or not torch.cuda.is_available():
        return []
    mine = tuple(torch.cuda.get_device_capability())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    caps: list = [None] * dist.get_world_size()
    dist.all_gather_object(caps, mine)
    return [tuple(c) for c in caps]


def engine_config(wan, spec: GroupSpec, capabilities=None):
    """The engine's S2V config, copied, in the group's compute dtype (``--dtype``, resolved by
    :func:`wan_s2v_runner.shared.precision.resolve` on the group's GPUs' ``capabilities``, the
    oldest deciding (:func:`group_capabilities`; None: this rank's GPU): fp32 on CPU, bf16 where
    the GPUs have it (upstream's), fp16 below cc 8.0). ``cfg.compute_dtype`` says which, and why."""
    from wan_s2v_runner.shared import precision

    cfg = copy.deepcopy(wan.configs.WAN_CONFIGS["s2v-14B"])
    caps = capabilities
    if caps is None:
        caps = [torch.cuda.get_device_capability()] if spec.device == "cuda" and torch.cuda.is_available() else []
    chosen, why = precision.resolve(spec.dtype, spec.device, caps)
    cfg.compute_dtype, cfg.compute_dtype_reason = chosen, why
    cfg.param_dtype = cfg.t5_dtype = precision.torch_dtype(chosen)
    return cfg


def request_for(spec: RunSpec):
    """The generate() arguments of a run (upstream's names)."""
    from wan_s2v_runner.rank.job_shell import Request
    return Request(prompt=spec.prompt, ref_image_path=str(spec.image),
                   audio_path=str(spec.speech) if spec.speech is not None else "",
                   speech_lookahead=spec.speech_lookahead,
                   num_repeat=spec.num_clips, max_area=spec.max_area, infer_frames=spec.infer_frames,
                   shift=spec.shift, sample_solver=spec.solver, sampling_steps=spec.steps,
                   guide_scale=spec.guide_scale, n_prompt=spec.negative_prompt, seed=spec.seed,
                   offload_model=spec.offload, init_first_frame=spec.start_from_ref,
                   pose_video=str(spec.pose_video) if spec.pose_video else None, cache=spec.cache)


def memory_figures(peaks: StagePeaks, heartbeat: bool = False) -> dict:
    """Whole-run peak memory (host RSS, GPU allocated/reserved: MiB; GPU None before CUDA is
    used), and with ``heartbeat`` the current RSS too."""
    out = peaks.run_peaks()
    if heartbeat:  # current RSS too (cheap: /proc/self/statm)
        try:
            with open("/proc/self/statm") as f:
                out["rss_mb"] = round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
        except (OSError, ValueError, IndexError):
            pass
    return out


def release_memory(spec: GroupSpec, parts) -> None:
    """Between jobs: the job's text contexts are dropped from the DiT's cache, and what the job
    freed goes back (Python's cycles, glibc's free heap pages, the CUDA cache), so each job starts
    from the footprint the first one did and peaks do not creep up."""
    from patches import context_cache

    if parts.holds_dit and not parts.dit_loading:  # a job that ended before its first step left nothing there
        context_cache.clear(parts.noise_model)
    gc.collect()
    if spec.device == "cuda":
        torch.cuda.empty_cache()
    trim_heap()


class StageClock:
    """The seconds one job spent in each stage on this rank (from the stage changes it reports)."""

    def __init__(self):
        self.marks: list[tuple[str, float]] = []

    def mark(self, stage) -> None:
        self.marks.append((str(stage), time.time()))

    def seconds(self, end: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for (stage, t), (_, t_next) in zip(self.marks, self.marks[1:] + [("", end)]):
            out[stage] = round(out.get(stage, 0.0) + t_next - t, 3)
        return out


@dataclass
class OpenVideo:
    """Rank 0's job video, opened before the ranks start the job: its writer, the clip state a
    resume continues from (None: from the first clip) and the identity its checkpoints carry."""

    writer: object  # rank.video_writer.VideoWriter
    state: object  # rank.clip_steps.ClipState or None
    identity: dict


class RankGroup:
    """This rank's part of a rank group: the engine parts it loaded once, and the jobs it makes
    with them, one after another (``wan-s2v run``: one job; ``wan-s2v batch``: many). Nothing of
    a job outlives it but the loaded weights: each job gets its own request, generator seeds,
    clip state, hooks and clip checkpoints; and the T5 encodings of the texts the group has seen
    (a text's encoding is the same for every job: ``rank.encoders.TextContexts``)."""

    def __init__(self, spec: GroupSpec, run_dir: Path, events: "RankEvents", rank: int, cfg, plan, parts,
                 source: JobSource):
        from wan_s2v_runner.rank.encoders import TextContexts
        from wan_s2v_runner.rank.job_shell import driver_for

        self.spec, self.run_dir, self.events, self.rank = spec, run_dir, events, rank  # the group's
        self.cfg, self.plan, self.parts = cfg, plan, parts
        self.texts = TextContexts()
        #: the recipe's step driver, bound once for the group's jobs
        self.driver = driver_for(spec.layout.recipe)
        self.jobs = job_sources.for_group(source, spec, run_dir, rank, events, on_idle=self._idle)
        self.compiler = None  # --compile: patches.compile_blocks.Compiled (set by run_rank)
        self.video: Optional[OpenVideo] = None  # rank 0: the next job's, from start_job to run_job

    def _idle(self) -> None:
        """No job waits (every rank heard so): a DiT still loading is finished now, so the first
        job does not wait for it and a load error is the group's. Not a deferred one
        (``--release-encoders``): it is read after the first job's encoders let go, never beside them."""
        if self.parts.dit_loading and not self.parts.pending.deferred:
            self.parts.ready()

    def job_error_is_the_jobs(self, e: BaseException) -> bool:
        """A served job raised ``e`` here: whether it is the job's alone (every rank raised at the
        same point: :func:`~wan_s2v_runner.rank.job_errors.in_step`); False outside a served group."""
        if not self.jobs.served or job_errors.the_groups(e):
            return False
        p = self.events.progress
        point = (str(self.events.current_stage.value), position(p)[1], p.get("step"))
        logging.getLogger("wan_s2v").error("job error in stage %s: %s: %s", point[0], type(e).__name__, e,
                                           exc_info=e)
        return job_errors.in_step(point, self.jobs.control)

    def _stop_requested(self, job: Job, gate: LeaseGate, writer):
        """The job's source's word, which the loop asks at each step or block and carries in its step
        message (a served job's: rank 0 reads the inbox, and fails the job where its video writer
        failed; None elsewhere and for listed jobs, whose writer's error ends the run)."""
        from wan_s2v_runner.rank.step_control import Signal

        if not self.jobs.served:
            return None
        signals = {JobEnd.CANCELLED: Signal.CANCELLED, JobEnd.LOST: Signal.LOST}

        def stop():
            if writer is not None and writer.error is not None:  # a full disk, say: every rank ends the job
                return Signal.FAILED
            return signals.get(self.jobs.stop_requested(job, gate))
        return stop

    def _session_speech(self, job: Job, spec):
        """A live session's speech events, read from the group's inbox by the rank its blocks start
        on (None: a job with a speech file, or another rank)."""
        if spec.session is None or self.rank != self.spec.layout.encoding_rank:
            return None
        if job.speech_dir is None:
            raise JobFailed("a live session's job came without its speech folder")
        from wan_s2v_runner.rank.speech_source import SessionEvents
        return SessionEvents(job.speech_dir, spec.session)

    def start_job(self, job: Job, clock: "StageClock") -> Optional[tuple[JobEnd, str]]:
        """Before any rank starts the job, rank 0 reads its inputs, waits until its server is sure
        it holds the job (a served job), and speaks a ``--tts-text`` job's speech into the job's
        folder; every rank hears the verdict: None (go), or (:attr:`JobEnd.FAILED`, the cause) /
        (:attr:`JobEnd.LOST`, ""): the job ends here, before any collective of its own."""
        verdict: Optional[tuple[JobEnd, str]] = None
        if self.rank == 0:
            spec, gate = job.run_spec(self.spec), self.jobs.gate(job)
            problem = input_problem(spec)
            if problem is not None:
                verdict = (JobEnd.FAILED, problem)
            elif not gate.wait():
                verdict = (JobEnd.LOST, "")
            elif spec.tts_text and self.plan.encodes:  # the speech first: it is the audio everything reads
                from wan_s2v_runner.rank.tts import make_speech
                from wan_s2v_runner.shared.atomic import NotCommitted

                clock.mark(Stage.TTS)
                self.events.stage(Stage.TTS)
                try:
                    make_speech(spec, resuming=bool(spec.resume_from), commit_if=gate.wait)
                except NotCommitted:
                    verdict = (JobEnd.LOST, "")
                except Exception as e:  # its own inputs or the TTS model: this job's error, the group goes on
                    verdict = (JobEnd.FAILED, f"text to speech failed: {type(e).__name__}: {e}")
            if verdict is None and self.plan.decodes:  # its video (and a resume's clips) open here, or the job fails
                try:
                    self.video = self._open_video(job, spec, gate)
                except (resume.ResumeError, OSError, RuntimeError) as e:
                    verdict = (JobEnd.FAILED, f"the video cannot be started: {e}")
        return job_sources.from_rank0(verdict)

    def _open_video(self, job: Job, spec, gate) -> "OpenVideo":
        """Rank 0: the job's video writer (continuing a resumed run's video), its clip state and identity."""
        from wan_s2v_runner.rank.clip_steps import ClipState
        from wan_s2v_runner.rank.video_writer import VideoWriter

        identity, continued, state = resume.identity(spec), None, None
        if spec.resume_from:
            progress = resume.read_progress(spec.resume_from)
            carried = resume.load(spec.resume_from, progress)
            continued = resume.continued(progress)
            state = ClipState(progress.next_clip, carried["motion_latents"], carried["videos_last_frames"])
            self.events.emit(EventKind.RESUMED, clip=progress.next_clip + 1, clips=progress.num_clips,
                             source=str(spec.resume_from))
        writer = VideoWriter(spec.output, spec.speech, self.cfg.sample_fps, job.work_dir, identity, self.events,
                             gate=gate, thumbnail=spec.preview or self.jobs.served, frames_out=spec.frames_out,
                             continued=continued, served=self.jobs.served)
        return OpenVideo(writer, state, identity)

    def take_job(self, job: Job, index: int) -> None:
        """One job of the group, to its end: made, or ended by its source (cancelled, lost) or by its
        own error (failed: the group takes the next one); an error that is the group's ends the rank."""
        from patches.fp16_compute import NonFiniteActivation

        events, jobs = self.events, self.jobs
        events.job, events.job_prompt = index + 1, job.spec.prompt
        if jobs.count != 1 or job.record is not None:
            events.emit(EventKind.JOB, id=job.id, job=index + 1, jobs=jobs.count)
        started, clock = time.time(), StageClock()
        try:
            verdict = self.start_job(job, clock)
            if verdict is not None and verdict[0] is JobEnd.LOST:
                raise JobLost(job.id)
            if verdict is not None:
                raise JobFailed(verdict[1])
            self.run_job(job, index, jobs.count, clock, started)
        except JobCancelled:  # every rank stopped it at the same step or block; the group takes the next
            events.emit(EventKind.JOB_CANCELLED, id=job.id, job=index + 1)
        except JobLost:  # its server lost it to another holder: nothing more of it is written here
            events.emit(EventKind.JOB_LOST, id=job.id, job=index + 1)
        except JobFailed as e:  # the job's own error where no peer waits: the group takes the next
            self.fail_job(job, index, str(e), e)
        except NonFiniteActivation as e:  # the step message's fault: every rank raised it at the same place
            if not jobs.served:
                raise
            self.fail_job(job, index, str(e), e)
        except Exception as e:
            if not self.job_error_is_the_jobs(e):  # the group's: the rank ends, the server restarts it
                raise
            self.fail_job(job, index, f"{type(e).__name__} in stage {events.current_stage.value}: {e}", e)
        finally:
            jobs.ended(job)
        release_memory(self.spec, self.parts)

    def fail_job(self, job: Job, index: int, cause: str, error: Optional[BaseException] = None) -> None:
        """The job failed with ``cause``: rank 0 records it (``status: failed``) and every rank says
        ``job_failed``; the group goes on."""
        if self.rank == 0 and job.record is not None and self.jobs.gate(job).current():
            record = {"id": job.id, "status": "failed", "error": cause, "finished": time.time()}
            try:
                atomic.write_text(job.record, json.dumps(record, indent=1), durable=True)
            except OSError as e:  # a full disk: the event still says it (the server records it)
                log.error("the failed job's record %s could not be written: %s", job.record, e)
        self.events.emit(EventKind.JOB_FAILED, id=job.id, job=index + 1, error=cause, disk=disk.describe(error))

    def run_job(self, job: Job, index: int, total: Optional[int], clock: "StageClock", started: float) -> None:
        """Make one job (``total``: the group's number of jobs, None while serving)."""
        from wan_s2v_runner.rank.job_shell import Hooks

        spec, events, plan, gate = job.run_spec(self.spec), self.events, self.plan, self.jobs.gate(job)

        last: dict = {}

        def stage(s, **data):
            clock.mark(s)
            events.stage(s, **data)
            last.update(stage=s, data=data)

        @contextlib.contextmanager
        def compiling():  # --compile: a size's first block call is its own stage, then back to the step
            before = dict(last)
            stage(Stage.COMPILE, **{k: v for k, v in before.get("data", {}).items()
                                    if k in ("unit", "clip", "clips", "block", "blocks")})
            try:
                yield
            finally:
                if before:
                    stage(before["stage"], **before["data"])

        if self.compiler is not None:
            self.compiler.around = compiling

        resume_state, identity, writer = None, None, None
        if plan.decodes:  # the video grows clip by clip (opened by start_job); a clip's checkpoint is its place in it
            opened, self.video = self.video, None
            writer, resume_state, identity = opened.writer, opened.state, opened.identity
        hooks = Hooks(stage=stage, step=events.step, stop_requested=self._stop_requested(job, gate, writer),
                      sink=writer, cache_done=lambda record: events.emit(EventKind.STEP_CACHE, **record),
                      live=lambda figures: events.emit(EventKind.LIVE, **figures),
                      speech_events=self._session_speech(job, spec))
        try:
            self._make(job, index, spec, hooks, writer, resume_state, identity, started, clock, stage, gate)
        except WriteFailed:  # every rank ended the job at one step: the decoding rank says why
            error = writer.error if writer is not None else None
            if writer is not None:
                writer.abandon()
            raise JobFailed(f"writing the video failed: {error}" if error is not None
                            else "the decoding rank could not write the job's video") from error
        except BaseException:
            if writer is not None:
                writer.abandon()  # a cancelled or failed job keeps its video so far (every finished clip)
            raise

    def _make(self, job: Job, index: int, spec, hooks, writer, resume_state, identity, started: float, clock,
              stage, gate: LeaseGate) -> None:
        """Generate ``job``'s clips into its video (rank 0: ``writer``) and finish it and its record."""
        from wan_s2v_runner.rank.job_shell import JobShell
        from wan_s2v_runner.shared import media
        from wan_s2v_runner.shared.atomic import NotCommitted

        events, plan = self.events, self.plan
        shell = JobShell(self.parts, plan, hooks, self.texts, driver=self.driver)
        shell.generate(request_for(spec), resuming=bool(spec.resume_from), resume=resume_state)
        if self.rank != 0:
            events.emit(EventKind.JOB_DONE, id=job.id, job=index + 1, **memory_figures(events.peaks, heartbeat=True))
            return
        # the last clip's (or live block's) fragment in the file before the writer is asked whether
        # it was lost; an error writing it is the job's
        try:
            writer.drain()
        except Exception as e:
            raise JobFailed(f"writing the video failed in stage {events.current_stage.value}: "
                            f"{type(e).__name__}: {e}{disk_fix(e)}") from e
        if writer.lost:  # not written while its server was not sure it held the job: the server's word first
            gate.wait_or_raise()  # lost (JobLost), or past the wait's limit taken as lost
            raise JobFailed("the video so far could not be written while the server was not sure it held the job")
        if writer.total_frames == 0:
            raise RuntimeError("rank 0 got no frames from the engine")
        shape = [3, writer.total_frames, *writer.size]
        events.emit(EventKind.FRAMES, shape=shape)
        try:  # the other ranks are done with this job: an error here is the job's, not the group's
            gate.wait_or_raise()  # a served job's files only while its server holds it
            stage(Stage.SAVE)
            writer.finish()
        except NotCommitted:
            raise JobLost(job.id) from None
        except Exception as e:
            if isinstance(e, JobLost):
                raise
            raise JobFailed(f"writing the video failed in stage {events.current_stage.value}: "
                            f"{type(e).__name__}: {e}{disk_fix(e)}") from e
        if job.record is not None:
            ended = time.time()
            record = {"id": job.id, "status": "ok", "seed": spec.seed, "started": started, "finished": ended,
                      "wall_s": round(ended - started, 3), "stage_seconds": clock.seconds(ended),
                      "resumed_at_clip": resume_state.clip + 1 if resume_state else None,
                      "frames": shape, "fps": self.cfg.sample_fps, "identity": identity,
                      **_with_latency(shell.record(), writer), **memory_figures(events.peaks),
                      "output": {"path": str(spec.output), "sha256": media.sha256_file(spec.output)},
                      "spec": json.loads(spec.model_dump_json())}
            try:  # mp4 first, then this
                atomic.write_text(job.record, json.dumps(record, indent=1), durable=True, commit_if=gate.wait)
            except NotCommitted:
                raise JobLost(job.id) from None
            except OSError as e:  # the video is made: the record's write is the job's error
                raise JobFailed(f"writing the job's record failed: {e}{disk_fix(e)}") from e
        events.emit(EventKind.JOB_DONE, id=job.id, job=index + 1, **memory_figures(events.peaks, heartbeat=True))


def _with_latency(record: dict, writer) -> dict:
    """The driver's record, a live session's block latencies (its writer's) in its ``live`` figures."""
    summary = writer.latencies.summary()
    if summary and "live" in record:
        record = {**record, "live": {**record["live"], **summary}}
    return record


def disk_fix(e: BaseException) -> str:
    """The fix for a full disk (an ENOSPC or EDQUOT in ``e``'s cause chain), else ""; nothing where
    ``e``'s own text already says it (``shared.disk.DiskError``)."""
    if disk.full_error(e) is None or isinstance(e, disk.DiskError) or "Fix:" in str(e):
        return ""
    return (". Fix: free space on the disk of the output (a server: delete videos, or set --keep-videos / "
            "--keep-hours), then `wan-s2v resume` the run: every finished clip is kept")


def run_rank(spec: GroupSpec, run_dir: Path, events: RankEvents) -> int:
    """One rank's life: its process group, the engine patched and loaded once, then the group's jobs."""
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if spec.device == "cpu":
        torch.set_num_threads(spec.threads)
    else:
        torch.cuda.set_device(local_rank)

    events.stage(Stage.INIT_PG)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method="env://",
                            timeout=timedelta(seconds=spec.pg_timeout_s))
    try:
        group = start_group(spec, run_dir, events, local_rank)
        for index, job in enumerate(group.jobs):
            group.take_job(job, index)
        group.parts.abandon()  # a group that never used its DiT still waits for its read (matched collectives)
        events.stage(Stage.DONE)
    except BaseException as e:
        # Record the failure before anything closes this rank's connections: peers then fail
        # with "connection closed" *after* this record, so the launcher names the right rank.
        # No destroy_process_group on this path (it can block on a broken group); exiting
        # closes everything.
        events.error(e)
        raise
    dist.destroy_process_group()
    return 0


def start_group(spec: GroupSpec, run_dir: Path, events: RankEvents, local_rank: int) -> "RankGroup":
    """The engine imported, patched (``--compile`` too) and loaded as this rank's plan says; the
    rank group that makes the jobs, once every rank is ready."""
    import torch.distributed as dist

    import runners
    from patches import apply_for_run
    from wan_s2v_runner.loading import lora
    from wan_s2v_runner.rank.parallel import rank_plan

    events.stage(Stage.ENGINE_IMPORT, preloaded=engine.imported())  # by the agent, before the fork
    wan = engine.import_wan(spec.wan_repo)
    cfg = engine_config(wan, spec, group_capabilities(spec))
    applied = apply_for_run(wan, spec, cfg.param_dtype, on_event=events.stage, on_event_data=events.emit,
                            merge_loras=lora.merger(spec.lora, spec.lora_allow_partial) if spec.lora else None)
    compiler = None
    if spec.compile:
        from patches import compile_blocks
        from wan_s2v_runner.shared import inductor
        compiler = compile_blocks.apply(wan, cfg.param_dtype,
                                        on_compile=lambda info: events.emit(EventKind.COMPILE, **info),
                                        cache=inductor.cache_dir(setting=spec.cache_dir))
        applied["compile_blocks"] = f"each DiT block compiled (inductor cache {compile_blocks.cache_dir()})"
    events.emit(EventKind.PATCHES, applied=applied)

    events.stage(Stage.LOAD)
    device = torch.device("cpu") if spec.device == "cpu" else torch.device("cuda", local_rank)
    plan = rank_plan(spec.layout, device.type)
    parts, more = runners.get(spec.mode).prepare(wan, cfg, spec, plan, device, local_rank, on_event=events.stage)
    events.emit(EventKind.PLAN, **plan.describe(), patches=more, compute_dtype=cfg.compute_dtype.value,
                compute_dtype_why=cfg.compute_dtype_reason)
    # its thread while the first job encodes (components.DitLoad): its report once it is loaded
    parts.when_ready(lambda: events.emit(EventKind.LOADED, **parts.load_report.as_dict()))

    if dist.get_world_size() > 1:  # every rank starts generating together, so each stage's time
        dist.barrier()  # is its own work, not a wait for a slower rank's loading
    group = RankGroup(spec, run_dir, events, int(os.environ.get("RANK", 0)), cfg, plan, parts, read_source(run_dir))
    group.compiler = compiler
    return group


def _bind_cpus(spec: GroupSpec) -> list[int] | None:
    """CPU runs: keep this rank on the group's CPUs (``--cpus``), and bind it to its own among them
    (``--pin-cpus``, :mod:`~wan_s2v_runner.rank.cpu_binding`); the CPUs it is bound to, or None
    when left to the OS (within ``--cpus``)."""
    if spec.device != "cpu":
        return None
    local_world, allowed = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), os.sched_getaffinity(0)
    if spec.cpus:  # the group's own CPUs (--cpus; serve --replicas: its share of the node's)
        allowed = (set(spec.cpu_list) & allowed) or allowed
        os.sched_setaffinity(0, allowed)
    cpus = cpu_binding(spec.pin_cpus, spec.threads, int(os.environ.get("LOCAL_RANK", 0)), local_world, allowed)
    if cpus is None and spec.pin_cpus:
        logging.getLogger("wan_s2v").warning(
            "--pin-cpus: %d local ranks x %d threads need more CPUs than the %d allowed here; not binding",
            local_world, spec.threads, len(allowed))
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    return cpus


@record
def main(argv: list[str] | None = None, *, body=None, events_cls: type[RankEvents] = RankEvents,
         spec_for_rank=None) -> int:
    """One rank: ``argv`` = [SPEC_JSON]. A worker module of one's own calls it with ``body``
    (``body(spec, run_dir, events)`` in place of the engine's :func:`run_rank`), ``events_cls``
    (a :class:`RankEvents` subclass) or ``spec_for_rank`` (``(spec, rank) -> spec``: what this
    rank reads, e.g. another node's checkpoint directory)."""
    argv = sys.argv[1:] if argv is None else argv
    spec_path = Path(argv[0])
    run_dir = spec_path.parent
    spec = read_spec(spec_path)  # the group's (a run's: with its one job)
    rank = int(os.environ.get("RANK", 0))
    if spec_for_rank is not None:
        spec = spec_for_rank(spec, rank)
    _setup_logging(rank)
    stack_files = _register_stack_dump(run_dir, rank)  # noqa: F841 (open for the process's life)
    events_cls.starting(rank)
    cpus = _bind_cpus(spec)  # before any thread starts: threads inherit the binding
    pin_mmap_threshold()  # a long run's heap does not grow by fragmentation (shared/procfs.py)
    gpu = int(os.environ.get("LOCAL_RANK", 0)) if spec.device == "cuda" else None  # run_rank's set_device
    events = events_cls(run_dir, rank, StagePeaks(cuda_device=gpu))
    events.emit(EventKind.HELLO, pid=os.getpid(), host=os.uname().nodename,
                local_rank=int(os.environ.get("LOCAL_RANK", 0)), cpus=cpus, fork_gate=fork_gate.parties())
    t0 = time.time()
    try:
        (body or run_rank)(spec, run_dir, events)
    except BaseException as e:
        events.error(e)
        raise
    finally:
        events.stage_peak()  # the last stage's
        events.emit(EventKind.END, wall_s=round(time.time() - t0, 3), **memory_figures(events.peaks))
        events.close()
    return 0


def preload(spec: GroupSpec) -> None:
    """What the node's agent imports before it forks the ranks (:func:`wan_s2v_runner.rank.agent.preload`):
    the engine (``spec.wan_repo``'s, with its pre-import fixes) and the modules :func:`run_rank`
    imports to patch, load and generate. Touches no GPU."""
    preload_modules(spec.wan_repo)


def preload_modules(wan_repo) -> None:
    """:func:`preload`'s imports for the engine at ``wan_repo`` (None: the installed one); a
    node's warm agent (:mod:`wan_s2v_runner.rank.warm_agent`) makes them once for many runs."""
    engine.import_wan(wan_repo)
    import patches  # noqa: F401
    import runners  # noqa: F401
    from wan_s2v_runner.rank import block_pipeline, clip_steps, job_shell  # noqa: F401
    from wan_s2v_runner.shared import media  # noqa: F401


def rank_main(spec_path: str) -> int:
    """A rank, as the node's agent (:mod:`wan_s2v_runner.rank.agent`) runs it in each forked child."""
    return main([spec_path])


if __name__ == "__main__":
    sys.exit(main())
