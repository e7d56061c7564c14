"""The fit table of docs/loading.md and docs/memory-plan.md: for each recorded machine
(tests/data/machines/), size and DiT dtype, the memory plan's GPU peak per rank of the best
resident layout against the streamed DiT (``--dit-offload blocks``), and whether each fits the
machine's free GPU memory; plus the streamed run's host need and its copies against its compute.
The 14B's sizes (no checkpoint needed); the plan is the doctor's (approximate: docs/memory-plan.md).

    .venv/bin/python bench/fit_table.py            # markdown
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MACHINES = ("rtx4060ti16_1x", "rtx4090_1x", "rtx5090_1x", "rtx4090_2x", "rtx3090_2x_nop2p", "h100_1x")
CASES = (("1024*704", "none"), ("1024*704", "fp8"), ("832*480", "none"), ("832*480", "fp8"))


def main() -> None:
    from wan_s2v_runner.preflight.checks_memory import stream_timing
    from wan_s2v_runner.preflight.context import CheckContext
    from wan_s2v_runner.preflight.core import gib
    from wan_s2v_runner.preflight.facts import MachineFacts
    from wan_s2v_runner.preflight.memory import REFERENCE, free_gpu_bytes, plan_all
    from wan_s2v_runner.shared.layout import Mode

    sizes = replace(REFERENCE, source="checkpoint (the 14B's sizes)")
    print("| machine | size | DiT | resident: best layout, GPU/rank | streamed (ulysses): GPU/rank, blocks "
          "resident | free GPU | host RAM (streamed) | copies vs compute per pass |")
    print("|---|---|---|---|---|---|---|---|")
    def ctx(facts, size, quant, **extra):
        c = CheckContext.for_values({"max_area": size, "dit_quant": quant, **extra}, facts)
        c.cache["sizes"] = sizes
        return c

    for name in MACHINES:
        facts = MachineFacts.load(ROOT / "tests" / "data" / "machines" / f"{name}.json")
        for size, quant in CASES:
            base = ctx(facts, size, quant)
            free = free_gpu_bytes(base)
            resident = plan_all(base)
            best = min(resident, key=lambda m: resident[m].gpu_peak)
            rp = resident[best]
            sctx = ctx(facts, size, quant, dit_offload="blocks", mode="ulysses")
            sp = plan_all(sctx)[Mode.ULYSSES.value]
            t = stream_timing(sctx, sp, facts.gpus[0])
            ram = facts.host.get("mem_available_mib", 0) * 2**20
            host = f"{gib(sp.host_node_total)} of {gib(ram)}"
            pace = (f"{t.copy_s:.2f} s vs ~{t.compute_s:.0f} s" if t.compute_s else f"{t.copy_s:.2f} s vs ?")
            label = facts.label.split(" (")[0].split(",")[0]
            print(f"| {label} | {size.replace('*', 'x')} | {'bf16' if quant == 'none' else 'fp8'} | "
                  f"{best} {gib(rp.gpu_peak)}: {_fits(rp, free)} | {gib(sp.gpu_peak)}, "
                  f"{sp.stream['resident_blocks']}: {_fits(sp, free)} | {gib(free)} | {host} | {pace} |")


def _fits(plan, free: int) -> str:
    return "fits" if plan.gpu_peak <= free else "**does not fit**"

if __name__ == "__main__":
    main()
