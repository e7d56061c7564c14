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

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_dir(env: Optional[Mapping[str, str]] = None) -> Path:
    """``$TORCHINDUCTOR_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/wan-s2v/inductor``
    (``~/.cache/wan-s2v/inductor``)."""
    env = os.environ if env is None else env
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wan-s2v" / "inductor"


def cpp_build_refuses(path: Path) -> Optional[str]:
    """Why inductor's C++ build (CPU kernels) cannot use ``path`` as its cache, or None: torch
    2.13 joins the compiler's command line as one string and splits it on spaces, so g++ reads
    ``/a/my cache/x.cpp`` as two files (measured: "input file '/a/my' is the same as output file")."""
    if any(c.isspace() for c in str(path)):
        return f"inductor's C++ build cannot use a cache path with spaces ({path})"
    return None
