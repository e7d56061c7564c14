"""A bench-only probe (``bench/gpu_pipeline.py --overlap-probe``): every Python process started with
this folder on ``PYTHONPATH`` (the launcher, the doctor, the node agent and so its forked ranks) reads
the DiT while the encoders run on a GPU too, by the CPU's rule (``shared/layout.py``
``dit_load_overlap``), so that a GPU run can measure what the rule would give before the product
turns it on there (docs/gpu.md, "Next"). The plan's reason says the probe was on. Any
``sitecustomize`` this folder shadows is run first."""
import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _shadowed = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_shadowed)

from wan_s2v_runner.shared import layout as _layout  # noqa: E402

_rule = _layout.dit_load_overlap


def _probe(lay, device, load):
    overlap, why = _rule(lay, "cpu", load)
    return overlap, f"{why} [bench/overlap_probe: the CPU's rule on {device}]"


_layout.dit_load_overlap = _probe
