"""Group ``communication``: process-group backend, NCCL, GPU topology (NVLink/P2P vs PCIe for
Ulysses all-to-all), environment variables (deprecated NCCL names, P2P/IB switches, allocator
config), ``/dev/shm``, the rendezvous port (bind test) and address (DNS).
"""
from __future__ import annotations

import errno
import socket

from .core import fail, ok, skip, warn

#: deprecated name -> replacement (torch's ProcessGroupNCCL reads both and warns on the old one)
DEPRECATED_ENV = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "NCCL_ENABLE_MONITORING": "TORCH_NCCL_ENABLE_MONITORING",
    "NCCL_HEARTBEAT_TIMEOUT_SEC": "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "NCCL_TRACE_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "NCCL_DUMP_ON_TIMEOUT": "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "ENABLE_NCCL_HEALTH_CHECK": "TORCH_ENABLE_NCCL_HEALTH_CHECK",
}
SHM_FAIL_MIB = 256  # NCCL's SHM transport needs more than Docker's 64 MiB default
SHM_WARN_MIB = 1024


def _multi_gpu(ctx) -> bool:
    return ctx.on_cuda and ctx.layout.world_size > 1


def check_backend(ctx):
    t = ctx.facts.torch
    if ctx.layout.world_size == 1:
        return ok("comm.backend", "one rank: no collectives")
    if t.get("distributed") is False:  # None: a CPU build read from its files, not imported
        return fail("comm.backend", "torch.distributed is not available in this torch build",
                    "install an official torch wheel")
    if ctx.on_cuda:
        if not t.get("nccl_available") or not t.get("nccl"):
            return fail("comm.backend", f"{ctx.layout.world_size} CUDA ranks need NCCL; torch "
                        f"{t.get('version')} has none", "install a CUDA torch wheel (it bundles NCCL)")
        return ok("comm.backend", f"nccl {t['nccl']} (torch {t.get('version')})", nccl=t["nccl"])
    if t.get("gloo_available") is False:
        return fail("comm.backend", "gloo is not available in this torch build", "install an official torch wheel")
    unread = "" if t.get("gloo_available") else "; the ranks check this torch build has it"
    return ok("comm.backend", f"gloo ({ctx.layout.world_size} CPU ranks{unread})")


def _traffic(layout) -> str:
    """What crosses the links in this layout, in words."""
    parts = (["Ulysses all-to-all (4 per layer)" if not layout.dit_fsdp else "Ulysses all-to-all"]
             if layout.use_sp else [])
    if layout.shards_weights:
        parts.append("FSDP all-gathers" + ("" if layout.use_sp else " of every block"))
    return " and ".join(parts) or "collectives"


def _pairs(n):
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


def check_topology(ctx):
    f = ctx.facts
    n = min(ctx.spec.nproc, f.gpu_count)
    if not _multi_gpu(ctx):
        return skip("comm.topology", "single rank or CPU run")
    if ctx.spec.nnodes > 1:
        sp = ctx.layout.use_sp
        what = "Ulysses all-to-all in every layer" if sp else "FSDP all-gathers"
        return warn("comm.topology", f"{ctx.spec.nnodes} nodes: {what} cross the network between nodes",
                    "prefer one node with NVLink; otherwise make sure NCCL uses InfiniBand/RoCE "
                    "(NCCL_DEBUG=INFO shows the transport)")
    if n < 2:
        return skip("comm.topology", "fewer than 2 local GPUs")
    slow = [(i, j) for i, j in _pairs(n) if not f.nvlink(i, j) and not f.p2p(i, j)]
    nv = all(f.nvlink(i, j) for i, j in _pairs(n))
    p2p_only = [(i, j) for i, j in _pairs(n) if not f.nvlink(i, j) and f.p2p(i, j)]
    p2p_disabled = f.env.get("NCCL_P2P_DISABLE", "0") not in ("", "0")
    what = _traffic(ctx.layout)
    if slow:
        i, j = slow[0]
        return warn("comm.topology", f"no NVLink and no P2P between GPU {i} and {j} "
                    f"({f.link(i, j) or '?'}, {len(slow)} of {len(_pairs(n))} pairs): {what} cross PCIe "
                    "through host memory", "expect sub-linear scaling (on PCIe Ulysses can be slower than "
                    "one GPU at small sizes); GPUs on one NVLink/P2P domain are faster"
                    + ("" if p2p_disabled else "; if the first collective hangs, export NCCL_P2P_DISABLE=1 "
                       "(NCCL's transport through host memory, which these GPUs use anyway)"),
                    slow_pairs=slow, nccl_env={"NCCL_P2P_DISABLE": "1"})
    if nv:
        if p2p_disabled:
            return warn("comm.topology", f"NVLink between all {n} GPUs but NCCL_P2P_DISABLE is set",
                        "unset NCCL_P2P_DISABLE (it forces traffic through host memory)")
        return ok("comm.topology", f"NVLink between all {n} GPUs ({f.link(0, 1)})")
    i, j = p2p_only[0]
    return ok("comm.topology", f"PCIe P2P between all {n} GPUs (no NVLink; {f.link(i, j) or '?'})",
              "Ulysses all-to-all runs over PCIe P2P; fine up to 4 GPUs on one switch")


def check_consumer_p2p(ctx):
    f = ctx.facts
    gpus = ctx.local_gpus
    if not _multi_gpu(ctx) or len(gpus) < 2:
        return skip("comm.p2p_env", "single rank or CPU run")
    flags = {k: f.env[k] for k in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE",
                                    "NCCL_P2P_LEVEL", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG") if k in f.env}
    shown = " ".join(f"{k}={v}" for k, v in flags.items()) or "no NCCL_* switches set"
    geforce = any("GeForce" in g.get("name", "") for g in gpus)
    p2p_claimed = any(f.p2p(i, j) for i in range(len(gpus)) for j in range(len(gpus)) if i != j)
    if flags.get("NCCL_SHM_DISABLE", "0") not in ("", "0") and not p2p_claimed:
        return warn("comm.p2p_env", f"{shown}: with no P2P, NCCL falls back to sockets",
                    "unset NCCL_SHM_DISABLE")
    if geforce and p2p_claimed and flags.get("NCCL_P2P_DISABLE", "0") in ("", "0"):
        return warn("comm.p2p_env", f"consumer GPUs ({gpus[0]['name']}) report P2P; it is known to hang "
                    f"NCCL on some boards/IOMMU setups ({shown})",
                    "if the run hangs at the first collective, export NCCL_P2P_DISABLE=1")
    return ok("comm.p2p_env", shown, **flags)


def check_deprecated_env(ctx):
    env = ctx.facts.env
    found = {k: v for k, v in env.items() if k in DEPRECATED_ENV}
    if not found:
        return ok("comm.env", "no deprecated NCCL variables set")
    parts = ", ".join(f"{k} -> {DEPRECATED_ENV[k]}" for k in found)
    conflict = [k for k in found if DEPRECATED_ENV[k] in env and env[DEPRECATED_ENV[k]] != found[k]]
    fix = "rename: " + "; ".join(f"export {DEPRECATED_ENV[k]}={v} and unset {k}" for k, v in found.items())
    if conflict:
        return warn("comm.env", f"deprecated and new names disagree ({', '.join(conflict)}); deprecated: {parts}", fix)
    return warn("comm.env", f"deprecated NCCL variables: {parts}", fix, deprecated=sorted(found))


def check_alloc_conf(ctx):
    if not ctx.on_cuda:
        return skip("comm.alloc_conf", "--device cpu")
    env = ctx.facts.env
    val = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    if "expandable_segments:True" in val.replace(" ", ""):
        return ok("comm.alloc_conf", f"PYTORCH_CUDA_ALLOC_CONF={val}")
    finding = (f"PYTORCH_CUDA_ALLOC_CONF={val or '(unset)'}: the caching allocator can fragment "
               "between the T5, DiT and VAE-decode phases")
    fix = "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    tight = _gpu_headroom(ctx)
    if tight is not None and tight < 0.2:
        return warn("comm.alloc_conf", finding + f" and the plan leaves only {tight:.0%} GPU headroom", fix)
    return ok("comm.alloc_conf", finding, fix)


def _gpu_headroom(ctx):
    """1 - (planned GPU peak / smallest free GPU memory) for this mode, or None."""
    from .memory import plan_all
    gpus = [g for g in ctx.local_gpus if g.get("free_mib")]
    if not gpus:
        return None
    try:
        plan = plan_all(ctx)
    except Exception:  # noqa: BLE001
        return None
    peak = plan[ctx.mode.value].gpu_peak
    free = min(g["free_mib"] for g in gpus) * 2**20
    return None if not peak else 1 - peak / free


def check_shm(ctx):
    h = ctx.facts.host
    total = h.get("shm_total_mib")
    if not _multi_gpu(ctx):
        return skip("comm.shm", "single rank or CPU run (gloo does not use /dev/shm)")
    if total is None:
        return warn("comm.shm", "/dev/shm not found", "mount a tmpfs at /dev/shm (docker: --shm-size=8g or --ipc=host)")
    where = "container" if h.get("container") else "host"
    if total < SHM_FAIL_MIB:
        return fail("comm.shm", f"/dev/shm is {total} MiB ({where}); NCCL's shared-memory transport "
                    "needs more (Docker's default is 64 MiB)",
                    "restart the container with --shm-size=8g (or --ipc=host; k8s: an emptyDir "
                    "medium: Memory at /dev/shm)", shm_mib=total)
    if total < SHM_WARN_MIB:
        return warn("comm.shm", f"/dev/shm is {total} MiB ({where}), below the 1 GiB NCCL usually needs "
                    f"for {ctx.spec.nproc} ranks", "use --shm-size=8g or --ipc=host", shm_mib=total)
    return ok("comm.shm", f"/dev/shm {total / 1024:.1f} GiB ({where})", shm_mib=total)


def check_master_port(ctx):
    port = ctx.spec.master_port
    if ctx.layout.world_size == 1 and ctx.spec.nnodes == 1:
        return skip("comm.master_port", "one rank")
    if port is None:
        return ok(
            "comm.master_port",
            "the OS picks the port at rendezvous (c10d on localhost:0)"
            if ctx.spec.nnodes == 1
            else "default 29500 (multi-node)",
        )
    if ctx.spec.node_rank != 0:
        return skip("comm.master_port", f"node {ctx.spec.node_rank}: the store runs on node 0")
    if ctx.group_running:
        return skip("comm.master_port", f"the running rank group's store holds port {port}")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return fail("comm.master_port", f"--master-port {port} is already in use on this node",
                        "pick another port, or omit --master-port (one node: the OS picks one)")
        if e.errno == errno.EACCES:
            return fail("comm.master_port", f"--master-port {port}: permission denied (privileged port)",
                        "use a port >= 1024")
        return fail("comm.master_port", f"--master-port {port} cannot be bound: {e}", "pick another port")
    finally:
        s.close()
    return ok("comm.master_port", f"port {port} is free")


def check_master_addr(ctx):
    if ctx.spec.nnodes == 1:
        return skip("comm.master_addr", "one node (rendezvous on this host)")
    addr = ctx.spec.master_addr
    try:
        infos = socket.getaddrinfo(addr, ctx.spec.master_port or 29500, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return fail("comm.master_addr", f"--master-addr {addr!r} does not resolve: {e.strerror}",
                    "use node 0's IP address or a hostname every node can resolve")
    ips = sorted({i[4][0] for i in infos})
    if any(ip.startswith("127.") or ip == "::1" for ip in ips):
        # right only when every "node" is a launcher on this machine (a rehearsal or a test)
        return warn("comm.master_addr", f"--master-addr {addr!r} is a loopback address ({', '.join(ips)}) with "
                    f"{ctx.spec.nnodes} nodes: only launchers on this machine can join",
                    "use node 0's address on the shared network (unless every node runs here)")
    return ok("comm.master_addr", f"{addr} -> {', '.join(ips)}")


def check_slurm(ctx):
    """Under ``srun``: one launcher per node (it starts one process per GPU itself)."""
    from wan_s2v_runner.shared.slurm import step_values, tasks_and_nodes

    env = ctx.facts.env
    shape = tasks_and_nodes(env)
    if shape is None:
        return skip("comm.slurm", "not in a Slurm job step")
    tasks, nodes = shape
    if tasks != nodes:
        return fail("comm.slurm", f"srun started {tasks} tasks on {nodes} node(s): the launchers of one node "
                    "would each start their own ranks on the same GPUs",
                    "srun --ntasks-per-node=1 (wan-s2v starts --nproc ranks per node itself)", tasks=tasks, nodes=nodes)
    step = step_values(env)
    if not step:
        return warn("comm.slurm", "a Slurm step whose node list does not parse: nodes not taken from it",
                    "pass --nnodes, --node-rank and --master-addr")
    return ok("comm.slurm", f"Slurm step: {step['nnodes']} node(s), this is node {step['node_rank']}, "
              f"rendezvous on {step['master_addr']} (flags and MASTER_ADDR/WORLD_SIZE/RANK override)", **step)
