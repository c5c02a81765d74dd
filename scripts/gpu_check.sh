#!/usr/bin/env bash
# GPU readiness in a few minutes on one GPU (or several: the benches use them all, data-parallel):
#   1. model.attention=fused (jax.nn.dot_product_attention with cuDNN flash attention) equals our
#      attention in bfloat16 -- causal, padding, grouped-query heads; forward and gradients -- and
#      cuDNN really ran (its fused-attention custom call is in the compiled program);
#   2. MFU of multi30k_base (dense and fused attention) and of the decoder_1b preset (fused) through
#      `jaxformer bench`, bf16 compute, against the published peak of the GPU.
# Every result is a JSON file under OUT; the last line printed is one JSON summary.
# Usage: scripts/gpu_check.sh [OUT=runs/gpu_check]. PYTHON overrides the interpreter.
# DRY_RUN=1 runs the same steps on CPU at toy sizes (float32, XLA attention) to check the wiring.
set -euo pipefail
OUT=${1:-runs/gpu_check}
PY=${PYTHON:-python}
DRY=${DRY_RUN:-0}
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)   # absolute: the script runs from the repository root
cd "$(dirname "$0")/.."

echo "== 1. fused attention vs ours" >&2
DRY_RUN=$DRY "$PY" - > "$OUT/attention.json" <<'PY'
import json, os
import jax, jax.numpy as jnp
from jaxformer.layers.attention import dot_product_attention, fused_attention
from jaxformer.layers.scores import attention_mask

dry = os.environ["DRY_RUN"] == "1"
if not dry and jax.default_backend() != "gpu":
  raise SystemExit(f"no GPU: JAX's backend is {jax.default_backend()}; run with DRY_RUN=1 on CPU")
dtype, tol = (jnp.float32, 1e-5) if dry else (jnp.bfloat16, 2e-2)   # relative to the largest |value|
B, T, N, H = (2, 16, 4, 8) if dry else (4, 512, 16, 64)
lengths = [T, T // 3, 1, T - 5][:B]
cases = {"causal": (N, True, False), "padding": (N, False, True), "gqa_causal_padding": (N // 4, True, True)}
results = {}
for name, (kv_heads, causal, padded) in cases.items():
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, T, N, H), dtype)
  k, v = (jax.random.normal(keys[i], (B, T, kv_heads, H), dtype) for i in (1, 2))
  d_out = jax.random.normal(keys[3], (B, T, N, H), dtype)
  pos = jnp.arange(T)[None]
  valid = jnp.arange(T)[None] < jnp.asarray(lengths)[:, None] if padded else None
  mask = attention_mask(pos, pos, valid, valid, causal, 0)
  ours = lambda q, k, v: dot_product_attention(q, k, v, mask)
  fused = lambda q, k, v: fused_attention(q, k, v, mask, is_causal=causal)

  def run(fn):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(d_out))
  errors = {}
  for part, a, b in zip(("out", "dq", "dk", "dv"), jax.jit(lambda: run(fused))(), jax.jit(lambda: run(ours))()):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    errors[part] = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
  hlo = jax.jit(lambda q, k, v: jax.grad(lambda *x: fused(*x).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)
                ).lower(q, k, v).compile().as_text()
  cudnn = "cudnn" in hlo.lower() and "fmha" in hlo.lower()
  results[name] = {"max_relative_error": errors, "equal": max(errors.values()) <= tol, "cudnn": cudnn}
ok = all(r["equal"] for r in results.values()) and (dry or all(r["cudnn"] for r in results.values()))
print(json.dumps({"backend": jax.default_backend(), "dtype": jnp.dtype(dtype).name, "tolerance": tol,
                  "cases": results, "ok": ok}))
PY
cat "$OUT/attention.json"

BF16="precision.policy=params=float32,compute=bfloat16,output=float32"
if [[ $DRY == 1 ]]; then   # toy shapes: the same commands and overrides, seconds on a CPU
  BASE=(--batch-size 8 --src-length 16 --tgt-length 16 --steps 1 --warmup 0 model.num_encoder_layers=1
        model.num_decoder_layers=1 model.d_model=64 model.d_ff=128 model.vocab_size=512 runtime.num_cpu_devices=1)
  ONE_B=(--batch-size 2 --tgt-length 64 --steps 1 --warmup 0 model.d_model=64 model.num_heads=4
         model.num_kv_heads=2 model.d_ff=128 model.num_decoder_layers=2 model.vocab_size=512 runtime.num_cpu_devices=1)
else
  BASE=(--batch-size 256 --src-length 64 --tgt-length 64 --steps 20 --warmup 3)
  ONE_B=(--batch-size 8 --tgt-length 2048 --steps 10 --warmup 2)
fi
for attention in dense fused; do
  echo "== 2. multi30k_base, $attention attention" >&2
  "$PY" -m jaxformer bench --config configs/multi30k_base.yaml --no-torch --output "$OUT/base_$attention.json" \
    "${BASE[@]}" "$BF16" model.attention="$attention" mesh.data=-1 > "$OUT/base_$attention.log"
  tail -n 12 "$OUT/base_$attention.log" | head -n 11 >&2
done
echo "== 2. decoder_1b, fused attention" >&2
"$PY" -m jaxformer bench --config configs/decoder_1b.yaml --no-torch --output "$OUT/decoder_1b.json" \
  "${ONE_B[@]}" model.attention=fused mesh.data=-1 mesh.fsdp=1 > "$OUT/decoder_1b.log"
tail -n 12 "$OUT/decoder_1b.log" | head -n 11 >&2

"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {"attention_ok": json.loads((out / "attention.json").read_text())["ok"]}
for name in ("base_dense", "base_fused", "decoder_1b"):
  r = json.loads((out / f"{name}.json").read_text())
  summary[name] = {k: r.get(k) for k in ("backend", "num_devices", "compute_dtype", "step_time_s", "tokens_per_sec",
                                         "mfu", "peak_source", "peak_memory_bytes")}
print(json.dumps(summary))
PY
