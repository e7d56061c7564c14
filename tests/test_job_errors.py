"""A served job's error is the job's only when the group is in step (``rank.job_errors``), asked
over real gloo ranks: both ranks raised at the same point -> in step; one raised while its peer
waits in a collective of the job, or the two raised at different points -> not in step (the peer
that does not answer is waited for a bounded time). The served group's behaviour on top
(the job failed alone, the next job made without a reload) is tests/test_serve.py's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env

from wan_s2v_runner.rank import job_errors

WORKER = Path(__file__).with_name("job_errors_worker.py")


@pytest.mark.slow(seconds=6)
@pytest.mark.parametrize("scenario, want", [("same point", [True, True]), ("different points", [False, False]),
                                            ("peer in a collective", [False, None])])
def test_a_job_error_is_the_jobs_only_when_every_rank_raised_at_the_same_point(scenario, want, tmp_path):
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), scenario, str(tmp_path / "store"), str(outs[r])],
                              env=cli_env()) for r in range(2)]
    for p in procs:
        assert p.wait(60) == 0, scenario
    got = [json.loads(o.read_text()) for o in outs]
    assert [g["in_step"] for g in got] == want
    if scenario == "peer in a collective":
        assert 2.5 <= got[0]["s"] < 30, got  # the bounded wait (3 s here), then the group's error


def test_one_rank_is_always_in_step_and_some_errors_are_always_the_groups():
    import torch
    import torch.distributed as dist

    assert job_errors.control_group() is None and job_errors.in_step(("denoise", 1, 1), None)
    assert not job_errors.the_groups(RuntimeError("index 1024 is out of bounds"))
    assert not job_errors.the_groups(torch.OutOfMemoryError("CUDA out of memory"))  # the next job can run
    assert job_errors.the_groups(dist.DistError("connection closed"))
    assert job_errors.the_groups(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert job_errors.the_groups(KeyboardInterrupt())
