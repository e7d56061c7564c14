"""Where a streamed DiT's host bytes live (``--dit-stream-from``): the one rule the memory plan
and the rank share, and where the page cache's file goes.

* ``memory``: the DiT's bytes in one host buffer (the node's shared copy, or the rank's own),
  pinned whole: anonymous (or shared) memory the kernel can neither reclaim nor swap.
* ``page-cache``: the bytes written once to a file (``loading.dit_cache``) and memory-mapped; the
  streamer copies each unit through two small pinned staging buffers. The clean file pages are
  page cache: the kernel keeps what fits and reads the rest back from the disk, so the pace of a
  pass is at worst min(disk read, PCIe) for what the RAM could not keep.
* ``auto``: :func:`choose`: memory when the whole DiT beside everything else the node holds fits
  :data:`HOST_FILL` of the RAM available (the share above which ``memory.host`` warns), else the
  page cache.

The plan (``preflight``) calls :func:`choose` with its estimate (the DiT's host bytes, the node's
other host bytes, MemAvailable before the run); the rank (``loading.components``) with what it
measures once the node's ranks have loaded their encoders (MemAvailable then, read by each node's
local rank 0, and the encoders' bytes still to come), every rank of the group taking the same
answer. Imports nothing heavy.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from wan_s2v_runner.shared import cache_dirs
from wan_s2v_runner.shared.layout import StreamSource

GiB = 2**30
#: the share of the available RAM a streamed DiT held in memory may bring the node to (the
#: threshold above which ``memory.host`` warns: ``preflight.checks_memory.HOST_WARN``)
HOST_FILL = 0.85
#: staging buffers a rank streaming from the page cache pins, each the size of the largest unit
STAGING_SLOTS = 2
#: the DiT cache directory's own environment variable (``shared.cache_dirs``: else the caches' root)
CACHE_ENV = cache_dirs.DIT_ENV


def cache_dir(env: Optional[Mapping[str, str]] = None, setting=None) -> Path:
    """Where the page cache's DiT files go, by ``env`` (this process's, or a recorded machine's)
    and ``setting`` (the spec's ``cache_dir``): ``shared.cache_dirs``' one rule,
    ``$WAN_S2V_DIT_CACHE_DIR`` when set, else the caches' root (``--cache-dir``,
    ``$WAN_S2V_CACHE_DIR``, ``$XDG_CACHE_HOME/wan-s2v``, ``$HOME/.cache/wan-s2v``; ``~`` where a
    recorded machine's home is unknown) ``/dit``, beside inductor's cache: per user and node, on a
    local disk as a rule (what is read back)."""
    return cache_dirs.dit_dir(setting, env)


def staging_bytes(slot_bytes: int) -> int:
    """Host bytes one rank streaming from the page cache pins: :data:`STAGING_SLOTS` buffers of
    the largest streamed unit."""
    return STAGING_SLOTS * max(0, int(slot_bytes))


def choose(dit_bytes: int, encoder_bytes: int, available: Optional[int], local_ranks: int = 1,
           slot_bytes: int = 0) -> tuple[StreamSource, str]:
    """(where, why) for ``--dit-stream-from auto``.

    ``dit_bytes``: the streamed DiT's host bytes (the packed buffer: bf16, or fp8's bytes), held
    once per node whatever its ``local_ranks`` (node-shared); ``encoder_bytes``: everything else the
    node holds on the host beside it (the encoders, their encodes, the ranks' runtimes: what is not
    already counted in ``available``); ``available``: the host's available RAM (MemAvailable; None:
    unknown); ``slot_bytes``: the largest streamed unit (the page cache's staging:
    ``local_ranks`` x :func:`staging_bytes`).

    Memory when ``dit_bytes + encoder_bytes <= HOST_FILL * available``, else the page cache (its
    host need: ``encoder_bytes`` + the staging; the DiT's pages are the kernel's to keep or drop)."""
    if available is None:
        return StreamSource.MEMORY, "memory: the host's available RAM is unknown (as without the page cache)"
    need = int(dit_bytes) + int(encoder_bytes)
    limit = HOST_FILL * int(available)
    held = f"the DiT's {dit_bytes / GiB:.1f} GiB held whole beside {encoder_bytes / GiB:.1f} GiB"
    if need <= limit:
        return StreamSource.MEMORY, (f"memory: {held} fits {HOST_FILL:.0%} of the {available / GiB:.1f} GiB "
                                     "of RAM available")
    staging = max(1, int(local_ranks)) * staging_bytes(slot_bytes)
    rest = int(encoder_bytes) + staging
    why = (f"page-cache: {held} would exceed {HOST_FILL:.0%} of the {available / GiB:.1f} GiB of RAM available; "
           f"the page cache keeps what fits, the host holds {rest / GiB:.1f} GiB "
           f"({max(1, int(local_ranks))} rank(s)' staging included)")
    if rest > limit:
        why += " (tight even so)"
    return StreamSource.PAGE_CACHE, why
