"""What a post-import engine patch is, as the registry holds it (after torchtitan's model
converters): each patch module declares one :class:`Patch` (``PATCH``): its name, when a run needs
it (``applies``), how it applies and says what it did (``apply`` returns the line recorded in
``run.json``'s ``patches``), and how it is undone (``restore``; None where a run's process applies
it once and never goes back). :func:`patches.registry` lists them in the order they apply
(:data:`patches.REGISTRY_ORDER`), and :func:`patches.apply_for_run` applies those a run needs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class PatchContext:
    """What a patch may read of the run: its spec (a ``RunSpec``), the DiT's parameter dtype, the
    rank's event callbacks (``on_event(stage)`` enters a stage; ``on_event_data(kind, **data)``
    records an informational event), and what the rank's loader gives the patches that need it
    (``merge_loras``: the run's LoRAs merged into a loaded DiT, ``model -> records``:
    ``wan_s2v_runner.loading.lora.merger``; patches import nothing of loading)."""

    spec: Any
    param_dtype: Any
    on_event: Optional[Callable] = None
    on_event_data: Optional[Callable] = None
    merge_loras: Optional[Callable[[Any], list]] = None

    @property
    def on_cpu(self) -> bool:
        return self.spec.device == "cpu"


@dataclass(frozen=True)
class Patch:
    """One named change to the engine (see the module docstring)."""

    name: str
    applies: Callable[[PatchContext], bool]
    apply: Callable[[Any, PatchContext], str]
    restore: Optional[Callable[[Any], Any]] = None


def always(ctx: PatchContext) -> bool:
    """Every run needs it."""
    return True


#: where a patch's wrapper keeps what it replaced (what :func:`unbind` puts back)
ORIGINAL = "__wan_s2v_original__"


def unbind(owner: Any, name: str, mark: str = "__wan_s2v_patched__") -> bool:
    """Undo a patch that rebound ``owner.name`` to a wrapper carrying ``mark``: put back what the
    wrapper keeps as :data:`ORIGINAL`. False if ``owner.name`` is not such a wrapper."""
    current = getattr(owner, name)
    if not getattr(current, mark, False):
        return False
    setattr(owner, name, getattr(current, ORIGINAL))
    return True
