"""Preflight reports in words: the doctor's rich table (plain, wide lines when not a terminal)
and the ``run`` gate's lines (one summary line with each warning's finding and fix, or the
refusal with each failure and warning). JSON output is the reports' own ``to_json``.
:func:`gate` is ``run``'s preflight: check, then say it."""
from __future__ import annotations

import json
import sys
from typing import Optional

from wan_s2v_runner.shared import exit_codes

from .context import ModeSource
from .core import CheckResult, Status, gib
from .doctor import DoctorReport, GateReport, check_group, check_run
from .facts import MachineFacts

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def check_line(r: CheckResult) -> str:
    """'  WARN id: finding' and, when there is one, '       fix: ...' below."""
    s = f"  {r.status.value.upper():4} {r.id}: {r.finding}"
    if r.fix:
        s += f"\n       fix: {r.fix}"
    return s


def gate_text(report: GateReport) -> str:
    fails, warns = report.with_status(Status.FAIL), report.with_status(Status.WARN)
    c = report.counts
    if report.refused:
        lines = [f"preflight refused the run ({len(fails)} failed, {len(warns)} warnings); no rank was started."]
        lines += [check_line(r) for r in fails + warns]
        lines.append("Full report: wan-s2v doctor with the same flags. Override (not recommended): "
                     "--skip-preflight.")
        return "\n".join(lines)
    head = (f"preflight: {c['ok']} ok, {c['warn']} warn, {c['skip']} skipped "
            "(details: wan-s2v doctor with the same flags)")
    return "\n".join([head] + [f"  WARN {r.id}: {r.finding}" + (f" (fix: {r.fix})" if r.fix else "")
                               for r in warns])


def print_gate(report: GateReport, json_mode: bool = False) -> None:
    if json_mode and report.refused:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(gate_text(report), file=sys.stderr)


def gate(spec, json_mode: bool = False, facts: Optional[MachineFacts] = None) -> Optional[int]:
    """Check ``spec``, print the verdict, and return :data:`exit_codes.PREFLIGHT` when the run
    must not be spawned (None otherwise)."""
    return exit_codes.PREFLIGHT if gate_report(spec, json_mode, facts).refused else None


def gate_report(spec, json_mode: bool = False, facts: Optional[MachineFacts] = None) -> GateReport:
    """:func:`gate`, returning the report (its findings' data: e.g. the load waves chosen)."""
    report = check_run(spec, facts)
    print_gate(report, json_mode)
    return report


def group_gate_report(group, defaults: dict, output=None, json_mode: bool = False,
                      facts: Optional[MachineFacts] = None, node_groups: int = 1) -> GateReport:
    """:func:`gate_report` for a rank group before any job (``wan-s2v serve``; ``node_groups`` of
    them side by side on the node with ``--replicas``)."""
    report = check_group(group, defaults, output, facts, node_groups)
    print_gate(report, json_mode)
    return report


def render_doctor(report: DoctorReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 200))
    ctx, rec, f = report.ctx, report.recommendation, report.ctx.facts
    console.print(f"[bold]wan-s2v doctor[/] — {f.label}" + ("" if f.live else " [dim](recorded facts)[/]"))
    if ctx.notes:
        console.print("[dim]assumed: " + "; ".join(ctx.notes) + "[/]")
    t = Table(show_lines=False, header_style="bold")
    for col in ("group", "check", "status", "finding", "fix"):
        t.add_column(col, overflow="fold")
    last = None
    for r in report.results:
        group = r.group.value if r.group is not None else ""
        t.add_row(group if group != last else "", r.id, f"[{_STYLE[r.status.value]}]{r.status.value}[/]",
                  r.finding, r.fix)
        last = group
    console.print(t)
    wl = report.workload
    mt = Table(title=f"memory plan per rank ({wl.width}x{wl.height}, {wl.tokens.max_len} tokens, "
               f"{wl.n_clips} {wl.unit}(s); approximate, see docs/memory-plan.md)", header_style="bold")
    nproc = ctx.spec.nproc
    node = f"host, node ({nproc} rank{'s' if nproc > 1 else ''})"
    for col in ("mode", "ranks", "GPU/rank", "host/rank", node, "GPU free (min)"):
        mt.add_column(col)
    free = min((g.get("free_mib") or 0 for g in ctx.local_gpus), default=0) * 2**20
    rows = dict(report.plans)
    if report.streamed is not None:
        rows["ulysses, streamed"] = report.streamed
    for name, p in rows.items():
        cache = ", page cache" if (p.stream or {}).get("source") == "page-cache" else ""
        mark = ((f" (streamed{cache})" if p.stream is not None and "streamed" not in name else
                 f" ({cache[2:]})" if cache else "")
                + (" (encoders released)" if p.host_phases is not None else "")
                + (" *" if name == ctx.mode.value else ""))
        gpu = gib(p.gpu_peak) if p.gpu_peak else "-"
        if p.gpu_peak and free:
            gpu = f"[{'green' if p.gpu_peak <= 0.9 * free else 'red'}]{gpu}[/]"
        mt.add_row(name + mark, str(p.world_size), gpu, gib(p.host_peak), gib(p.host_node_total),
                   gib(free) if free else "-")
    console.print(mt)
    if report.job_time is not None:
        from .checks_time import describe
        console.print(f"[bold]job time:[/] {describe(report.job_time, ctx.layout.world_size)} "
                      "[dim](the DiT passes only; docs/preflight.md)[/]")
    if report.caches is not None:
        console.print(f"[bold]caches:[/] {report.caches['line']} [dim](wan-s2v cache lists them)[/]")
    _render_plans(report, console)
    _render_splits(report, console)
    console.print(f"sizes: {report.sizes.source}" + (f"; assumed {', '.join(wl.assumed)}" if wl.assumed else ""))
    console.print(f"[bold]recommended mode:[/] {rec.mode.value} — {rec.text}")
    if ctx.mode_source is ModeSource.FLAG and ctx.mode is not rec.mode:
        console.print(f"[yellow]checked --mode {ctx.mode.value} as requested[/]")
    c = report.counts
    console.print(f"{c['ok']} ok, {c['warn']} warn, {c['fail']} fail, {c['skip']} skipped "
                  f"-> exit {report.exit_code}")


def _render_splits(report: DoctorReport, console) -> None:
    """A server of these GPUs as 1..N rank groups (``serve --replicas``): videos per hour and latency."""
    from rich.table import Table

    from .plans import best_splits

    if len(report.splits) < 2:
        return
    most, soonest = best_splits(report.splits)
    gpus = report.ctx.layout.world_size
    t = Table(title=f"serving on {gpus} GPUs: one wide group or --replicas (queue of {report.queue_depth} jobs, "
              "--queue-depth; est. from per-rank compute and the calibrated all-to-all cost)", header_style="bold")
    for col in ("groups", "each group", "speed-up each", "videos per hour (x 1 GPU)", "mean latency (x 1 GPU video)"):
        t.add_column(col)
    for s in report.splits:
        notes = [n for n, pick in (("most videos", most), ("lowest latency", soonest)) if s is pick]
        flag = f" --replicas {s.groups}" if s.groups > 1 else ""
        cfg = " --cfg-parallel" if s.plan.layout.cfg_degree > 1 else ""
        t.add_row(f"{s.groups}{flag}", f"{s.plan.shape}{cfg}", f"{s.speedup:.2f}x",
                  f"{s.videos_per_gpu_time:.2f}" + (f" [bold]({', '.join(notes)})[/]" if notes else ""),
                  f"{s.mean_latency:.3f}")
    console.print(t)


def _render_plans(report: DoctorReport, console) -> None:
    """The fastest plan of the checked mode for each GPU count (wan_s2v_runner.preflight.plans)."""
    from rich.table import Table

    ctx, wl, first = report.ctx, report.workload, report.parallel_plans[0]
    lengths = "/".join(map(str, first.lengths))
    t = Table(title=f"{ctx.mode.value}: fastest plan per GPU count ({wl.width}x{wl.height}, {lengths} tokens, "
              f"{first.heads} heads; est. DiT speed-up from per-rank compute, "
              "communication not included)", header_style="bold")
    for col in ("GPUs", "plan", "heads/rank", "padding", "est. speed-up"):
        t.add_column(col)
    for p in report.parallel_plans:
        mark = " *" if p.layout.world_size == ctx.layout.world_size else ""
        if not p.valid:
            t.add_row(f"{p.layout.world_size}{mark}", f"[red]{'; '.join(p.problems)}[/]", "-", "-", "-")
            continue
        split = p.head_split
        heads = str(split[0]) if len(set(split)) == 1 else f"{max(split)}/{min(split)}"
        pad = f"{p.padding_overhead * 100:.2g}%" if p.padding_overhead else "-"
        shape = p.shape + (" (--cfg-parallel)" if p.layout.cfg_degree > 1 else "")
        t.add_row(f"{p.layout.world_size}{mark}", shape, heads, pad, f"{p.speedup:.2f}x")
    console.print(t)
