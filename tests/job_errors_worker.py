"""One of the two gloo ranks of tests/test_job_errors.py: ``python job_errors_worker.py RANK
SCENARIO STORE OUT``; writes whether it found the group in step (and how long it asked) to OUT."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from wan_s2v_runner.rank import job_errors


def main(rank: str, scenario: str, store: str, out: str) -> None:
    """This rank's part of ``scenario``, over gloo (a file store shared by the two)."""
    from datetime import timedelta

    import torch.distributed as dist

    rank = int(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    control = job_errors.control_group(timeout_s=3)
    t0, result = time.time(), None
    if scenario == "same point":
        result = job_errors.in_step(("denoise", 1, 2), control)
    elif scenario == "different points":
        result = job_errors.in_step(("denoise", 1, 2 + rank), control)
    elif scenario == "peer in a collective":
        if rank == 0:  # raised; its peer waits in the job's next collective (a barrier here)
            result = job_errors.in_step(("denoise", 1, 2), control)
            dist.barrier()  # let the peer out (the test's clean-up)
        else:
            dist.barrier()
    Path(out).write_text(json.dumps({"in_step": result, "s": time.time() - t0}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
