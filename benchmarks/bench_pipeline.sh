#!/usr/bin/env bash
# The table of benchmarks/results/2026-12-02-pipeline.md: `jaxformer bench` of the character LM
# (4 scanned layers, d_model 128, batch 32 x 64 tokens) on 8 simulated CPU devices, data-parallel
# and pipelined over mesh.stage with several train.microbatches. Prints one line per run: the
# mesh, the microbatches, bubble_fraction, the median step time, argument bytes per device and
# the losses.
# Usage: benchmarks/bench_pipeline.sh; PYTHON overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
run() {
  "$PY" -m jaxformer bench --config configs/shakespeare_char.yaml --batch-size 32 --tgt-length 64 --steps 6 \
      --warmup 2 --no-torch model.scan_layers=true runtime.num_cpu_devices=8 train.steps_per_call=1 "$@" \
    | tail -1 | "$PY" -c 'import json, sys
r = json.loads(sys.stdin.read())
print(json.dumps({"args": sys.argv[1:], "bubble_fraction": round(r["bubble_fraction"], 3),
                  "step_time_ms": round(r["step_time_s"] * 1e3), "argument_bytes": r["argument_memory_bytes"],
                  "losses": [round(x, 5) for x in r["losses"]]}))' "$@"
}
run mesh.data=8
run mesh.data=4 mesh.stage=2 train.microbatches=1
run mesh.data=4 mesh.stage=2 train.microbatches=2
run mesh.data=4 mesh.stage=2 train.microbatches=8
run mesh.data=2 mesh.stage=4 train.microbatches=4
