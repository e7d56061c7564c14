"""One fleet, one model: what makes a server's videos the same as every other server's of its
pool, and the shared directory every server of the fleet must really share.

**Identity** (:func:`identity_of`): the weights' fingerprints (each file's sampled digest,
:func:`~wan_s2v_runner.loading.fingerprint.weights_fingerprint`), the checkpoint's file table,
the engine's S2V sources, and every group setting that changes the frames
(:func:`frame_settings`). Not this runner's version: its generation loop equals the engine's to
the bit (the parity contract), so upgrading every server of a fleet keeps its pools; each
record says which version made it. The first server of a pool records it in the queue
(:meth:`~.store.protocol.JobStore.pool_join`); a server whose identity differs is refused with the
difference named (exit code ``fleet-mismatch``), unless it names a pool of its own (``--pool``),
whose jobs only its servers take. One server's own queue (SQLite) may take its pool over with new
weights once no job of the pool waits or runs; a shared one never changes a pool's model.

**The shared directory** (:func:`shared_dir_problem`): the fleet's first server writes a marker
into it naming the fleet and its queue (``.wan-s2v-fleet.json``). A server whose shared directory
is missing, read-only, or lacks the marker while the queue already has a fleet (an empty
directory where the mount should be), or has another fleet's, is refused at start (exit code
``shared-dir``) and, when the check fails later, is not ready and claims nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

from wan_s2v_runner.serve.dirs import ServerDirs
from wan_s2v_runner.serve.store import rules
from wan_s2v_runner.serve.store.protocol import Joined
from wan_s2v_runner.shared import atomic, precision
from wan_s2v_runner.shared.layout import MODES, Recipe
from wan_s2v_runner.shared.quant import Fp8Matmul
from wan_s2v_runner.shared.spec import GroupSpec

#: the words for each part of an identity (a refusal names what differs)
PARTS = {"weights": "weights", "checkpoint": "checkpoint files", "engine": "Wan2.2 engine (its S2V sources)",
         "settings": "frame-deciding settings"}


def frame_settings(group: GroupSpec) -> dict[str, Any]:
    """The group settings that change the frames: the recipe (a live group's causal blocks are
    another video than the clips of the same weights, on every device), the device and its dtype,
    the attention kernel, the LoRAs (their files' contents and strengths), fp8 weights, compiled
    blocks (float rounding); on a GPU the layout too (bf16 collectives and kernels are not proven
    to give one rank's bits in every layout; on the CPU every layout of one recipe does, exactly:
    docs/parallelism.md)."""
    from wan_s2v_runner.shared.media import sha256_file

    out: dict[str, Any] = {"device": group.device, "attention": getattr(group.attention, "value", group.attention),
                           "loras": [[sha256_file(ref.path), ref.strength] for ref in group.lora],
                           "lora_allow_partial": group.lora_allow_partial}
    # added only when not the default: a pool recorded before these settings existed keeps its identity
    recipe = MODES[group.mode].recipe
    if recipe is not Recipe.CLIPS:  # another recipe, not another layout: named whatever the device
        out["recipe"] = recipe.value
    if group.dit_quant.value != "none":
        out["dit_quant"] = group.dit_quant.value
    if group.fp8_matmul is not Fp8Matmul.DEQUANT:
        out["fp8_matmul"] = group.fp8_matmul.value
    if group.compile:
        out["compile"] = True
    if precision.recorded(group.dtype, group.device) is not None:  # the server's settled dtype (a V100's fp16)
        out["dtype"] = precision.recorded(group.dtype, group.device)
    if group.fp32_blocks:
        out["fp32_blocks"] = sorted(group.fp32_blocks)
    if group.device == "cuda":
        layout = group.layout
        out["layout"] = {"mode": group.mode.value, "world_size": group.world_size, "cfg_degree": layout.cfg_degree,
                         "sp_degree": layout.sp_degree, "vae_parallel": layout.vae_parallel}
    return out


def identity_of(group: GroupSpec) -> dict[str, Any]:
    """What a server of ``group`` makes its videos with (see the module's docstring)."""
    from wan_s2v_runner.loading.fingerprint import weights_fingerprint
    from wan_s2v_runner.shared import resume

    return {"weights": weights_fingerprint(group.ckpt_dir, group.dit_file, group.t5_file),
            "checkpoint": resume.checkpoint_digest(group.ckpt_dir, group.dit_file, group.t5_file),
            "engine": resume.engine_digest(group.wan_repo), "settings": frame_settings(group)}


def runner_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("wan-s2v")
    except PackageNotFoundError:
        return "unknown"


def digest_of(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """What differs between two identities, in words (``weights (dit, t5)``, ``settings (attention)``)."""
    out = []
    for key, words in PARTS.items():
        a, b = ours.get(key), theirs.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            inner = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            out.append(f"{words} ({', '.join(inner)})")
        else:
            out.append(words)
    return out or ["identity"]


def mismatch(joined: Joined, identity: dict[str, Any], pool: str) -> str:
    """The one-line refusal of a server whose identity is not its pool's."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(joined.pool.joined_at))
    return (f"this server's {', '.join(differences(identity, joined.pool.identity))} differ from pool {pool!r} of the "
            f"fleet (recorded by {joined.pool.joined_by} at {when}): the same request would give another video. "
            "Fix: start it with the pool's checkpoint and settings, or give it a pool of its own with --pool NAME "
            "(its servers take only the jobs submitted to them)")


def who_am_i(dirs: ServerDirs) -> str:
    return f"{socket.gethostname()}:{dirs.root}"


# --------------------------------------------------------------------------- the shared directory
def writable(path: Path) -> Optional[str]:
    """Why ``path`` cannot be written now (None: it can), asked without writing anything: its
    filesystem mounted read-only, or the directory not writable by this server."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "is read-only (its filesystem is mounted read-only)"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not writable by this server's user"
    return None


def read_marker(dirs: ServerDirs) -> Optional[dict]:
    try:
        return json.loads(dirs.marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_marker(dirs: ServerDirs, fleet_id: str, queue: str) -> None:
    atomic.write_text(dirs.marker, rules.fleet_marker(fleet_id, queue), durable=True)


def shared_dir_problem(dirs: ServerDirs, fleet_id: str, queue: str) -> Optional[str]:
    """Why the shared directory is not the fleet's, usable now (None: it is): missing, not
    writable, or without the fleet's marker (not mounted: an empty directory where the mount
    should be) or with another fleet's. One line: the cause and the fix."""
    root = dirs.shared_root
    flag = "--shared-dir" if dirs.shared else "--server-dir"
    if not root.is_dir():
        return (f"the shared directory {root} is missing. Fix: mount the fleet's shared directory there (the same "
                f"path on every server), or give {flag} the path where it is mounted")
    why = writable(root)
    if why is not None:
        return (f"the shared directory {root} {why}. Fix: mount it read-write for this server (uploads, videos and "
                "clip checkpoints are written there)")
    marker = read_marker(dirs)
    if marker is None:
        return (f"the shared directory {root} has no fleet marker ({dirs.marker.name}) though the queue {queue} has "
                "a fleet: it is not the fleet's directory (not mounted?). Fix: mount the fleet's shared directory at "
                f"{root}")
    if marker.get("fleet") != fleet_id:
        return (f"the shared directory {root} belongs to another fleet (its queue: {marker.get('queue')}), not to "
                f"the queue {queue}. Fix: give {flag} this fleet's shared directory, or --queue that fleet's queue")
    return None


def settle_marker(dirs: ServerDirs, joined: Joined, queue: str, store) -> Optional[str]:
    """At start: the fleet's shared directory marked by its first server (this one, or one that
    joined before and did not get to write it yet), else checked; why not usable (None: it is)."""
    root = dirs.shared_root
    if not joined.marked:
        if not root.is_dir():
            return shared_dir_problem(dirs, joined.fleet_id, queue)
        why = writable(root)
        if why is None and (read_marker(dirs) or {}).get("fleet") not in (None, joined.fleet_id):
            return shared_dir_problem(dirs, joined.fleet_id, queue)
        if why is None:
            write_marker(dirs, joined.fleet_id, queue)
            store.fleet_mark(joined.fleet_id)
    return shared_dir_problem(dirs, joined.fleet_id, queue)
