#!/usr/bin/env bash
# The first table of benchmarks/results/2026-12-02-aot-compile.md: `jaxformer compile` of the
# decoder presets and the paper's base/big models at 8, 64, 256 and 1,024 simulated CPU devices,
# one process per cell (the device count is fixed when JAX starts). Each cell's JSON line goes to
# OUT/<config>_<devices>.json (a cell already there is skipped, so an interrupted matrix resumes);
# then the table is printed.
# Usage: benchmarks/aot_matrix.sh [OUT=runs/aot] [DEVICE COUNTS...]; PYTHON overrides the interpreter.
# XLA:CPU's LLVM optimisation is off (as in the tests): it changes the host code's speed, not the
# buffers, so the memory figures are the same and the compiles several times faster.
set -euo pipefail
export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
OUT=${1:-runs/aot}
shift || true
COUNTS=${*:-8 64 256 1024}
PY=${PYTHON:-python}
mkdir -p "$OUT"

# One data-parallel rank holds one 2048-token sequence (decoders) or 32 sentence pairs (base/big,
# with their layers scanned, as the presets: one block compiled per stack instead of six).
cell() {  # config devices overrides...
  local config=$1 n=$2; shift 2
  local file="$OUT/${config}_${n}.json"
  [[ -s $file ]] && return 0
  echo "== $config on $n devices: $*" >&2
  if "$PY" -m jaxformer compile --config "configs/$config.yaml" --devices "$n" --hbm 80GiB "$@" \
      > "$OUT/${config}_${n}.log" 2>&1; then
    tail -n 1 "$OUT/${config}_${n}.log" > "$file.tmp" && mv "$file.tmp" "$file"
  else
    echo "   failed: see $OUT/${config}_${n}.log" >&2
  fi
}

for n in $COUNTS; do
  case $n in
    8)    m1="mesh.fsdp=8";              m8="mesh.fsdp=8";              m70="mesh.fsdp=8" t70=1;;
    64)   m1="mesh.data=8 mesh.fsdp=8";  m8="mesh.data=1 mesh.fsdp=64"; m70="mesh.fsdp=8 mesh.tensor=8" t70=8;;
    256)  m1="mesh.data=32 mesh.fsdp=8"; m8="mesh.data=4 mesh.fsdp=64"; m70="mesh.fsdp=32 mesh.tensor=8" t70=8;;
    1024) m1="mesh.data=128 mesh.fsdp=8"; m8="mesh.data=16 mesh.fsdp=64"; m70="mesh.fsdp=128 mesh.tensor=8" t70=8;;
    *) echo "no mesh chosen for $n devices" >&2; exit 2;;
  esac
  cell decoder_1b "$n" $m1 train.batch_size="$n"
  cell decoder_8b "$n" $m8 train.batch_size="$n"
  cell decoder_70b "$n" $m70 mesh.data=1 train.batch_size=$((n / t70))
  for paper in multi30k_base multi30k_big; do
    cell "$paper" "$n" mesh.data=-1 train.batch_size=$((32 * n)) model.scan_layers=true
  done
done

"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
rows = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))]
rows.sort(key=lambda r: (r["params"], r["devices"]))
print("| config | devices | mesh | batch | arguments | temporaries | total / device | fits 80 GiB | compile s (CPU s) |")
print("|---|---:|---|---:|---:|---:|---:|:-:|---:|")
gib = lambda n: f"{n / 2**30:.2f} GiB"
for r in rows:
  mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1)
  print(f"| {r['config']} | {r['devices']} | {mesh} | {r['batch_size']} | {gib(r['argument_bytes'])} | "
        f"{gib(r['temp_bytes'])} | {gib(r['total_bytes_per_device'])} | {'yes' if r['fits'] else 'no'} | "
        f"{r['compile_seconds']:.0f} ({r.get('compile_cpu_seconds', float('nan')):.0f}) |")
PY
