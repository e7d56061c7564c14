"""A rank without the engine, for the tests whose subject is the launcher and its supervisor.

``WAN_S2V_RANK_WORKER=tests.stub_rank`` (:func:`rank_main`) makes every rank the real worker (its
``@record`` entry point, ``hello``/``end`` events, stack dumps, CPU binding) with the tests' fault
injection (``WAN_S2V_TEST_FAULT`` at every stage: tests/fault_worker.py) running
:func:`run_rank` below instead of the engine: it joins the real gloo process group, walks the
stages a run's rank reports (load, then per clip: denoise with its steps, decode), does a real
``all_to_all`` at every denoising step (where a sequence-parallel rank waits for its peers), and
rank 0 writes the mp4 with the run's audio through the same encoders and file
(:func:`~wan_s2v_runner.shared.media.save_video_with_audio`) under a temporary name, then (stage
``save``) renames it. It imports torch, not the engine (it has no ``preload``: the node's agent imports only
torch before forking it): a group starts in about a second instead of several. A served group
(a server's: its spec is a group's, its run directory has an inbox) only waits, idle, until the
server says stop: the tests that start a server on the stub are about what the server does
before any job reaches its ranks.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

#: seconds a stub denoising step takes (a test waits for a rank mid-denoise and acts on it)
STEP_S = 0.15
#: seconds the stub "loads" (the launcher samples each rank's memory, once a second, meanwhile)
LOAD_S = 1.0
FPS = 16


def run_rank(spec, run_dir: Path, events) -> int:
    import torch
    import torch.distributed as dist

    from wan_s2v_runner.shared import atomic, inbox, media
    from wan_s2v_runner.shared.job_source import JobSource, read_source
    from wan_s2v_runner.shared.stages import Stage

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    events.stage(Stage.INIT_PG)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=spec.pg_timeout_s))
    try:
        events.stage(Stage.ENGINE_IMPORT)
        events.stage(Stage.LOAD)
        time.sleep(LOAD_S)
        dist.barrier()
        if read_source(run_dir) is JobSource.INBOX:  # a served group: idle until the server says stop
            events.stage(Stage.IDLE)
            said = time.time()
            while not inbox.stopping(run_dir):
                time.sleep(0.2)
                if time.time() - said >= 2.0:  # the hang watchdog's sign of life, as a served rank says it
                    said = time.time()
                    events.emit("waiting")
            events.stage(Stage.DONE)
            dist.destroy_process_group()
            return 0
        clips, steps = spec.num_clips or 2, spec.steps
        frames = []
        for clip in range(1, clips + 1):
            events.stage(Stage.DENOISE, clip=clip, clips=clips, steps=steps)
            for step in range(1, steps + 1):
                sent = [torch.full((4,), float(rank)) for _ in range(world)]
                got = [torch.empty(4) for _ in range(world)]
                dist.all_to_all(got, sent)  # a sequence-parallel step's exchange
                time.sleep(STEP_S)
                events.step(clip=clip, clips=clips, step=step, steps=steps)
            events.stage(Stage.DECODE, clip=clip, clips=clips)
            frames.append(torch.linspace(-1, 1, 3 * 4 * 16 * 16).reshape(3, 4, 16, 16) * (clip / clips))
        if rank == 0:
            video = torch.cat(frames, dim=1)
            events.emit("frames", shape=list(video.shape))
            grown = atomic.temp_name(spec.output, "video")  # the video, complete under a temporary name
            media.save_video_with_audio(video, FPS, spec.speech, grown, [f.shape[1] for f in frames])
            events.stage(Stage.SAVE)
            atomic.replace(grown, spec.output, durable=True)
        events.stage(Stage.DONE)
    except BaseException as e:
        events.error(e)
        raise
    dist.destroy_process_group()
    return 0


#: the spec's environment layer naming this worker (``$WAN_S2V_RANK_WORKER``), for a command's environment
ENV = {"WAN_S2V_RANK_WORKER": "tests.stub_rank"}


def rank_main(spec_path: str) -> int:
    from tests import fault_worker

    return fault_worker.rank_main(spec_path, body=run_rank)
