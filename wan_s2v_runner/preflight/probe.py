"""The one hardware/software probe: every machine fact the checks use, as one JSON document.

``probe_machine()`` collects: Python, torch (version, CUDA/NCCL/cuDNN build, arch list), the
driver (NVML if ``pynvml`` imports), each visible GPU (name, compute capability, total/free
memory), the GPU-pair matrices (``p2p`` from ``torch.cuda.can_device_access_peer``, ``links`` in
``nvidia-smi topo -m`` notation from NVML: ``NV<n>``/``PIX``/``PXB``/``PHB``/``NODE``/``SYS``),
host RAM (``/proc/meminfo`` and the cgroup limit), ``/dev/shm``, container detection, package
versions (``importlib.metadata``, no imports), the venv check's verdict (``venv``: whether every
module the engine and the runner import loads; :mod:`wan_s2v_runner.loading.venv_check`),
flash-attn usability and the relevant environment variables. Checks read only these facts, so
they run the same on recorded facts of real machines (``tests/data/machines/*.json``). The
document's schema and its reader, :class:`MachineFacts`, are in :mod:`.facts`; this module only
collects. flash-attn availability is measured by
:func:`wan_s2v_runner.shared.attention_backends.measure_availability`, the same function the
attention patch uses at run time.

A CPU-only torch build (no CUDA, ROCm or XPU in its ``torch/version.py``) is read from its files,
not imported (``torch.source`` says which): the launcher's checks then import no torch and take a
fraction of a second, which is why ``wan-s2v run`` checks before it spawns a node agent there
(:func:`probes_quickly`); whether such a build has torch.distributed and gloo is then ``None``.

Where CUDA may be present the probe runs in a child process (``python -m
wan_s2v_runner.preflight.probe``): measuring free memory and smoke-testing flash-attn create CUDA
contexts, which must not stay alive in the launcher for the whole run.
"""
from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from wan_s2v_runner.loading import venv_check
from wan_s2v_runner.shared.attention_backends import choose_backend, measure_availability

from .facts import SCHEMA, MachineFacts, MiB

#: distributions whose versions the checks use (name as on PyPI)
PACKAGES = ("torch", "torchvision", "transformers", "diffusers", "huggingface-hub", "accelerate",
            "peft", "librosa", "decord", "safetensors", "tokenizers", "einops", "easydict", "ftfy",
            "regex", "imageio", "imageio-ffmpeg", "opencv-python-headless", "opencv-python",
            "soundfile", "pillow", "numpy", "scipy", "tqdm", "flash-attn", "flash_attn_3",
            "xfuser", "yunchang", "wan22", "nvidia-ml-py", "pydantic", "rich")
#: import names the engine needs at `import wan` (find_spec only, nothing is imported)
MODULES = ("torchvision", "transformers", "diffusers", "huggingface_hub", "accelerate", "peft",
           "librosa", "decord", "safetensors", "tokenizers", "einops", "easydict", "ftfy", "regex",
           "imageio", "imageio_ffmpeg", "cv2", "soundfile", "PIL", "scipy", "tqdm", "flash_attn",
           "flash_attn_interface", "pynvml")
_ENV_RE = re.compile(r"^(NCCL_|TORCH_NCCL_|TORCH_DISTRIBUTED|PYTORCH_.*ALLOC_CONF$|CUDA_VISIBLE_DEVICES$|"
                     r"CUDA_DEVICE_ORDER$|OMP_NUM_THREADS$|MASTER_ADDR$|MASTER_PORT$|WORLD_SIZE$|RANK$|"
                     r"LOCAL_RANK$|GLOO_SOCKET_IFNAME$|WAN_REPO$|SLURM_STEP_NUM_(NODES|TASKS)$|SLURM_STEP_NODELIST$|"
                     r"SLURMD_NODENAME$|SLURM_NODEID$)")
_TOPO = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


# --------------------------------------------------------------------------- collection
def _read_meminfo() -> dict:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def _cgroup_memory() -> tuple[Optional[int], Optional[int]]:
    """(limit, usage) in bytes of this process's memory cgroup; None when unlimited/unknown."""
    candidates = [("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                   "/sys/fs/cgroup/memory/memory.usage_in_bytes")]
    for lim_p, use_p in candidates:
        try:
            raw = Path(lim_p).read_text().strip()
        except OSError:
            continue
        limit = None if raw == "max" or not raw.isdigit() or int(raw) >= 2**60 else int(raw)
        try:
            usage = int(Path(use_p).read_text().strip())
        except (OSError, ValueError):
            usage = None
        return limit, usage
    return None, None


def _in_container() -> bool:
    if Path("/.dockerenv").exists() or Path("/run/.containerenv").exists():
        return True
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True
    try:
        text = Path("/proc/1/cgroup").read_text()
    except OSError:
        return False
    return any(w in text for w in ("docker", "kubepods", "containerd", "lxc", "libpod"))


def _host() -> dict:
    mi = _read_meminfo()
    limit, usage = _cgroup_memory()
    try:
        st = os.statvfs("/dev/shm")
        shm_total, shm_free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    except OSError:
        shm_total = shm_free = None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count()

    def mib(v):
        return None if v is None else int(v // MiB)

    return {"cpus": cpus, "mem_total_mib": mib(mi.get("MemTotal")),
            "mem_available_mib": mib(mi.get("MemAvailable")),
            "cgroup_limit_mib": mib(limit), "cgroup_usage_mib": mib(usage),
            "shm_total_mib": mib(shm_total), "shm_free_mib": mib(shm_free),
            "container": _in_container(), "memlock_limit_mib": _memlock_mib()}


def filesystem(path) -> Optional[dict]:
    """The filesystem that holds ``path`` (its nearest existing ancestor, as a path to be created
    would land there): ``path`` (its mount point), ``free_mib`` (what an unprivileged process may
    still write) and ``total_mib``; None when nothing of it can be read. What ``disks`` records,
    and what the disk check measures on a live machine."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st, dev = os.statvfs(p), p.stat().st_dev
    except OSError:
        return None
    mount = p
    while mount != mount.parent:
        try:
            if mount.parent.stat().st_dev != dev:
                break
        except OSError:
            break
        mount = mount.parent
    return {"path": str(mount), "free_mib": round(st.f_bavail * st.f_frsize / MiB, 3),  # KiB: a small disk too
            "total_mib": int(st.f_blocks * st.f_frsize // MiB)}


def _memlock_mib() -> Optional[int]:
    """RLIMIT_MEMLOCK's soft limit (None: unlimited or unknown). CUDA's pinning (cudaHostRegister,
    pinned allocations) is not charged to it; what pins memory with mlock is."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, ValueError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft // MiB)


def _versions() -> tuple[dict, dict]:
    pk = {}
    for name in PACKAGES:
        try:
            pk[name] = md.version(name)
        except md.PackageNotFoundError:
            pk[name] = None
    mods = {}
    for name in MODULES:
        try:
            mods[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            mods[name] = False
    return pk, mods


def _compile_tools() -> dict:
    """What ``--compile`` needs: the C++ compiler inductor calls on CPU ($CXX, else g++), and on
    CUDA the Triton installed against the one this torch was built with (its wheel's pin)."""
    name = os.environ.get("CXX") or "g++"
    required = None
    for req in md.requires("torch") or []:
        m = re.match(r"^(pytorch-triton|triton)\s*==\s*([^;\s]+)", req)
        if m:
            required = m[2]
    installed = None
    for dist in ("triton", "pytorch-triton"):
        try:
            installed = md.version(dist)
            break
        except md.PackageNotFoundError:
            pass
    return {"cxx_name": name, "cxx": shutil.which(name), "triton": installed, "triton_required": required}


def _dep_conflicts(installed: dict) -> list[str]:
    """Declared requirements (Requires-Dist) of the engine's key deps that installed versions
    violate, e.g. 'transformers 4.56.1 requires huggingface-hub<1.0,>=0.34.0 (installed 1.3.2)'."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    canon = {canonicalize_name(k): v for k, v in installed.items()}
    out = []
    for dist in ("diffusers", "transformers", "accelerate", "peft", "huggingface-hub", "torchvision",
                 "librosa", "tokenizers"):
        if not canon.get(canonicalize_name(dist)):
            continue
        for line in md.requires(dist) or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None:
                try:
                    if not req.marker.evaluate({"extra": ""}):
                        continue
                except Exception:  # noqa: BLE001
                    continue
            have = canon.get(canonicalize_name(req.name))
            if not have or not req.specifier:
                continue
            try:
                if Version(have) not in req.specifier.__class__(str(req.specifier), prereleases=True):
                    out.append(f"{dist} {canon[canonicalize_name(dist)]} requires {req.name}{req.specifier} "
                               f"(installed {have})")
            except InvalidVersion:
                continue
    return out


def _nccl_version(torch) -> Optional[str]:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        return None
    if isinstance(v, tuple):
        return ".".join(str(x) for x in v)
    if isinstance(v, int):  # old torch: 2708 -> 2.7.8, 21903 -> 2.19.3
        return (
            f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v % 1000 // 100}.{v % 100}"
        )
    return str(v)


def _nvml(gpus: list[dict]) -> tuple[dict, Optional[list]]:
    """Driver info, per-GPU free memory (no CUDA context) and the link matrix, via NVML."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVML is optional
        return {"nvml": False}, None
    drv: dict[str, Any] = {"nvml": True}
    try:
        v = pynvml.nvmlSystemGetDriverVersion()
        drv["version"] = v.decode() if isinstance(v, bytes) else v
        cv = pynvml.nvmlSystemGetCudaDriverVersion()
        drv["cuda"] = f"{cv // 1000}.{cv % 1000 // 10}"
    except Exception:  # noqa: BLE001
        pass
    handles = []
    for g in gpus:
        h = None
        for key in ("uuid", "pci_bus_id"):
            try:
                if key == "uuid" and g.get("uuid"):
                    u = g["uuid"]
                    h = pynvml.nvmlDeviceGetHandleByUUID(u if u.startswith("GPU-") else "GPU-" + u)
                elif key == "pci_bus_id" and g.get("pci_bus_id"):
                    h = pynvml.nvmlDeviceGetHandleByPciBusId(g["pci_bus_id"])
            except Exception:  # noqa: BLE001
                h = None
            if h is not None:
                break
        handles.append(h)
        if h is not None:
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                g["free_mib"], g["total_mib"] = int(mem.free // MiB), int(mem.total // MiB)
                g["free_source"] = "nvml"
            except Exception:  # noqa: BLE001
                pass
            try:  # the link the streamed DiT's copies take (the most this device and slot negotiate)
                g["pcie_gen"] = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h))
                g["pcie_width"] = int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))
            except Exception:  # noqa: BLE001
                pass
    links = None
    if handles and all(h is not None for h in handles):
        n = len(handles)
        links = [["X" if i == j else "?" for j in range(n)] for i in range(n)]
        nv_idx = getattr(pynvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                try:
                    if pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], nv_idx) == 0:
                        count = 0
                        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                            try:
                                count += int(pynvml.nvmlDeviceGetNvLinkState(handles[i], link) == 1)
                            except Exception:  # noqa: BLE001
                                break
                        links[i][j] = f"NV{count}" if count else "NV"
                        continue
                except Exception:  # noqa: BLE001
                    pass
                try:
                    lvl = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                    links[i][j] = _TOPO.get(int(lvl), "?")
                except Exception:  # noqa: BLE001
                    pass
    try:
        pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001
        pass
    return drv, links


def _attention(gpus: list[dict], cuda: bool) -> dict:
    """flash-attn 3/4/2 availability records (measured like the run measures them) and what
    ``--attention auto`` picks on the lowest-capability visible GPU."""
    device = "cuda" if cuda else "cpu"
    out: dict[str, Any] = measure_availability(device)
    cc = min((tuple(g["capability"]) for g in gpus if g.get("capability")), default=None)
    backend, reason = choose_backend("auto", device, out, cc)
    out["auto"] = {"backend": backend, "reason": reason}
    return out


@functools.lru_cache(maxsize=None)
def torch_build() -> Optional[dict]:
    """torch's build as its installed ``torch/version.py`` states it (``__version__``, ``cuda``,
    ``hip``, ``xpu``), read without importing torch (that costs a second of CPU and runs torch's
    native start-up); None when torch is not installed or the file does not read. Read once per
    process (the launch order, the GPU question and the facts all ask)."""
    try:
        spec = importlib.util.find_spec("torch")  # finds the package, runs none of it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    try:
        loaded = importlib.util.spec_from_file_location("_wan_s2v_torch_version", path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)  # assignments and ``from typing import Optional``
    except Exception:  # noqa: BLE001 - an unreadable build falls back to importing torch
        return None
    return {k: getattr(module, k, None) for k in ("__version__", "cuda", "hip", "xpu")}


def _cpu_only(build: Optional[dict]) -> bool:
    """A build that can use no GPU whatever the machine holds (no CUDA, ROCm or XPU)."""
    return build is not None and not any(build.get(k) for k in ("cuda", "hip", "xpu"))


def _torch_facts_from_build(build: dict) -> dict:
    """The ``torch`` facts of a CPU-only build without importing it: what importing would report
    (no GPU, no NCCL, no cuDNN), except whether torch.distributed and gloo were built in, which
    only the import tells: None ("not checked here"; official wheels have both, and a rank reports
    a build without them when it starts its process group)."""
    return {"version": build["__version__"], "cuda": None, "hip": build.get("hip"), "cudnn": None, "nccl": None,
            "cuda_available": False, "device_count": 0, "arch_list": [], "distributed": None,
            "nccl_available": False, "gloo_available": None, "source": "files"}


def _torch_facts_imported(facts: dict) -> dict:
    """The ``torch`` facts from torch itself (imported; CUDA touched only if it is available)."""
    import torch
    import torch.distributed as dist

    cuda_build = torch.version.cuda
    cuda = bool(cuda_build) and torch.cuda.is_available()
    t: dict[str, Any] = {
        "version": torch.__version__, "cuda": cuda_build, "hip": getattr(torch.version, "hip", None),
        "cudnn": None, "nccl": _nccl_version(torch) if cuda_build else None,
        "cuda_available": cuda, "device_count": torch.cuda.device_count() if cuda else 0,
        "arch_list": [], "distributed": dist.is_available(),
        "nccl_available": bool(dist.is_available() and dist.is_nccl_available()),
        "gloo_available": bool(dist.is_available() and dist.is_gloo_available()), "source": "import",
    }
    try:
        t["cudnn"] = torch.backends.cudnn.version() if cuda_build else None
        t["arch_list"] = torch.cuda.get_arch_list() if cuda_build else []
    except Exception as e:  # noqa: BLE001
        facts["probe_errors"].append(f"torch build info: {e}")
    return t


def _gpus(count: int, errors: list[str]) -> tuple[list[dict], dict, Optional[list]]:
    """(each visible CUDA GPU's record, the driver's record, the NVML link matrix or None)."""
    if not count:
        return [], {"nvml": False}, None
    import torch

    gpus: list[dict] = []
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        g = {"index": i, "name": p.name, "capability": [p.major, p.minor],
             "total_mib": int(p.total_memory // MiB), "free_mib": None,
             "multiprocessors": p.multi_processor_count, "uuid": str(getattr(p, "uuid", "") or "") or None}
        dom, bus, dev = (getattr(p, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
        if bus is not None:
            g["pci_bus_id"] = f"{dom or 0:08x}:{bus:02x}:{dev or 0:02x}.0"
        gpus.append(g)
    drv, links = _nvml(gpus)
    for g in gpus:
        if g.get("free_mib") is None:
            try:
                free, total = torch.cuda.mem_get_info(g["index"])
                g["free_mib"], g["total_mib"], g["free_source"] = int(free // MiB), int(total // MiB), "cuda"
            except Exception as e:  # noqa: BLE001
                errors.append(f"free memory of GPU {g['index']}: {e}")
    return gpus, drv, links


def collect() -> dict:
    """Probe this process's machine. Imports torch only where its build could use a GPU (a CPU-only
    build is read from its files: :func:`torch_build`, unless torch is imported already); touches
    CUDA only if it is available."""
    facts: dict[str, Any] = {
        "schema": SCHEMA, "live": True, "label": f"this machine ({socket.gethostname()})",
        "recorded_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(), "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(), "python": platform.python_version(), "probe_errors": [],
    }
    build = None if "torch" in sys.modules else torch_build()
    t = _torch_facts_from_build(build) if _cpu_only(build) else _torch_facts_imported(facts)
    cuda = t["cuda_available"]
    facts["torch"] = t
    gpus, drv, links = _gpus(t["device_count"], facts["probe_errors"])
    facts["driver"] = drv
    facts["gpus"] = gpus
    n = len(gpus)
    facts["p2p"] = _peer_access(n)
    facts["links"] = links if links is not None else ([["X" if i == j else "?" for j in range(n)]
                                                       for i in range(n)] if n else [])
    facts["host"] = _host()
    # the working directory's filesystem: where outputs/ and runs/ go unless told otherwise
    facts["disks"] = [d for d in (filesystem(Path.cwd()),) if d is not None]
    facts["packages"], facts["modules"] = _versions()
    try:
        facts["dep_conflicts"] = _dep_conflicts(facts["packages"])
    except Exception as e:  # noqa: BLE001
        facts["probe_errors"].append(f"dependency metadata: {e}")
    try:  # the venv check's verdict: kept in the venv, re-checked in a child when the packages changed
        facts["venv"] = venv_check.cached_verdict()
    except Exception as e:  # noqa: BLE001
        facts["probe_errors"].append(f"venv check: {e}")
    try:
        facts["compile"] = _compile_tools()
    except Exception as e:  # noqa: BLE001
        facts["probe_errors"].append(f"compile tools: {e}")
    try:
        facts["attention"] = _attention(gpus, cuda)
    except Exception as e:  # noqa: BLE001
        facts["probe_errors"].append(f"attention: {e}")
        facts["attention"] = {}
    facts["env"] = {k: v for k, v in sorted(os.environ.items()) if _ENV_RE.match(k)}
    return facts


def _peer_access(n: int) -> list[list[bool]]:
    if not n:
        return []
    import torch

    return [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]


def _cuda_may_be_present() -> bool:
    if "torch" in sys.modules:
        t = sys.modules["torch"]
        if not t.version.cuda:
            return False
    elif _cpu_only(torch_build()):
        return False
    return any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"))


def probes_gpus() -> bool:
    """Whether :func:`probe_machine` will measure GPUs here (in a child process: seconds of torch,
    CUDA and flash-attn calls); False where no CUDA can be present (a CPU-only torch build, or no
    NVIDIA device)."""
    return _cuda_may_be_present()


def probes_quickly() -> bool:
    """Whether :func:`probe_machine` takes a fraction of a second here: it measures no GPU and
    imports no torch (a CPU-only build read from its files, or torch imported already). Elsewhere
    (a GPU to measure, or a CUDA/ROCm build on a host without one: importing it takes seconds)
    ``wan-s2v run`` spawns its agent before the checks, so the agent's imports overlap them."""
    return not probes_gpus() and ("torch" in sys.modules or _cpu_only(torch_build()))


_CACHE: Optional[MachineFacts] = None
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def probe_machine(in_subprocess: Optional[bool] = None, refresh: bool = False) -> MachineFacts:
    """Facts of this machine (cached per process). ``in_subprocess`` None = only if CUDA may be
    present (so no CUDA context stays in this process)."""
    global _CACHE
    if _CACHE is not None and not refresh:
        return _CACHE
    sub = _cuda_may_be_present() if in_subprocess is None else in_subprocess
    facts = None
    if sub:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PROJECT_ROOT), env.get("PYTHONPATH")]))
        try:
            proc = subprocess.run([sys.executable, "-m", "wan_s2v_runner.preflight.probe"],
                                  capture_output=True, text=True, timeout=180, env=env,
                                  cwd=str(_PROJECT_ROOT))
            if proc.returncode == 0:
                facts = json.loads(proc.stdout)
            else:
                err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                facts = collect()
                facts["probe_errors"].append(f"probe subprocess failed (exit {proc.returncode}): {err}")
        except (subprocess.TimeoutExpired, ValueError) as e:
            facts = collect()
            facts["probe_errors"].append(f"probe subprocess failed: {e}")
    else:
        facts = collect()
    _CACHE = MachineFacts(facts)
    return _CACHE


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m wan_s2v_runner.preflight.probe [--label TEXT] [--out FILE]``: print/save facts."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--label")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    facts = collect()
    if a.label:
        facts["label"] = a.label
    text = json.dumps(facts, indent=2)
    if a.out:
        a.out.write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
