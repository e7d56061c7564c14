"""The engine patches that have no end-to-end test of their own: the two pre-import patches
(fresh processes, since they act on import) and the CPU device proxy."""
from __future__ import annotations

import subprocess
import sys

import torch

from conftest import ROOT, cpu_torch_only


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@cpu_torch_only
def test_cuda_torchvision_imports_only_with_the_schema_patch():
    assert torch.version.cuda is None  # the pinned CPU torch, with the CUDA torchvision build
    bare = _py("import torchvision")
    assert bare.returncode != 0 and "torchvision::nms does not exist" in bare.stderr
    patched = _py(
        "from patches import torchvision_cpu\n"
        "assert torchvision_cpu.apply() is True and torchvision_cpu.apply() is False\n"
        "import torch, torchvision.transforms as T\n"
        "x = T.CenterCrop(4)(T.Resize(6)(torch.rand(3, 8, 10)))\n"
        "assert tuple(x.shape) == (3, 4, 4)\n")
    assert patched.returncode == 0, patched.stderr


@cpu_torch_only
def test_wan_imports_on_cpu_and_current_device_is_restored():
    bare = _py("from patches import torchvision_cpu; torchvision_cpu.apply(); import wan")
    assert bare.returncode != 0  # t5.py's import-time torch.cuda.current_device()
    patched = _py(
        "import torch\n"
        "orig = torch.cuda.current_device\n"
        "from wan_s2v_runner.engine import import_wan\n"
        "wan = import_wan()\n"
        "assert hasattr(wan, 'WanS2V')\n"
        "assert torch.cuda.current_device is orig\n")
    assert patched.returncode == 0, patched.stderr


@cpu_torch_only
def test_cpu_device_proxy_maps_cuda_calls_and_leaves_torch_alone():
    from patches import cpu_device
    from wan_s2v_runner.engine import import_wan

    wan = import_wan()
    s2v = wan.speech2video
    try:
        assert cpu_device.apply(wan) is True and cpu_device.apply(wan) is False
        t = s2v.torch
        assert t.device("cuda:0") == torch.device("cpu") and t.device("cpu").type == "cpu"
        assert torch.device("cuda:0").type == "cuda"  # real torch untouched
        t.cuda.empty_cache()
        t.cuda.synchronize()
        with t.amp.autocast("cuda", dtype=torch.bfloat16):
            y = torch.ones(2, 2) @ torch.ones(2, 2)
        assert y.dtype == torch.float32  # no autocast happened
        g = t.Generator(device=t.device("cuda:0"))
        assert t.randn(3, generator=g.manual_seed(1)).shape == (3,)  # everything else is torch's
    finally:
        s2v.torch = torch
