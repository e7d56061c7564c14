"""The DiT page-cache file's room, before anything spawns (``output.dit_cache``), and the caches
in sum for the doctor (:func:`caches_report`).

Where the plan streams the DiT's bytes from the page cache (``memory.host``'s plan: ``--dit-stream-from
page-cache``, or ``auto`` choosing it; on the CPU, ``page-cache`` given), the run finds its file or
writes one (``loading.dit_cache``). The check plans that write with the rank's own rule
(``shared.cache_budget``) on the cache directory's files (``shared.dit_files``) and its disk:

* a whole file of this checkpoint, ``--dit-quant``, LoRA set (paths, strengths, sizes) and dtype
  (its trailer's ``about``) is there: it is likely reused, nothing is written (``ok``; a LoRA
  rewritten in place makes the rank write a new one all the same);
* else the least recently used others go (never one in use) until the files and the new one fit the
  budget (``--dit-cache-max``; default a quarter of the disk, and at least the one file) and the disk
  keeps the room the job's video needs there (``output.disk``'s plan) and
  ``cache_budget.DISK_FLOOR``: ``warn`` naming what goes, ``ok`` when nothing does;
* ``fail``, with the fix, when even evicting every file not in use does not make room.

The budget it settles (``budget_bytes``: the budget less what would leave the disk short of the
video) is the one the rank gets (``GateReport.settled``: ``dit_cache_max``), so the rank evicts
what the check listed. A recorded machine (``--machine``) has no listing of its cache files: the
check says so and plans as if none were kept (its recorded free space is what is left beside
them).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared import cache_budget, dit_files
from wan_s2v_runner.shared.cache_budget import DISK_FLOOR, Held, human
from wan_s2v_runner.shared.layout import DitOffload, DitQuant, StreamSource
from wan_s2v_runner.shared.stream_source import cache_dir

from .core import fail, ok, skip, warn

ID = "output.dit_cache"


def _file_bytes(ctx) -> tuple[Optional[int], str]:
    """(the page-cache file's bytes, why none) for this run: the plan's where it streams from the
    page cache; on the CPU (not planned) from the DiT's sizes when ``page-cache`` is given."""
    from .checks_memory import current_plan
    spec = ctx.spec
    if spec.dit_offload is not DitOffload.BLOCKS:
        return None, "the DiT is not streamed (no page-cache file)"
    if ctx.on_cuda:
        p = ctx.cache.get("plans", {}).get(ctx.mode.value) or current_plan(ctx)
        if not p.stream:
            return None, f"{ctx.mode.value} mode does not stream the DiT"
        if p.stream.get("source") != StreamSource.PAGE_CACHE.value:
            return None, f"the streamed DiT's bytes stay in memory ({p.source_why or 'the plan'})"
        return int(p.stream["file_bytes"]), ""
    if StreamSource(spec.dit_stream_from) is not StreamSource.PAGE_CACHE:
        return None, (f"--device cpu with --dit-stream-from {StreamSource(spec.dit_stream_from).value}: the rank "
                      "decides (memory unless its RAM is short)")
    from wan_s2v_runner.shared.precision import element_bytes
    from wan_s2v_runner.shared.quant import SCALE_BYTES

    from .memory import compute_dtype, model_sizes
    sizes, pb = model_sizes(ctx), element_bytes(compute_dtype(ctx)[0])
    if DitQuant(spec.dit_quant) is DitQuant.FP8 and sizes.dit_fp8_params:
        return ((sizes.dit_params - sizes.dit_fp8_params) * pb + sizes.dit_fp8_params
                + sizes.dit_fp8_rows * SCALE_BYTES), ""
    return sizes.dit_params * pb, ""


def where(ctx) -> Path:
    """The DiT cache directory of this run (``shared.cache_dirs``' rule on the facts' environment)."""
    return cache_dir(None if ctx.facts.live else ctx.facts.env, setting=ctx.spec.cache_dir)


def _disk(ctx, path: Path) -> Optional[dict]:
    if ctx.facts.live:
        from .probe import filesystem
        return filesystem(path)
    return ctx.facts.filesystem(path)


def _same_path(recorded, given) -> bool:
    """Whether a path a cache file recorded (absolute, as its writer saw it) is ``given`` (a link to it
    counts: both resolved)."""
    if recorded is None or given is None:
        return recorded is given
    try:
        return Path(recorded).resolve() == Path(given).resolve()
    except OSError:
        return str(recorded) == str(given)


def matches(about: dict, ctx) -> bool:
    """Whether a file's ``about`` is this run's DiT: its checkpoint (or ``--dit-file``),
    quantization, dtype and LoRA set (paths, strengths, sizes)."""
    from .memory import compute_dtype
    spec = ctx.spec
    if spec.dit_file is not None:
        if not _same_path(about.get("dit_file"), spec.dit_file):
            return False
    elif about.get("dit_file") is not None or not _same_path(about.get("checkpoint"), spec.ckpt_dir):
        return False
    if about.get("quant") != DitQuant(spec.dit_quant).value or about.get("dtype") != compute_dtype(ctx)[0].value:
        return False
    want = []
    for ref in spec.lora:
        try:
            want.append((str(Path(ref.path).resolve()), float(ref.strength), Path(ref.path).stat().st_size))
        except OSError:
            return False
    have = [(str(Path(x["path"]).resolve()) if x.get("path") else None, float(x.get("strength", 1.0)), x.get("bytes"))
            for x in about.get("loras") or []]
    return have == want


def _video_bytes(ctx, disk: dict) -> tuple[int, str]:
    """What the job writes on ``disk`` (``output.disk``'s plan), and its words."""
    if ctx.spec.output is None:
        return 0, "no --output: no video's room kept"
    from .checks_inputs import disk_needs
    need = sum(n for _, w, n in disk_needs(ctx) if (_disk(ctx, w) or {}).get("path") == disk["path"])
    return need, (f"the video's {human(need)} kept free there" if need else "the video goes to another disk")


def check_dit_cache(ctx):
    """The page-cache file's room: reused, written after evicting the least recently used, or refused."""
    if ctx.group_running:
        return skip(ID, "the rank group is up: its DiT cache file was found or written at its start")
    size, why = _file_bytes(ctx)
    if size is None:
        return skip(ID, why)
    directory = where(ctx)
    try:
        budget = cache_budget.parse(ctx.spec.dit_cache_max)
    except cache_budget.BudgetError as e:
        return fail(ID, f"--dit-cache-max: {e}", "give a size like 200G or a share like 20%")
    need = dit_files.write_needs(size)
    files = dit_files.scan(directory) if ctx.facts.live else []
    unknown = "" if ctx.facts.live else " (a recorded machine: its cache files are unknown, planned as none)"
    found = next((f for f in files if f.meta is not None and matches(f.about, ctx)), None)
    data = dict(directory=str(directory), file_bytes=need, budget=budget.describe())
    if found is not None:
        return ok(ID, f"reuses {found.path} ({human(found.bytes)}, {found.describe()}; last used "
                  f"{_when(found.last_use)}): nothing written", reuses=str(found.path), **data)
    disk = _disk(ctx, directory)
    if disk is None:
        return skip(ID, f"writes a {human(need)} DiT file under {directory}; its disk's free space is unknown"
                    f"{unknown}", **data)
    free, total = int(disk["free_mib"] * 2**20), int((disk.get("total_mib") or 0) * 2**20) or None
    video, video_words = _video_bytes(ctx, disk)
    cap = budget.limit(total, need)
    held = [Held(f.path.name, f.bytes, f.last_use, f.in_use) for f in files]
    cached = sum(h.bytes for h in held)
    room = cache_budget.room_budget(cap, cached, free, video)
    plan = cache_budget.plan_room(held, need, room, free, reserve=video + DISK_FLOOR)
    pinned = sum(h.bytes for h in held if h.in_use)
    in_use = f", {human(pinned)} of it in use by running groups" if pinned else ""
    where_ = (f"a {human(size)} DiT file ({human(need)} with its write's margin) under {directory}: the cache "
              f"holds {human(cached)}{in_use}, budget "
              f"{budget.describe(total)}; {human(free)} free on {disk['path']}, {video_words}{unknown}")
    data.update(budget_bytes=room, cache_bytes=cached, disk_free=free, video_bytes=video,
                evicts=[str(directory / h.name) for h in plan.evict])
    if not plan.fits:
        if cap is not None and need + pinned > cap:
            return fail(ID, f"{where_}: the file{' beside the files in use' if pinned else ''} exceeds the budget",
                        f"raise --dit-cache-max (${cache_budget.BUDGET_ENV}) to at least "
                        f"{human(need + pinned)}, or --dit-quant fp8 (half the file), or --dit-stream-from memory",
                        **data)
        short = need + video + DISK_FLOOR - free - (cached - pinned)
        return fail(ID, f"{where_}: not enough disk even with every cache file not in use evicted",
                    f"free {human(max(short, 0))} more on {disk['path']}, or point --cache-dir ($WAN_S2V_CACHE_DIR) "
                    "at a disk with room, or --dit-stream-from memory", **data)
    if plan.evict:
        gone = "; ".join(f"{h.name} ({human(h.bytes)}, last used {_when(h.last_use)}: "
                         f"{next(f for f in files if f.path.name == h.name).describe()})" for h in plan.evict)
        return warn(ID, f"writes {where_}; evicts the least recently used first: {gone}",
                    f"to keep them, raise --dit-cache-max (${cache_budget.BUDGET_ENV}) or free space on "
                    f"{disk['path']}; wan-s2v cache lists what is kept", **data)
    return ok(ID, f"writes {where_}; nothing evicted", **data)


def _when(t: Optional[float]) -> str:
    import time
    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def caches_report(ctx) -> dict:
    """The caches in sum for the doctor: this machine's (``shared.caches``), or for a recorded
    machine what its facts know: where they would be and that disk's free space, the caches'
    sizes unknown."""
    from wan_s2v_runner.shared import caches
    if ctx.facts.live:
        s = caches.summary(ctx.spec.cache_dir, ctx.spec.dit_cache_max)
        out = s.to_json()
        out.pop("caches")
        return {**out, "known": True, "line": s.line()}
    directory = where(ctx)
    disk = ctx.facts.filesystem(directory)
    free = None if disk is None else int(disk["free_mib"] * 2**20)
    line = (f"unknown for a recorded machine (its facts list no caches); the DiT cache would be {directory}"
            + (f", {human(free)} free on {disk['path']} (recorded)" if disk is not None else
               ", its disk's free space unknown (the facts list no disks)"))
    return {"known": False, "dit_dir": str(directory), "total_bytes": None,
            "disk": None if disk is None else {"path": disk["path"], "free": free,
                                               "total": int((disk.get("total_mib") or 0) * 2**20) or None},
            "line": line}
