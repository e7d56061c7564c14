"""Test-only fault injection, honoured only when ``WAN_S2V_TEST_FAULT`` is set.

Format: ``RANK:STAGE:ACTION`` with ACTION one of ``raise`` (RuntimeError), ``exit`` (os._exit 3),
``hang`` (sleep forever, still heart-beating). Checked at every stage change and every denoising
step of the given rank, and as stage ``start`` before the rank writes any event (there ``hang``
is a rank that never reports). Users never set it; the supervision tests do.
"""
from __future__ import annotations

import os
import time

ENV = "WAN_S2V_TEST_FAULT"


class InjectedFault(RuntimeError):
    pass


def parse(value: str | None):
    if not value:
        return None
    rank, stage, action = value.split(":")
    if action not in ("raise", "exit", "hang"):
        raise ValueError(f"{ENV}: unknown action {action!r}")
    return int(rank), stage, action


def maybe_fire(rank: int, stage: str, fault=None) -> None:
    fault = fault if fault is not None else parse(os.environ.get(ENV))
    if not fault or fault[0] != rank or fault[1] != stage:
        return
    action = fault[2]
    if action == "raise":
        raise InjectedFault(f"injected fault on rank {rank} in stage {stage}")
    if action == "exit":
        os._exit(3)
    while True:  # hang
        time.sleep(3600)
