"""Where ``--compile`` keeps inductor's compiled kernels, and what inductor's build can use: one
place for the launcher (preflight), the ranks (``patches.compile_blocks``) and the docs.

The cache is per user and per node (``~/.cache/wan-s2v/inductor``, or ``$XDG_CACHE_HOME``, or
``$TORCHINDUCTOR_CACHE_DIR`` when set): a node's ranks share it, and a second run or a restarted
server loads the kernels built before instead of compiling them again.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # shared.cache_dirs.INDUCTOR_ENV


def cache_dir(env: Optional[Mapping[str, str]] = None, setting=None) -> Path:
    """``$TORCHINDUCTOR_CACHE_DIR`` when set, else the caches' root (``setting``: the spec's
    ``cache_dir``; ``$WAN_S2V_CACHE_DIR``; ``$XDG_CACHE_HOME/wan-s2v``, ``~/.cache/wan-s2v``)
    ``/inductor``: ``shared.cache_dirs``' one rule."""
    from wan_s2v_runner.shared.cache_dirs import CacheKind, directory
    env = os.environ if env is None else env  # this machine's: its home where env has none
    return directory(CacheKind.INDUCTOR, setting, env if env.get("HOME") else {**env, "HOME": str(Path.home())})


def cpp_build_refuses(path: Path) -> Optional[str]:
    """Why inductor's C++ build (CPU kernels) cannot use ``path`` as its cache, or None: torch
    2.13 joins the compiler's command line as one string and splits it on spaces, so g++ reads
    ``/a/my cache/x.cpp`` as two files (measured: "input file '/a/my' is the same as output file")."""
    if any(c.isspace() for c in str(path)):
        return f"inductor's C++ build cannot use a cache path with spaces ({path})"
    return None
