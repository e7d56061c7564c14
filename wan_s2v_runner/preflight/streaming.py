"""What streaming the DiT (``--dit-offload blocks``) costs in time on a machine: the seconds its
copies take per DiT pass over the GPU's PCIe link, against the seconds the pass computes. The
copies overlap the compute (``loading.block_stream``), so the step runs at the pace of the larger.

* The link: each GPU's PCIe generation and width from the probe (NVML's most the device and its
  slot can negotiate); unknown -> PCIe 4.0 x16 (a desktop's first slot), said so. Pinned copies
  reach :data:`PCIE_EFFICIENCY` of the link's rate (measured: 55.0 GB/s on an H200's PCIe 5.0 x16,
  63.0 GB/s in theory; docs/gpu.md).
* The compute: the pass's operations (:mod:`.dit_flops`, per rank: a Ulysses rank computes its
  share) at :data:`ASSUMED_MFU` of the GPU's dense bf16 peak (spec sheets, by name; unknown GPU ->
  no estimate).

Measured against it on an H200 (docs/gpu.md): a 1024x704 fp8 step streamed every block in 0.99x
the resident step's time (15.4 GiB copied per pass in ~0.3 s, against ~10 s of compute).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .dit_flops import DitDims, forward_flops

#: GB/s per lane of each PCIe generation (after encoding)
PCIE_GBPS_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
PCIE_EFFICIENCY = 0.87
ASSUMED_LINK = (4, 16)
#: the share of the dense bf16 peak the step reaches (measured 46-48% on an H100 and an H200)
ASSUMED_MFU = 0.45
#: dense bf16 tensor TFLOP/s with fp32 accumulation (spec sheets), by device-name substring, first match
DENSE_BF16_TFLOPS = (("H200", 989.4), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.4),
                     ("GH200", 989.4), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("L40", 181.0),
                     ("RTX 6000 Ada", 364.2), ("A6000", 154.8), ("RTX 5090", 209.5), ("RTX 5080", 112.6),
                     ("RTX 4090", 165.2), ("RTX 4080", 97.5), ("RTX 4070 Ti", 80.2), ("RTX 4060 Ti", 44.1),
                     ("RTX 3090", 71.0), ("RTX 3080", 59.5), ("A10G", 70.0), ("L4", 121.0), ("V100", 125.0))


@dataclass(frozen=True)
class StreamTiming:
    copy_s: float  # per pass, per rank
    compute_s: Optional[float]  # per pass, per rank (None: the GPU's peak is unknown)
    link: str  # e.g. "PCIe 4.0 x16 (~27.4 GB/s pinned)"

    @property
    def hidden(self) -> Optional[bool]:
        """Whether the copies fit under the compute (None: unknown)."""
        return None if self.compute_s is None else self.copy_s <= self.compute_s

    def describe(self) -> str:
        if self.copy_s == 0:
            return f"nothing copied per pass (the streamed blocks stay in their slots); {self.link}"
        pace = ("the compute's pace" if self.hidden else "the copies' pace") if self.hidden is not None else "?"
        compute = f"{self.compute_s:.1f} s" if self.compute_s is not None else "unknown (GPU not in the table)"
        return (f"copies {self.copy_s:.2f} s per pass over {self.link} against ~{compute} of compute: the step "
                f"runs at {pace}")


def link_gbps(gpu: dict) -> tuple[float, str]:
    """(GB/s a pinned copy reaches, description) of ``gpu``'s link (facts ``pcie_gen``/``pcie_width``)."""
    gen, width = gpu.get("pcie_gen"), gpu.get("pcie_width")
    assumed = not (gen and width)
    if assumed:
        gen, width = ASSUMED_LINK
    rate = PCIE_GBPS_PER_LANE.get(int(gen), PCIE_GBPS_PER_LANE[4]) * int(width) * PCIE_EFFICIENCY
    return rate, f"PCIe {gen}.0 x{width}{' (assumed)' if assumed else ''}, ~{rate:.1f} GB/s pinned"


def gpu_tflops(name: str) -> Optional[float]:
    return next((t for needle, t in DENSE_BF16_TFLOPS if needle in (name or "")), None)


def timing(gpu: dict, bytes_per_pass: int, dims: DitDims, tokens, sp_degree: int) -> StreamTiming:
    """The copies against the compute of one DiT pass on ``gpu`` (a rank's share of ``tokens``)."""
    rate, link = link_gbps(gpu)
    peak = gpu_tflops(gpu.get("name", ""))
    compute = None
    if peak:
        flops = forward_flops(dims, tokens, with_motion=True, text_cached=True).total / max(1, sp_degree)
        compute = flops / (peak * 1e12 * ASSUMED_MFU)
    return StreamTiming(bytes_per_pass / (rate * 1e9), compute, link)
