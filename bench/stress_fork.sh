#!/bin/bash
# LOOPS loops of 6-rank tiny runs on the CPU, each loop with its own warm agent and one run at a time
# (so LOOPS runs at once): a run that has not ended in 90 s counts as hung, and gdb writes its ranks'
# native stacks (rank/fork_gate.py's reason: a rank forked while an agent thread held glibc's
# resolver lock waited in init_pg for ever). One node only, agents forked from a warm agent.
#   bash bench/stress_fork.sh [LOOPS [RUNS [DIR]]]    # defaults: 3 loops of 60 runs in /tmp/stress-fork
# Prints the runs that ended, those that failed and those that hung (DIR/L/rI/gdb.txt).
LOOPS=${1:-3}; RUNS=${2:-60}; DIR=${3:-/tmp/stress-fork}
ROOT=$(cd "$(dirname "$0")/.." && pwd); PY=$ROOT/.venv/bin/python
rm -rf "$DIR"; mkdir -p "$DIR"
$PY -c "from pathlib import Path; from wan_s2v_runner.demo.assets import ensure_demo_assets as e; e(Path('$DIR/demo'))" || exit 1
loop() {  # loop L
  local L=$DIR/$1 D=$DIR/demo; mkdir -p "$L"; cd "$L" || return
  export WAN_S2V_WARM_AGENT=$L/warm.sock
  $PY -m wan_s2v_runner warm --socket "$L/warm.sock" > warm.log 2>&1 &
  local W=$! i P t
  for t in $(seq 1 300); do grep -q "ready on" warm.log 2>/dev/null && break; sleep 0.2; done
  grep -q "ready on" warm.log || { echo "$1: the warm agent did not start (warm.log)" >> "$DIR/failed"; return; }
  for i in $(seq 1 "$RUNS"); do
    $PY -m wan_s2v_runner run --device cpu --size '64*64' --infer-frames 12 --steps 2 --seed 42 \
      --prompt "a person talking" --ckpt-dir $D/tiny-s2v-ckpt --image $D/reference.png --audio $D/speech.wav \
      --pose-video $D/pose.mp4 --output r$i/o.mp4 --runs-root r$i/runs --nproc 6 --cfg-parallel --no-vae-parallel \
      --num-clips 1 > r$i.txt 2>&1 &
    P=$!
    for t in $(seq 1 180); do sleep 0.5; kill -0 $P 2>/dev/null || break; done
    if kill -0 $P 2>/dev/null; then
      echo "$1 run $i hung" >> "$DIR/hung"
      pids=$($PY -c "import json,sys; print(*(json.loads(open(f).readline())['pid'] for f in sys.argv[1:]))" \
        r$i/runs/*/events/rank*.jsonl)  # each rank's hello
      for pid in $pids; do
        echo "== pid $pid"; timeout 60 gdb -p "$pid" -batch -ex "thread apply all bt 20" 2>/dev/null | grep -E "^#|^Thread"
      done > r$i/gdb.txt 2>&1
      pkill -9 -f "$L/r$i/"; kill -9 $P $pids 2>/dev/null  # the agent names its spec.json; the launcher; the ranks
    else
      wait $P && echo "$1 $i" >> "$DIR/ended" || echo "$1 run $i failed" >> "$DIR/failed"
    fi
  done
  kill $W
}
for l in $(seq 1 "$LOOPS"); do loop "l$l" & done
wait
echo "ended: $(cat "$DIR/ended" 2>/dev/null | wc -l), failed: $(cat "$DIR/failed" 2>/dev/null | wc -l), hung: $(cat "$DIR/hung" 2>/dev/null | wc -l)"
cat "$DIR/hung" "$DIR/failed" 2>/dev/null
