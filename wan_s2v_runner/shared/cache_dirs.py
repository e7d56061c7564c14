"""Where every cache wan-s2v keeps lives: one rule for the plan (``preflight``), the rank
(``loading.dit_cache``, ``patches.compile_blocks``), the demo and ``wan-s2v cache``.

The caches' root, first that is set:

1. the ``cache_dir`` setting (``--cache-dir``, TOML ``cache_dir``, ``$WAN_S2V_CACHE_DIR``: the
   spec's field, :class:`~wan_s2v_runner.shared.spec.GroupSpec`), passed as ``setting``;
2. ``$WAN_S2V_CACHE_DIR`` (a caller without a spec: the rank's environment, a recorded machine's);
3. ``$XDG_CACHE_HOME/wan-s2v`` (the XDG base directory convention);
4. ``$HOME/.cache/wan-s2v``.

Under it, one directory per :class:`CacheKind`. Two kinds keep their own, more specific
variable, which wins over the root: the DiT's page-cache files (``$WAN_S2V_DIT_CACHE_DIR``, as
before) and inductor's compiled kernels (``$TORCHINDUCTOR_CACHE_DIR``, torch's own: a directory
torch may share with other programs, so ``wan-s2v cache clear all`` leaves it alone; see
:func:`owned`).

``env`` is this process's environment unless given (a recorded machine's: its ``HOME`` unknown
reads ``~``). Imports nothing from the project.
"""
from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import Mapping, Optional

#: the root's environment variable (also the ``cache_dir`` setting's)
ROOT_ENV = "WAN_S2V_CACHE_DIR"
#: the DiT page-cache files' own directory (kept from before the root existed)
DIT_ENV = "WAN_S2V_DIT_CACHE_DIR"
#: torch inductor's own cache directory variable
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


class CacheKind(str, Enum):
    """The caches wan-s2v keeps, each a directory under the root (:func:`directory`)."""

    DIT = "dit"  # the streamed DiT's page-cache files (loading.dit_cache): 14-28 GB each at real size
    DEMO = "demo"  # `wan-s2v demo`'s tiny checkpoint and inputs (demo.assets): ~12 MB
    INDUCTOR = "inductor"  # --compile's kernels (torch inductor; shared.inductor)
    TESTS = "tests"  # the test suite's (its inductor cache: tests/conftest.py)
    BENCH = "bench"  # bench/'s checkpoints and inputs (bench/*.py --cache)

    @property
    def what(self) -> str:
        """What a person reads this kind is for."""
        return {CacheKind.DIT: "the streamed DiT's bytes (--dit-stream-from page-cache)",
                CacheKind.DEMO: "wan-s2v demo's tiny checkpoint and inputs",
                CacheKind.INDUCTOR: "--compile's compiled kernels (torch inductor)",
                CacheKind.TESTS: "the test suite's caches",
                CacheKind.BENCH: "bench/'s checkpoints and inputs"}[self]


def _env(env: Optional[Mapping[str, str]]) -> tuple[Mapping[str, str], str]:
    """(the environment, its home): a given (recorded) environment without HOME reads ``~``."""
    if env is None:
        return os.environ, str(Path.home())
    return env, env.get("HOME") or "~"


def root(setting=None, env: Optional[Mapping[str, str]] = None) -> Path:
    """The caches' root (the module's rule): ``setting`` (the spec's ``cache_dir``), else
    ``$WAN_S2V_CACHE_DIR``, else ``$XDG_CACHE_HOME/wan-s2v``, else ``$HOME/.cache/wan-s2v``."""
    if setting:
        return Path(setting).expanduser()
    env, home = _env(env)
    if env.get(ROOT_ENV):
        return Path(env[ROOT_ENV]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path(home) / ".cache")
    return Path(base) / "wan-s2v"


def directory(kind: CacheKind, setting=None, env: Optional[Mapping[str, str]] = None) -> Path:
    """Where ``kind`` lives: its own variable where it has one and it is set, else the root's
    subdirectory of its name."""
    kind = CacheKind(kind)
    own = {CacheKind.DIT: DIT_ENV, CacheKind.INDUCTOR: INDUCTOR_ENV}.get(kind)
    e, _ = _env(env)
    if own and e.get(own):
        return Path(e[own]).expanduser()
    return root(setting, env) / kind.value


def owned(kind: CacheKind, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether wan-s2v owns ``kind``'s directory outright (``clear all`` may empty it): not
    inductor's when ``$TORCHINDUCTOR_CACHE_DIR`` names one (torch's, maybe shared)."""
    e, _ = _env(env)
    return not (CacheKind(kind) is CacheKind.INDUCTOR and e.get(INDUCTOR_ENV))


def dit_dir(setting=None, env: Optional[Mapping[str, str]] = None) -> Path:
    """The DiT page-cache files' directory: ``$WAN_S2V_DIT_CACHE_DIR``, else ROOT/dit."""
    return directory(CacheKind.DIT, setting, env)
