"""Patch: the engine's sequence-parallel helpers work on the SP group, not the whole world.

Upstream: ``wan/distributed/util.py``'s ``get_rank``, ``get_world_size``, ``all_to_all`` and
``gather_forward`` use the default (WORLD) group, and are imported by name into
``wan.distributed.ulysses`` (``all_to_all``), ``wan.distributed.sequence_parallel`` and
``wan.modules.s2v.model_s2v`` (``get_rank``, ``get_world_size``, ``gather_forward``): Ulysses
can only span every rank.
Change: with CFG-parallel the world is split into two CFG branches, each with its own SP group
(one ``DeviceMesh`` dimension). We rebind those names, in each module that imported them, to
versions bound to the SP group: rank and size within the group, all-to-all and all-gather over
it. Without CFG-parallel the SP group is the world and the patch is not applied.
Proof: tests/test_generation.py (CFG 2 x SP 2 at 4 ranks == 1 process, exactly).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_MARK = "_wan_s2v_sp_group"
_MODULES = ("wan.distributed.util", "wan.distributed.ulysses", "wan.distributed.sequence_parallel",
            "wan.modules.s2v.model_s2v")


def helpers(group) -> dict:
    """The four SP helpers bound to ``group``."""

    def get_rank():
        return dist.get_rank(group)

    def get_world_size():
        return dist.get_world_size(group)

    def all_to_all(x, scatter_dim, gather_dim, group=group, **kwargs):
        world_size = dist.get_world_size(group)
        if world_size > 1:
            inputs = [u.contiguous() for u in x.chunk(world_size, dim=scatter_dim)]
            outputs = [torch.empty_like(u) for u in inputs]
            dist.all_to_all(outputs, inputs, group=group, **kwargs)
            x = torch.cat(outputs, dim=gather_dim).contiguous()
        return x

    def gather_forward(input, dim):
        world_size = dist.get_world_size(group)
        if world_size == 1:
            return input
        output = [torch.empty_like(input) for _ in range(world_size)]
        dist.all_gather(output, input, group=group)
        return torch.cat(output, dim=dim).contiguous()

    fns = {"get_rank": get_rank, "get_world_size": get_world_size, "all_to_all": all_to_all,
           "gather_forward": gather_forward}
    for f in fns.values():
        setattr(f, _MARK, True)
    return fns


def apply(group) -> list[str]:
    """Rebind the helpers in every engine module that imported them. Returns 'module.name's."""
    import importlib
    fns = helpers(group)
    done = []
    for mod_name in _MODULES:
        mod = importlib.import_module(mod_name)
        for name, fn in fns.items():
            if hasattr(mod, name):
                setattr(mod, name, fn)
                done.append(f"{mod_name}.{name}")
    return done
