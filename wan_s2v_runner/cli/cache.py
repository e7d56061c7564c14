"""``wan-s2v cache``: every cache wan-s2v keeps, listed (path, size, last use, what it is for)
or cleared (one, a kind, or all), for a person (Rich on a terminal, plain lines elsewhere) or a
program (``--json``). The caches, their rule and their clearing are ``shared.caches``'; this
module reads the words and prints.

Where the caches are follows the settings (``--cache-dir``, ``--config``'s ``cache_dir``,
``$WAN_S2V_CACHE_DIR``, ``$WAN_S2V_DIT_CACHE_DIR``, ``$XDG_CACHE_HOME``), as a run's do.
"""
from __future__ import annotations

import json
import sys
import time
from enum import Enum
from typing import Callable, Optional

from wan_s2v_runner.shared import cache_budget, exit_codes
from wan_s2v_runner.shared.cache_dirs import CacheKind
from wan_s2v_runner.shared.caches import (
    ALL,
    CacheEntry,
    Cleared,
    Summary,
    UnknownTarget,
    clear,
    human,
    select,
    summary,
)


class CacheAction(str, Enum):
    LIST = "list"
    CLEAR = "clear"


def _when(t: Optional[float]) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _state(e: CacheEntry) -> str:
    if e.file is None:
        return "" if e.owned else "not wan-s2v's alone ($TORCHINDUCTOR_CACHE_DIR)"
    if e.in_use:
        pids = f" (pid {', '.join(map(str, e.file.pids))})" if e.file.pids else ""
        return ("being written" if e.file.temporary else "in use") + pids
    return ""


def plain_lines(s: Summary) -> list[str]:
    """The listing as plain lines: one per cache (kind, size, last use, path, what for), then the sum."""
    lines = []
    for e in s.entries:
        state = _state(e)
        lines.append(f"{e.kind.value:<9} {human(e.bytes):>10}  {_when(e.last_use):<16}  {e.path}  {e.what}"
                     + (f" [{state}]" if state else ""))
    lines.append(f"total: {s.line()}")
    return lines


def _rich(s: Summary) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(f"wan-s2v caches under {s.root}"), header_style="bold")
    for col in ("kind", "size", "last use", "path", "what for", "state"):
        t.add_column(col, overflow="fold")
    for e in s.entries:
        t.add_row(e.kind.value, human(e.bytes), _when(e.last_use), escape(str(e.path)), escape(e.what),
                  f"[yellow]{escape(_state(e))}[/]")
    console = Console()
    console.print(t)
    console.print(f"[bold]total:[/] {escape(s.line())}", highlight=False)


def _say_cleared(done: Cleared, s: Summary, json_mode: bool) -> None:
    if json_mode:
        print(json.dumps({"cleared": done.to_json(), "after": s.to_json()}, indent=2))
        return
    for e in done.removed:
        print(f"removed {e.path} ({human(e.bytes)}; {e.kind.value}: {e.what})")
    for e, why in done.kept:
        print(f"kept {e.path} ({human(e.bytes)}): {why}")
    print(f"freed {human(done.freed)}; now {s.line()}")


def cmd_cache(args, spec_values: Callable) -> int:
    """List (the default) or clear (``clear WHAT...``)."""
    words = list(getattr(args, "words", None) or [])
    try:
        action = CacheAction(words[0]) if words else CacheAction.LIST
    except ValueError:
        print(f"error: wan-s2v cache {words[0]!r}: not an action. Fix: wan-s2v cache list, or wan-s2v cache clear "
              f"WHAT ({ALL}, a kind: {', '.join(k.value for k in CacheKind)}, a path, a file name or key)",
              file=sys.stderr)
        return exit_codes.USAGE
    try:
        values = spec_values(args)
        cache_budget.parse(values.get("dit_cache_max"))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    root, budget = values.get("cache_dir"), values.get("dit_cache_max")
    s = summary(root, budget)
    if action is CacheAction.LIST:
        if len(words) > 1:
            print("error: wan-s2v cache list takes nothing more. Fix: wan-s2v cache list (or --json)", file=sys.stderr)
            return exit_codes.USAGE
        if args.json:
            print(json.dumps(s.to_json(), indent=2))
        elif sys.stdout.isatty():
            _rich(s)
        else:
            print("\n".join(plain_lines(s)))
        return exit_codes.OK
    if len(words) < 2:
        print(f"error: wan-s2v cache clear: clear what? Fix: name {ALL}, a kind "
              f"({', '.join(k.value for k in CacheKind)}), or a path, file name or key wan-s2v cache list shows",
              file=sys.stderr)
        return exit_codes.USAGE
    try:
        chosen = select(s.entries, words[1:])
    except UnknownTarget as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    done = clear(chosen)
    _say_cleared(done, summary(root, budget), bool(args.json))
    return exit_codes.OK
