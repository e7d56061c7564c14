"""``wan-s2v doctor`` and the ``run`` gate: run the checks, print them, decide.

* :func:`gate` (called by ``cli.cmd_run`` before anything is spawned): the runner's check groups
  against the complete spec; any *fail* -> the failures and warnings are printed (cause + fix)
  and :data:`exit_codes.PREFLIGHT` is returned; otherwise one line ``preflight: N ok, M warn``.
* :func:`cmd_doctor`: a lenient context (no checkpoint/inputs needed), the recommended mode
  (used for the checks unless ``--mode`` is given), a rich table of every check, the memory plan
  of each mode, or all of it as JSON with ``--json``. Exit 0 when nothing fails, else 1.
  ``WAN_S2V_FACTS=machine.json`` makes doctor judge recorded facts instead of this machine.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Optional

from wan_s2v_runner import exit_codes

from .context import CheckContext
from .core import GROUPS, CheckResult, Status, counts, gib, run_checks
from .memory import model_sizes, plan_all, workload
from .probe import MachineFacts, probe_machine
from .recommend import Recommendation, recommend

FACTS_ENV = "WAN_S2V_FACTS"
_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def groups_for(mode) -> tuple[str, ...]:
    import runners
    return tuple(runners.get(mode).checks)


# --------------------------------------------------------------------------- gate
def _line(r: CheckResult) -> str:
    s = f"  {r.status.value.upper():4} {r.id}: {r.finding}"
    if r.fix:
        s += f"\n       fix: {r.fix}"
    return s


def gate(spec, runner, json_mode: bool = False, facts: Optional[MachineFacts] = None) -> Optional[int]:
    """Run ``runner.checks`` for ``spec``. Returns exit_codes.PREFLIGHT if any check fails."""
    ctx = CheckContext.from_spec(spec, facts)
    results = run_checks(ctx, runner.checks)
    c = counts(results)
    warns = [r for r in results if r.status is Status.WARN]
    fails = [r for r in results if r.status is Status.FAIL]
    if fails:
        if json_mode:
            print(json.dumps({"status": "preflight-refused", "exit_code": exit_codes.PREFLIGHT,
                              "counts": c, "results": [r.to_json() for r in fails + warns]}, indent=2))
        else:
            lines = [f"preflight refused the run ({len(fails)} failed, {len(warns)} warnings); "
                     "nothing was spawned."]
            lines += [_line(r) for r in fails + warns]
            lines.append("Full report: wan-s2v doctor with the same flags. Override (not recommended): "
                         "--skip-preflight.")
            print("\n".join(lines), file=sys.stderr)
        return exit_codes.PREFLIGHT
    tail = f" ({', '.join(r.id for r in warns)})" if warns else ""
    print(f"preflight: {c['ok']} ok, {c['warn']} warn{tail}, {c['skip']} skipped "
          "(details: wan-s2v doctor)", file=sys.stderr)
    return None


# --------------------------------------------------------------------------- doctor
def diagnose(ctx: CheckContext) -> dict:
    """Recommendation, results and memory plan for a context (the data behind doctor)."""
    rec = recommend(ctx)
    if ctx.mode_source == "default":
        ctx.with_mode(rec.mode, "recommended")
    groups = groups_for(ctx.mode)
    results = run_checks(ctx, groups)
    plans = plan_all(ctx)
    sizes, wl = model_sizes(ctx), workload(ctx)
    c = counts(results)
    return {
        "machine": {"label": ctx.facts.label, "live": ctx.facts.live,
                    "gpus": [g.get("name") for g in ctx.facts.gpus], "torch": ctx.facts.torch.get("version"),
                    "probe_errors": ctx.facts.raw.get("probe_errors") or []},
        "context": {"mode": ctx.mode.value, "mode_source": ctx.mode_source, "device": ctx.device,
                    "nproc": ctx.nproc, "nnodes": ctx.nnodes, "world_size": ctx.world_size,
                    "attention": ctx.attention, "ckpt_dir": str(ctx.ckpt_dir) if ctx.ckpt_dir else None,
                    "image": str(ctx.image) if ctx.image else None, "audio": str(ctx.audio) if ctx.audio else None,
                    "assumptions": ctx.notes, "groups": list(groups)},
        "recommendation": rec.to_json(),
        "results": [r.to_json() for r in results],
        "counts": c,
        "memory_plan": {
            "approximate": True, "formula": "docs/memory-plan.md",
            "sizes": asdict(sizes),
            "workload": {"width": wl.width, "height": wl.height, "tokens": wl.tokens.max_len,
                         "clips": wl.n_clips, "audio_seconds": wl.audio_seconds, "assumed": wl.assumed},
            "modes": {m: p.to_json() for m, p in plans.items()},
        },
        "exit_code": exit_codes.DOCTOR_FAILED if c["fail"] else exit_codes.OK,
        "_results": results, "_rec": rec, "_plans": plans, "_ctx": ctx,
    }


def render(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 200))
    ctx: CheckContext = report["_ctx"]
    rec: Recommendation = report["_rec"]
    m = report["machine"]
    console.print(f"[bold]wan-s2v doctor[/] — {m['label']}" + ("" if m["live"] else " [dim](recorded facts)[/]"))
    if ctx.notes:
        console.print("[dim]assumed: " + "; ".join(ctx.notes) + "[/]")
    t = Table(show_lines=False, header_style="bold")
    for col in ("group", "check", "status", "finding", "fix"):
        t.add_column(col, overflow="fold")
    last = None
    for r in report["_results"]:
        t.add_row(r.group if r.group != last else "", r.id, f"[{_STYLE[r.status.value]}]{r.status.value}[/]",
                  r.finding, r.fix)
        last = r.group
    console.print(t)
    plans = report["_plans"]
    mp = report["memory_plan"]
    mt = Table(title=f"memory plan per rank ({mp['workload']['width']}x{mp['workload']['height']}, "
               f"{mp['workload']['tokens']} tokens, {mp['workload']['clips']} clip(s); approximate, see "
               "docs/memory-plan.md)", header_style="bold")
    node = f"host, node ({ctx.nproc} rank{'s' if ctx.nproc > 1 else ''})"
    for col in ("mode", "ranks", "GPU/rank", "host/rank", node, "GPU free (min)"):
        mt.add_column(col)
    free = min((g.get("free_mib") or 0 for g in ctx.local_gpus), default=0) * 2**20
    for name, p in plans.items():
        mark = " *" if name == ctx.mode.value else ""
        gpu = gib(p.gpu_peak) if p.gpu_peak else "-"
        if p.gpu_peak and free:
            gpu = f"[{'green' if p.gpu_peak <= 0.9 * free else 'red'}]{gpu}[/]"
        mt.add_row(name + mark, str(p.world_size), gpu, gib(p.host_peak), gib(p.host_node_total),
                   gib(free) if free else "-")
    console.print(mt)
    console.print(f"sizes: {mp['sizes']['source']}" + (f"; assumed {', '.join(mp['workload']['assumed'])}"
                                                      if mp["workload"]["assumed"] else ""))
    console.print(f"[bold]recommended mode:[/] {rec.mode.value} — {rec.reason}")
    if ctx.mode_source == "flag" and ctx.mode is not rec.mode:
        console.print(f"[yellow]checked --mode {ctx.mode.value} as requested[/]")
    c = report["counts"]
    console.print(f"{c['ok']} ok, {c['warn']} warn, {c['fail']} fail, {c['skip']} skipped "
                  f"-> exit {report['exit_code']}")


def public_json(report: dict) -> dict:
    return {k: v for k, v in report.items() if not k.startswith("_")}


def cmd_doctor(args, facts: Optional[MachineFacts] = None) -> int:
    from wan_s2v_runner.cli import spec_values

    try:
        base, cli = spec_values(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    if facts is None:
        path = os.environ.get(FACTS_ENV)
        facts = MachineFacts.load(path) if path else probe_machine()
    ctx = CheckContext.from_values(base, cli, facts)
    report = diagnose(ctx)
    if getattr(args, "json", False):
        print(json.dumps(public_json(report), indent=2, default=str))
    else:
        render(report)
    return report["exit_code"]


__all__ = ["gate", "cmd_doctor", "diagnose", "render", "GROUPS"]
