"""What streaming the DiT (``--dit-offload blocks``) costs in time on a machine: the seconds its
copies take per DiT pass, against the seconds the pass computes. The copies overlap the compute
(``loading.block_stream``), so the step runs at the pace of the larger.

* The link: each GPU's PCIe generation and width from the probe (NVML's most the device and its
  slot can negotiate); unknown -> PCIe 4.0 x16 (a desktop's first slot), said so. Pinned copies
  reach :data:`PCIE_EFFICIENCY` of the link's rate (measured: 55.0 GB/s on an H200's PCIe 5.0 x16,
  63.0 GB/s in theory; docs/gpu.md).
* The disk (``--dit-stream-from page-cache``, :mod:`wan_s2v_runner.shared.stream_source`): when the
  page cache cannot keep the whole DiT file, a pass reads it from the disk again (a cyclic scan
  larger than the cache misses throughout), so its copies go at min(disk read, PCIe). The disk's
  sequential read is the facts' ``host.disk_read_mib_s``; unknown -> :data:`ASSUMED_DISK_MIB_S`
  (a PCIe 3.0 NVMe drive), said so.
* The compute: the pass's operations (:mod:`.dit_flops`, per rank: a Ulysses rank computes its
  share) at :data:`~wan_s2v_runner.shared.dit_cost.ASSUMED_MFU` of the GPU's dense peak
  (``shared.dit_cost.pass_seconds``, the one rule) **in the run's compute dtype**
  (``shared.precision``: bf16, fp16 below cc 8.0, fp32) from spec sheets, by name
  (:data:`GPU_TFLOPS`; unknown GPU -> no estimate). GPUs older than Ampere have no bf16 units: bf16
  is emulated through fp32 there, at :data:`EMULATED_BF16_SHARE` of the fp32 peak (a V100's cuBLAS:
  ~10 TFLOPS bf16 against ~14 fp32 and ~95-100 fp16; engine-facts "Older GPUs").

Measured against it on an H200 (docs/gpu.md): a 1024x704 fp8 step streamed every block in 0.99x
the resident step's time (15.4 GiB copied per pass in ~0.3 s, against ~10 s of compute).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from wan_s2v_runner.shared.dit_cost import DitDims, pass_seconds
from wan_s2v_runner.shared.precision import ComputeDtype

from .dit_flops import forward_flops

#: GB/s per lane of each PCIe generation (after encoding)
PCIE_GBPS_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
PCIE_EFFICIENCY = 0.87
ASSUMED_LINK = (4, 16)
#: a disk's sequential read when the facts do not say (``host.disk_read_mib_s``): a PCIe 3.0 NVMe
#: drive's (SATA SSDs read ~500, hard disks ~150-250, PCIe 4.0 NVMe ~5000-7000)
ASSUMED_DISK_MIB_S = 2000
#: bf16 emulated through fp32 on a GPU without bf16 units (cc < 8.0), as a share of its fp32 peak
#: (a V100's cuBLAS: ~10 TFLOPS bf16 against ~14 fp32)
EMULATED_BF16_SHARE = 0.7
#: dense TFLOP/s by device-name substring, first match (spec sheets): (bf16 tensor, fp16 tensor,
#: fp32), the tensor rates with fp32 accumulation (what torch's matmuls use; GeForce cards run
#: it at half their fp16-accumulate rate). None: no bf16 units (cc < 8.0; emulated, see above).
GPU_TFLOPS = (
    ("H200", 989.4, 989.4, 67.0), ("H100 NVL", 835.0, 835.0, 60.0), ("H100 PCIe", 756.0, 756.0, 51.2),
    ("H100", 989.4, 989.4, 67.0), ("GH200", 989.4, 989.4, 67.0), ("B200", 2250.0, 2250.0, 80.0),
    ("A100", 312.0, 312.0, 19.5), ("L40S", 362.0, 362.0, 91.6), ("L40", 181.0, 181.0, 90.5),
    ("RTX 6000 Ada", 364.2, 364.2, 91.1), ("A6000", 154.8, 154.8, 38.7), ("RTX 5090", 209.5, 209.5, 104.8),
    ("RTX 5080", 112.6, 112.6, 56.3), ("RTX 4090", 165.2, 165.2, 82.6), ("RTX 4080", 97.5, 97.5, 48.7),
    ("RTX 4070 Ti", 80.2, 80.2, 40.1), ("RTX 4060 Ti", 44.1, 44.1, 22.1), ("RTX 3090", 71.0, 71.0, 35.6),
    ("RTX 3080", 59.5, 59.5, 29.8), ("RTX 3060", 25.6, 25.6, 12.7), ("A10G", 70.0, 70.0, 31.2),
    ("L4", 121.0, 121.0, 30.3),
    # older than Ampere: fp16 tensor cores, no bf16 units
    ("V100S", None, 130.0, 16.4), ("V100", None, 125.0, 15.7), ("T4", None, 65.0, 8.1),
    ("TITAN RTX", None, 130.5, 16.3), ("Quadro RTX 8000", None, 130.5, 16.3),
    ("Quadro RTX 6000", None, 130.5, 16.3), ("RTX 2080 Ti", None, 53.8, 13.4), ("RTX 2080", None, 40.3, 10.1),
    ("RTX 2070", None, 29.9, 7.5), ("RTX 2060", None, 25.8, 6.5),
)


@dataclass(frozen=True)
class StreamTiming:
    copy_s: float  # per pass, per rank
    compute_s: Optional[float]  # per pass, per rank (None: the GPU's peak is unknown)
    link: str  # e.g. "PCIe 4.0 x16 (~27.4 GB/s pinned)"
    #: the page cache: what the pass reads from the disk and from where ("" when nothing is read)
    disk: str = ""

    @property
    def hidden(self) -> Optional[bool]:
        """Whether the copies fit under the compute (None: unknown)."""
        return None if self.compute_s is None else self.copy_s <= self.compute_s

    def describe(self) -> str:
        if self.copy_s == 0:
            return f"nothing copied per pass (the streamed blocks stay in their slots); {self.link}"
        pace = ("the compute's pace" if self.hidden else "the copies' pace") if self.hidden is not None else "?"
        compute = f"{self.compute_s:.1f} s" if self.compute_s is not None else "unknown (GPU not in the table)"
        over = f"{self.link}; {self.disk}" if self.disk else self.link
        return (f"copies {self.copy_s:.2f} s per pass over {over} against ~{compute} of compute: the step "
                f"runs at {pace}")


def link_gbps(gpu: dict) -> tuple[float, str]:
    """(GB/s a pinned copy reaches, description) of ``gpu``'s link (facts ``pcie_gen``/``pcie_width``)."""
    gen, width = gpu.get("pcie_gen"), gpu.get("pcie_width")
    assumed = not (gen and width)
    if assumed:
        gen, width = ASSUMED_LINK
    rate = PCIE_GBPS_PER_LANE.get(int(gen), PCIE_GBPS_PER_LANE[4]) * int(width) * PCIE_EFFICIENCY
    return rate, f"PCIe {gen}.0 x{width}{' (assumed)' if assumed else ''}, ~{rate:.1f} GB/s pinned"


def gpu_tflops(name: str, dtype: ComputeDtype = ComputeDtype.BF16) -> Optional[float]:
    """The dense peak of the GPU named ``name`` in ``dtype`` (resolved: bf16, fp16 or fp32; bf16
    emulated where it has no bf16 units); None when it is not in :data:`GPU_TFLOPS`."""
    row = next((r for r in GPU_TFLOPS if r[0] in (name or "")), None)
    if row is None:
        return None
    _, bf16, fp16, fp32 = row
    dtype = ComputeDtype(dtype)
    if dtype is ComputeDtype.FP16:
        return fp16
    if dtype is ComputeDtype.FP32:
        return fp32
    return bf16 if bf16 is not None else EMULATED_BF16_SHARE * fp32


def disk_mib_s(host: dict) -> tuple[float, str]:
    """(MiB/s, description) of the disk's sequential read (facts ``host.disk_read_mib_s``; unknown ->
    :data:`ASSUMED_DISK_MIB_S`, said so)."""
    known = host.get("disk_read_mib_s")
    rate = float(known or ASSUMED_DISK_MIB_S)
    return rate, f"the disk at ~{rate:.0f} MiB/s{'' if known else ' (assumed: an NVMe drive)'}"


def timing(gpu: dict, bytes_per_pass: int, dims: DitDims, tokens, sp_degree: int,
           dtype: ComputeDtype = ComputeDtype.BF16, disk_bytes: int = 0, host: Optional[dict] = None) -> StreamTiming:
    """The copies against the compute of one DiT pass on ``gpu`` (a rank's share of ``tokens``) in
    ``dtype``; ``disk_bytes`` of the pass read from the disk first (the page cache could not keep
    them: ``host``'s disk, read once for the node's ranks), the copies at the slower of the two."""
    rate, link = link_gbps(gpu)
    peak = gpu_tflops(gpu.get("name", ""), dtype)
    compute = None
    if peak:
        flops = forward_flops(dims, tokens, with_motion=True, text_cached=True).total / max(1, sp_degree)
        compute = pass_seconds(flops, peak)
    copy_s, disk = bytes_per_pass / (rate * 1e9), ""
    if disk_bytes:
        mib_s, what = disk_mib_s(host or {})
        read_s = disk_bytes / (mib_s * 2**20)
        disk = (f"{disk_bytes / 2**30:.1f} GiB a pass read again from {what} ({read_s:.2f} s: the page cache "
                "cannot keep the DiT's file)")
        copy_s = max(copy_s, read_s)
    return StreamTiming(copy_s, compute, link, disk)
