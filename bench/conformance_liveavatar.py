"""Conformance of the live mode's DiT (``wan_s2v_runner.rank.live_dit``) against LiveAvatar's own
causal model code, block by block (not part of CI: run once by hand; the result is in
docs/live-conformance.md).

What runs:

* **ours**: the tiny random checkpoint loaded as a CPU fp32 run loads it (``components.load``; the
  upstream ``wan`` package's ``WanModel_S2V``), driven by :class:`LiveDiT` (``sink`` once, then
  ``block`` per block and step against that step's :class:`patches.live_kv.StepKV`);
* **LiveAvatar**: ``liveavatar/models/wan/causal_model_s2v.py`` ``CausalWanModel_S2V`` of
  github Alibaba-Quark/LiveAvatar at commit 9c2c38d (extracted from the local git mirror, or from
  ``--liveavatar-src``), built with the tiny checkpoint's config and given our model's state dict,
  called exactly as its 1-GPU loop (``causal_s2v_pipeline.py`` ``WanS2V.generate``) calls it:
  one KV cache per denoising step (``_initialize_kv_cache``: k/v of one 48-frame clip, i.e. 4
  blocks, cond_k/cond_v/cond_end shared by the four), the sink forward (``sink_flag=True``, t=0)
  into each step's cache, then ``noise_model([block_latents], t=[[t]*3], ..., current_start,
  current_end)`` per block and step.

Both get the same inputs at every (block, step): ours is the driver (the latents our Euler steps
produce), LiveAvatar is fed them too, so differences do not compound. LiveAvatar draws the
reference distance with ``random.randint(4, 30)`` inside ``_forward_inference``; ``random.randint``
is replaced for each call by one returning ours (``live_recipe.ref_distance(seed, block, step)``).

The few changes LiveAvatar's code needs to run on a CPU in fp32 are applied to its source text
as it is loaded (each edit must match exactly once, or the script stops): :data:`LIVEAVATAR_EDITS`
and the name rebinds in :func:`load_liveavatar`; docs/live-conformance.md lists them. Two of them
are LiveAvatar's own roundings (its RoPE tables in complex32, its bf16 cast before the
cross-attention norm): the comparison runs LiveAvatar twice, with them kept ("quirks") and with
them switched to fp32/float64 ("fp32"), each with its own caches.

A random LoRA of LiveAvatar's target modules (PEFT keys ``<module>.lora_A.default.weight``, r=4,
alpha=2: self/cross-attention q,k,v,o, ffn.0/ffn.2, the audio injector's q,k,v,o) is merged into
both models by the runner's own merge (``wan_s2v_runner.loading.lora.merge``) before the
comparison (``--no-lora`` skips it); the number of modules it matched on each model is printed.

Usage (2 CPU threads at most; about a minute):

    .venv/bin/python bench/conformance_liveavatar.py [--markdown]
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import types
import warnings
from pathlib import Path

os.environ.setdefault("ENABLE_COMPILE", "false")  # LiveAvatar's inference_utils: no torch.compile

import torch  # noqa: E402

for _msg in (r".*torch\.cuda\.amp\.autocast", r".*CUDA is not available", r".*ComplexHalf support",
             r".*Accessing config attribute"):
    warnings.filterwarnings("ignore", message=_msg)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

COMMIT = "9c2c38d"
MIRROR = Path("/work/.mirror/Alibaba-Quark+LiveAvatar/repo")
LORA_RANK, LORA_ALPHA = 4, 2.0

#: (file under liveavatar/models/wan, exact text, replacement, why). Names starting with _LA_ are
#: module globals this script sets (:func:`set_quirks`).
LIVEAVATAR_EDITS = [
    ("wan_2_2/modules/s2v/s2v_utils.py",
     "x.detach().contiguous().to(torch.float16).reshape(b, s, n, -1,",
     "x.detach().contiguous().to(_LA_ROPE_REAL).reshape(b, s, n, -1,",
     "rope_precompute's table dtype: float16 pairs = complex32 (LiveAvatar's) or float64 = complex128 "
     "(upstream's)"),
    ("causal_model_s2v.py",
     "dim=1).to(\"cuda\")",
     "dim=1)",
     "CausalWanModel_S2V.__init__ moves its RoPE table to CUDA: kept on the CPU"),
    ("causal_model_s2v.py",
     "torch.zeros([1,5120,nf,height//2,width//2]).to(dtype=torch.bfloat16,device=x[0].device)",
     "torch.zeros([1,self.dim,nf,height//2,width//2]).to(dtype=_LA_SINK_DTYPE,device=x[0].device)",
     "_forward_sink's empty noisy-token tensor is hard-coded to the 14B's dim 5120 (cat fails at another "
     "dim) and bf16 (empty: no numeric effect)"),
    ("causal_model_s2v.py",
     "self.norm3(x.to(torch.bfloat16))",
     "self.norm3(x.to(_LA_NORM3_DTYPE))",
     "CausalWanS2VAttentionBlock rounds x to bf16 before the cross-attention norm: bf16 (LiveAvatar's) "
     "or fp32"),
]

QUIRKS = {  # LiveAvatar's own roundings, kept
    "_LA_ROPE_REAL": torch.float16, "_LA_NORM3_DTYPE": torch.bfloat16, "_LA_SINK_DTYPE": torch.bfloat16}
FP32 = {  # the same places in fp32 / float64 (what upstream Wan2.2 and ours do)
    "_LA_ROPE_REAL": torch.float64, "_LA_NORM3_DTYPE": torch.float32, "_LA_SINK_DTYPE": torch.float32}
#: the LiveAvatar runs compared: (name, module globals); the table shows the first two, the summary all
VARIANTS = [("fp32", FP32), ("quirks", QUIRKS),
            ("complex32 RoPE only", {**FP32, "_LA_ROPE_REAL": torch.float16}),
            ("bf16 norm3 input only", {**FP32, "_LA_NORM3_DTYPE": torch.bfloat16})]


# --------------------------------------------------------------------------- LiveAvatar's code
def liveavatar_source(src: str | None) -> Path:
    """The directory holding ``liveavatar/``: ``src``, or commit 9c2c38d extracted from the mirror."""
    if src:
        return Path(src)
    if not MIRROR.exists():
        raise SystemExit(f"no LiveAvatar source: pass --liveavatar-src DIR (a checkout of {COMMIT}) "
                         f"or provide the git mirror at {MIRROR}")
    out = Path(tempfile.mkdtemp(prefix="liveavatar_src_"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    archive = subprocess.run(["git", "-C", str(MIRROR), "archive", COMMIT, "liveavatar"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def _package(name: str, path: Path) -> None:
    """A namespace-like package entry, so its ``__init__`` (which imports T5, the VAE,
    transformers, ...) is not run."""
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    mod.__package__ = name
    sys.modules[name] = mod


def _exec_patched(name: str, path: Path, edits: list) -> types.ModuleType:
    text = path.read_text()
    for old, new in edits:
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"{path}: expected the text {old!r} once, found it {n} times")
        text = text.replace(old, new)
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    mod.__package__ = name.rpartition(".")[0]
    mod.__dict__.update(QUIRKS)
    sys.modules[name] = mod
    exec(compile(text, str(path), "exec"), mod.__dict__)
    return mod


def load_liveavatar(root: Path, sdpa) -> dict:
    """Import ``causal_model_s2v`` (and what it imports) from ``root`` with :data:`LIVEAVATAR_EDITS`;
    every attention kernel name rebound to ``sdpa``. Returns {short name: module}."""
    import importlib

    base = root / "liveavatar"
    for name, sub in [("liveavatar", ""), ("liveavatar.models", "models"), ("liveavatar.models.wan", "models/wan"),
                      ("liveavatar.models.wan.wan_2_2", "models/wan/wan_2_2"),
                      ("liveavatar.models.wan.wan_2_2.modules", "models/wan/wan_2_2/modules"),
                      ("liveavatar.models.wan.wan_2_2.modules.s2v", "models/wan/wan_2_2/modules/s2v"),
                      ("liveavatar.models.wan.wan_2_2.distributed", "models/wan/wan_2_2/distributed")]:
        _package(name, base / sub)
    wan_dir = base / "models" / "wan"
    by_file: dict = {}
    for f, old, new, _ in LIVEAVATAR_EDITS:
        by_file.setdefault(f, []).append((old, new))
    mods = {}
    with contextlib.redirect_stdout(sys.stderr):  # inference_utils prints "COMPILE: False"
        mods["s2v_utils"] = _exec_patched("liveavatar.models.wan.wan_2_2.modules.s2v.s2v_utils",
                                          wan_dir / "wan_2_2/modules/s2v/s2v_utils.py",
                                          by_file["wan_2_2/modules/s2v/s2v_utils.py"])
        mods["causal"] = _exec_patched("liveavatar.models.wan.causal_model_s2v", wan_dir / "causal_model_s2v.py",
                                       by_file["causal_model_s2v.py"])
    for short, name in [("model", "liveavatar.models.wan.wan_2_2.modules.model"),
                        ("model_s2v", "liveavatar.models.wan.wan_2_2.modules.s2v.model_s2v"),
                        ("motioner", "liveavatar.models.wan.wan_2_2.modules.s2v.motioner"),
                        ("ulysses", "liveavatar.models.wan.wan_2_2.distributed.ulysses"),
                        ("causal_motioner", "liveavatar.models.wan.causal_motioner"),
                        ("inference_utils", "liveavatar.models.wan.inference_utils")]:
        mods[short] = importlib.import_module(name)
    if mods["inference_utils"].COMPILE:
        raise SystemExit("ENABLE_COMPILE is set: unset it (LiveAvatar would torch.compile on the CPU)")
    # the attention kernels: cudnn SDPA / flash-attn, CUDA only -> the SDPA our CPU run uses
    for short in ("causal", "model", "model_s2v", "motioner", "ulysses"):
        for attr in ("attention", "flash_attention"):
            if callable(getattr(mods[short], attr, None)):
                setattr(mods[short], attr, sdpa)
    return mods


def set_quirks(mods: dict, values: dict) -> None:
    for m in (mods["s2v_utils"], mods["causal"]):
        m.__dict__.update(values)


@contextlib.contextmanager
def drawn(distance: int):
    """``random.randint(4, 30)`` returns ``distance``, once, for the call inside."""
    real, calls = random.randint, []

    def randint(a, b):
        if (a, b) != (4, 30) or calls:
            raise AssertionError(f"unexpected random.randint({a}, {b}) (call {len(calls) + 1})")
        calls.append((a, b))
        return distance

    random.randint = randint
    try:
        yield
    finally:
        random.randint = real
    if len(calls) != 1:
        raise AssertionError(f"LiveAvatar drew the distance {len(calls)} times in one forward")


class LiveAvatarRun:
    """LiveAvatar's single-GPU loop's state for one variant: per-step KV caches (the cond half
    shared), the cross-attention cache, and the calls ``generate`` makes."""

    def __init__(self, model, mods, quirks: dict, blocks_in_cache: int, tokens_per_frame: int, frames_per_block: int):
        self.model, self.mods, self.quirks = model, mods, quirks
        self.fpb, self.fsl = frames_per_block, tokens_per_frame
        heads, hd = model.num_heads, model.dim // model.num_heads
        size = blocks_in_cache * frames_per_block * tokens_per_frame  # max_seq_len = prod(target_shape) // 4
        cond = [{"cond_k": torch.zeros([1, 2800, heads, hd]), "cond_v": torch.zeros([1, 2800, heads, hd]),
                 "cond_end": torch.tensor([0], dtype=torch.long)} for _ in range(model.num_layers)]
        self.kv = [[{"k": torch.zeros([1, size, heads, hd]), "v": torch.zeros([1, size, heads, hd]), **c}
                    for c in cond] for _ in range(4)]
        self.cross = [{"k": torch.zeros([1, 0, heads, hd]), "v": torch.zeros([1, 0, heads, hd]), "is_init": False}
                      for _ in range(model.num_layers)]

    def _args(self, block, ctx, ref, motion, audio, cond_states):
        return dict(context=ctx, seq_len=None, cond_states=cond_states, motion_latents=motion, ref_latents=ref,
                    audio_input=audio, motion_frames=[73, 19], drop_motion_frames=False)

    def sink(self, latents0, ctx, ref, motion, audio0, cond_states):
        set_quirks(self.mods, self.quirks)
        for step in range(4):  # "2.2.0 prefill cond caching": once per step's cache (cond shared)
            self.model([latents0], t=torch.zeros([1, self.fpb]), **self._args(0, ctx, ref, motion, audio0, cond_states),
                       sink_flag=True, kv_cache=self.kv[step], crossattn_cache=self.cross,
                       current_start=0, current_end=self.fpb * self.fsl)

    def block(self, x, t, step, block, distance, ctx, ref, motion, audio, cond_states):
        set_quirks(self.mods, self.quirks)
        timestep = torch.tensor([t] * self.fpb).unsqueeze(0)
        with drawn(distance):
            out = self.model([x], t=timestep, **self._args(block, ctx, ref, motion, audio, cond_states),
                             kv_cache=self.kv[step], crossattn_cache=self.cross,
                             current_start=block * self.fpb * self.fsl, current_end=(block + 1) * self.fpb * self.fsl,
                             mask=None)
        return out[0].float()


# --------------------------------------------------------------------------- ours
def our_parts(assets_dir: Path):
    """The tiny checkpoint loaded as ``tests/conftest.py::cpu_engine`` + ``_live_parts`` load it."""
    from patches import apply_for_run
    from wan_s2v_runner.demo.assets import ensure_demo_assets
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.loading.engine import import_wan
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import engine_config
    from wan_s2v_runner.shared.layout import Layout, Mode
    from wan_s2v_runner.shared.spec import RunSpec

    assets = ensure_demo_assets(assets_dir)
    wan = import_wan()
    spec = RunSpec(ckpt_dir=assets.ckpt_dir, image=assets.image, audio=assets.audio, prompt="a person talking",
                   device="cpu", max_area=64 * 64, infer_frames=8, steps=2, seed=42)
    cfg = engine_config(wan, spec)
    apply_for_run(wan, spec, cfg.param_dtype)
    plan = RankPlan(Layout.for_mode(Mode.LIVE, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0,
                            components.LoadSettings.of(spec))
    return parts, assets


LORA_TARGETS = re.compile(r"^(blocks\.\d+\.(self_attn|cross_attn)\.(q|k|v|o)|blocks\.\d+\.ffn\.(0|2)"
                          r"|audio_injector\.injector\.\d+\.(q|k|v|o))\.weight$")


def random_lora(model, path: Path, seed: int) -> int:
    """A PEFT-style LoRA (r=4, no alpha key) for LiveAvatar's target modules of ``model``."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.named_parameters():
        if LORA_TARGETS.match(name):
            mod = name[: -len(".weight")]
            out_f, in_f = p.shape
            tensors[f"{mod}.lora_A.default.weight"] = torch.randn(LORA_RANK, in_f, generator=g) / in_f ** 0.5
            tensors[f"{mod}.lora_B.default.weight"] = torch.randn(out_f, LORA_RANK, generator=g) * 0.05
    save_file(tensors, str(path))
    return len(tensors) // 2


# --------------------------------------------------------------------------- the comparison
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--liveavatar-src", help=f"a directory holding LiveAvatar's liveavatar/ ({COMMIT}); default: "
                    f"extracted from {MIRROR}")
    ap.add_argument("--assets", default=str(Path.home() / ".cache" / "wan-s2v" / "demo"),
                    help="the demo asset cache (tiny checkpoint; make demo builds it there)")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--latent", type=int, default=8, help="latent height = width")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    from patches.attention import sdpa_attention
    from patches.live_kv import StepKV
    from wan_s2v_runner.loading import lora
    from wan_s2v_runner.rank.block_pipeline import Schedule
    from wan_s2v_runner.rank.live_dit import LiveDiT
    from wan_s2v_runner.shared import live_recipe as recipe

    parts, _ = our_parts(Path(a.assets))
    ours_model = parts.noise_model.float().eval()
    import wan.modules.s2v.model_s2v as up
    print(f"ours: {type(ours_model).__module__}.{type(ours_model).__name__}, attention "
          f"{getattr(up.flash_attention, '__name__', up.flash_attention)}")

    src = liveavatar_source(a.liveavatar_src)
    mods = load_liveavatar(src, sdpa_attention)
    config = {k: v for k, v in dict(ours_model.config).items() if not k.startswith("_")}
    torch.manual_seed(0)
    la = mods["causal"].CausalWanModel_S2V(**config).float().eval()
    missing, unexpected = la.load_state_dict(ours_model.state_dict(), strict=False)
    print(f"LiveAvatar: {src}/liveavatar ({COMMIT}); config {config}")
    print(f"state dict: {len(ours_model.state_dict())} keys ours, {len(la.state_dict())} LiveAvatar; "
          f"LiveAvatar's that ours lacks: {list(missing)}; ours that LiveAvatar lacks: {list(unexpected)}")

    if not a.no_lora:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "random_lora.safetensors"
            n = random_lora(ours_model, path, a.seed)
            src_ = [lora.LoraSource(path, LORA_ALPHA / LORA_RANK)]
            r_ours, r_la = lora.merge(ours_model, src_), lora.merge(la, src_)
        print(f"random LoRA r={LORA_RANK} alpha={LORA_ALPHA:g} on {n} modules: merged into "
              f"{r_ours[0]['matched_modules']} of ours, {r_la[0]['matched_modules']} of LiveAvatar's")
    worst = max((ours_model.state_dict()[k] - v).abs().max().item() for k, v in la.state_dict().items())
    print(f"weights after loading: max |ours - LiveAvatar| = {worst:g}")

    # fixed random inputs
    h = w = a.latent
    g = torch.Generator().manual_seed(a.seed)
    ref = torch.randn(1, 16, 1, h, w, generator=g)
    motion = torch.randn(1, 16, 19, h, w, generator=g)
    t5 = [torch.randn(12, config.get("text_dim", 4096), generator=g) * 0.2]
    audio_emb = torch.randn(1, 25, config["audio_dim"], recipe.BLOCK_FRAMES * a.blocks, generator=g)
    cond_states = torch.zeros(16, recipe.BLOCK_LATENT_FRAMES, h, w)
    motion_frames = [73, 19]
    sched = Schedule(1000)
    fsl = (h // 2) * (w // 2)

    results = []
    with torch.no_grad():
        dit = LiveDiT(ours_model)
        ctx = dit.context(t5)
        cond = dit.sink(ref, motion, ctx)
        kvs = {i: StepKV(len(ours_model.blocks)) for i in range(recipe.STEPS)}
        runs = {name: LiveAvatarRun(la, mods, q, recipe.WINDOW_BLOCKS, fsl, recipe.BLOCK_LATENT_FRAMES)
                for name, q in VARIANTS}
        noise = None
        control = None
        for b in range(a.blocks):
            if b % recipe.WINDOW_BLOCKS == 0:  # LiveAvatar's clip noise: one randn per 4 blocks
                gen = torch.Generator().manual_seed(a.seed + b // recipe.WINDOW_BLOCKS)
                noise = torch.randn(16, recipe.WINDOW_BLOCKS * recipe.BLOCK_LATENT_FRAMES, h, w, generator=gen)
            k = b % recipe.WINDOW_BLOCKS
            x = noise[:, k * recipe.BLOCK_LATENT_FRAMES:(k + 1) * recipe.BLOCK_LATENT_FRAMES].clone()
            audio = audio_emb[..., b * recipe.BLOCK_FRAMES:(b + 1) * recipe.BLOCK_FRAMES]
            if b == 0:
                for run in runs.values():
                    run.sink(x, t5, ref, motion, audio, cond_states.unsqueeze(0))
            for i in range(recipe.STEPS):
                t = sched.timesteps[i]
                d = recipe.ref_distance(a.seed, b, i)
                v = dit.block(x, torch.stack([t]), kvs[i], b, d, audio, cond_states, motion_frames, ctx, cond)
                row = dict(block=b, step=i, t=float(t), distance=d,
                           ref_pos=recipe.ref_position(b * recipe.BLOCK_LATENT_FRAMES, d),
                           mag_max=v.abs().max().item(), mag_mean=v.abs().mean().item())
                for name, run in runs.items():
                    o = run.block(x, t, i, b, d, t5, ref, motion, audio, cond_states.unsqueeze(0))
                    row[name] = ((o - v).abs().max().item(), (o - v).abs().mean().item())
                results.append(row)
                if b == a.blocks - 1 and i == 0:
                    control = (x.clone(), t, d, audio, v)
                x = sched.step(i, v, x)
        # control: the last block's first step with LiveAvatar drawing another distance (one that
        # moves the reference), to show the comparison sees a wrong reference position
        x, t, d, audio, v = control
        frame = (a.blocks - 1) * recipe.BLOCK_LATENT_FRAMES
        other = next(c for c in (30, 4, 29, 5) if recipe.ref_position(frame, c) != recipe.ref_position(frame, d))
        o = runs["fp32"].block(x, t, 0, a.blocks - 1, other, t5, ref, motion, audio, cond_states.unsqueeze(0))
        ctrl = ((o - v).abs().max().item(), (o - v).abs().mean().item(), d, other,
                recipe.ref_position(frame, d), recipe.ref_position(frame, other))
        # control 2: the same call with the window's oldest block's keys and values zeroed in
        # LiveAvatar's step-0 cache, to show the comparison sees the set of keys a block attends
        last = a.blocks - 1
        oldest = max(0, last - recipe.WINDOW_BLOCKS + 1)
        n = recipe.BLOCK_LATENT_FRAMES * fsl
        slot = oldest % recipe.WINDOW_BLOCKS
        for layer in runs["fp32"].kv[0]:
            layer["k"][:, slot * n:(slot + 1) * n] = 0
            layer["v"][:, slot * n:(slot + 1) * n] = 0
        o = runs["fp32"].block(x, t, 0, last, d, t5, ref, motion, audio, cond_states.unsqueeze(0))
        ctrl2 = ((o - v).abs().max().item(), (o - v).abs().mean().item(), oldest)

    print_table(results, a.markdown)
    print(f"\ncontrol (block {a.blocks - 1}, step 0): LiveAvatar fp32 drawing distance {ctrl[3]} (reference at "
          f"{ctrl[5]}) instead of {ctrl[2]} (at {ctrl[4]}): max |diff| {ctrl[0]:.3e}, mean {ctrl[1]:.3e}")
    print(f"control (block {a.blocks - 1}, step 0): LiveAvatar fp32 with block {ctrl2[2]}'s cached keys/values "
          f"zeroed: max |diff| {ctrl2[0]:.3e}, mean {ctrl2[1]:.3e}")
    print("LiveAvatar variant vs ours, over all (block, step):")
    for name, _ in VARIANTS:
        print(f"  {name:>22}: max |diff| {max(r[name][0] for r in results):.3e}, "
              f"mean |diff| {sum(r[name][1] for r in results) / len(results):.3e}")
    return 0


def print_table(rows, markdown: bool) -> None:
    head = ["block", "step", "t", "dist", "ref pos", "pred max abs", "pred mean abs",
            "fp32 max diff", "fp32 mean diff", "quirks max diff", "quirks mean diff"]
    body = [[str(r["block"]), str(r["step"]), f"{r['t']:.1f}", str(r["distance"]), str(r["ref_pos"]),
             f"{r['mag_max']:.3f}", f"{r['mag_mean']:.3f}", f"{r['fp32'][0]:.2e}", f"{r['fp32'][1]:.2e}",
             f"{r['quirks'][0]:.2e}", f"{r['quirks'][1]:.2e}"] for r in rows]
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---:" for _ in head) + "|")
        for b in body:
            print("| " + " | ".join(b) + " |")
        return
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    for line in [head, *body]:
        print("  ".join(x.rjust(wd) for x, wd in zip(line, widths)))


if __name__ == "__main__":
    sys.exit(main())
