"""A warm server's whole video (issue #60, part 3): ``wan-s2v serve`` on a checkpoint, jobs submitted one
after another over HTTP, each job's wall against the sum of its stages.

The server is started once (``bench_loop.served``: ``wan-s2v serve`` on loopback, with a token), its rank group
loads, then ``--jobs`` jobs of the same request are submitted one at a time (the next after the
last ends), so the second and later ones run on a warm group: weights loaded, blocks compiled, the
prompt's T5 encoding kept. What it prints (and writes with ``--json``): per job its status, wall
(the video object's ``wall_s``), the sum of its ``stage_seconds`` and each stage; the group's
load and the ranks' peak memory (``GET /v1/server``). The inputs are the demo's synthetic ones:
a reference image at the size's aspect and ``--audio-seconds`` of speech-like audio.

    python bench/gpu_serve.py --ckpt /tmp/s2v-random --out /tmp/gs --json serve.json -- \\
        --device cuda --nproc 1 --compile --dit-quant fp8 --no-offload-model
    python bench/gpu_serve.py --ckpt ~/.cache/wan-s2v/demo/ckpt --out /tmp/gs --size 64*64 --steps 1 \\
        --infer-frames 8 --audio-seconds 1 -- --device cpu --nproc 1          # smoke test on the CPU
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_loop import served  # noqa: E402

TOKEN = "bench"
TERMINAL = ("completed", "failed", "cancelled")


def wait_for(what: str, fn, timeout: float, proc: subprocess.Popen, log: Path):
    end = time.time() + timeout
    while time.time() < end:
        got = fn()
        if got:
            return got
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) while waiting for {what}:\n"
                             + log.read_text()[-4000:])
        time.sleep(0.5)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}:\n" + log.read_text()[-4000:])


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="a folder for the inputs, the server and its videos")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--size", default="1024*704")
    ap.add_argument("--audio-seconds", type=float, default=5.0)
    ap.add_argument("--infer-frames", type=int, default=80)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--guide-scale", type=float, default=1.0)
    ap.add_argument("--shift", type=float, default=8.0)
    ap.add_argument("--solver", default="unipc")
    ap.add_argument("--prompt", default="a person talking to the camera")
    ap.add_argument("--load-timeout", type=float, default=300)
    ap.add_argument("--job-timeout", type=float, default=300)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    import httpx

    from wan_s2v_runner.demo.synthetic_inputs import make_reference_image, make_speech_audio
    from wan_s2v_runner.shared.spec import size_pair

    w, h = size_pair(a.size)
    inputs = (a.out / "inputs").absolute()
    inputs.mkdir(parents=True, exist_ok=True)
    image = make_reference_image(inputs / "face.png", width=w, height=h)
    speech = make_speech_audio(inputs / "speech.wav", seconds=a.audio_seconds)
    server_dir = (a.out / "server").absolute()
    server_dir.mkdir(parents=True, exist_ok=True)
    (server_dir / "server.json").unlink(missing_ok=True)
    log = a.out / "serve.log"
    flags = ["--ckpt-dir", str(a.ckpt), "--token", TOKEN, "--allow-dir", str(inputs), "--size", a.size,
             "--infer-frames", str(a.infer_frames), *extra]
    out: dict = {"flags": flags, "request": {}, "jobs": []}
    t0 = time.time()
    with served(flags, server_dir, log, cwd=a.out, start_s=120) as (proc, url):
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        wait_for("the group to load", lambda: http.get("/health").json().get("group") == "idle",
                 a.load_timeout, proc, log)
        out["ready_s"] = round(time.time() - t0, 1)
        print(f"server ready (group loaded) after {out['ready_s']} s", flush=True)
        request = {"prompt": a.prompt, "image": str(image), "audio": str(speech), "steps": a.steps,
                   "guide_scale": a.guide_scale, "shift": a.shift, "solver": a.solver, "seed": 42}
        out["request"] = request
        for i in range(a.jobs):
            t_submit = time.time()
            r = http.post("/v1/videos", json=request)
            if r.status_code != 200:
                raise SystemExit(f"job {i + 1} refused ({r.status_code}): {r.text}")
            vid = r.json()["id"]
            v = wait_for(f"job {i + 1}", lambda vid=vid: (x := http.get(f"/v1/videos/{vid}").json())["status"]
                         in TERMINAL and x, a.job_timeout, proc, log)
            stages = v.get("stage_seconds") or {}
            row = {"job": i + 1, "id": vid, "status": v["status"], "error": v.get("error"),
                   "wall_s": v.get("wall_s"), "client_s": round(time.time() - t_submit, 1),
                   "stages_sum_s": round(sum(stages.values()), 1), "stage_seconds": stages,
                   "size": v.get("size"), "seconds": v.get("seconds")}
            out["jobs"].append(row)
            print(f"job {row['job']}: {row['status']}, wall {row['wall_s']} s (client {row['client_s']} s), "
                  f"stages {row['stages_sum_s']} s: " + ", ".join(f"{k} {s:.1f}" for k, s in stages.items()),
                  flush=True)
            if a.json:
                a.json.write_text(json.dumps(out, indent=2) + "\n")
        out["server"] = http.get("/v1/server").json()
    out["total_s"] = round(time.time() - t0, 1)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
