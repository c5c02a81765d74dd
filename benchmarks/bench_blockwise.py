#!/usr/bin/env python
"""Causal blockwise attention on one device against dense attention: the time of the forward
pass and of the forward and backward passes together, and XLA's temporary memory for the
gradient, at several sequence lengths.

Both run in this process on the same random q, k, v (batch 1, float32), jitted, in alternating
rounds; each figure is the median over the rounds. Dense attention builds the `[T, T]` scores,
so it is the time and memory that blockwise attention saves on; above `--dense-max` tokens only
blockwise runs. `runtime.deterministic`'s XLA flags and thread count apply (the CLI's default).

  PYTHONPATH=. python benchmarks/bench_blockwise.py --lengths 1024,2048,4096,8192 --rounds 5

Prints a Markdown table; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _timed(fn, *args) -> float:
  """Seconds of one call of a compiled function."""
  import jax

  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def main() -> None:
  """Runs the benchmark (see the module docstring)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", default="1024,2048,4096,8192", help="sequence lengths, comma-separated")
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--head-dim", type=int, default=32)
  parser.add_argument("--block-size", type=int, default=256, help="model.attention_block_size")
  parser.add_argument("--rounds", type=int, default=5, help="timed calls of each function, alternating")
  parser.add_argument("--dense-max", type=int, default=4096, help="longest length dense attention runs at")
  args = parser.parse_args()

  from jaxformer.runtime.startup import pin_cpu_numerics

  os.environ["JAX_PLATFORMS"] = "cpu"  # a CPU benchmark: no probing for TPU chips
  pin_cpu_numerics(os.cpu_count() or 1)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxformer.layers.blockwise import blockwise_attention
  from jaxformer.layers.dot_product import dot_product_attention
  from jaxformer.layers.scores import attention_mask

  rows = []
  for length in (int(n) for n in args.lengths.split(",")):
    draws = np.random.default_rng(length).normal(size=(4, 1, length, args.heads, args.head_dim))
    q, k, v, d_out = (jnp.asarray(x, jnp.float32) for x in draws)
    pos = jnp.arange(length)[None]

    def blockwise(q, k, v, pos=pos):
      return blockwise_attention(q, k, v, q_positions=pos, kv_positions=pos, causal=True, block_size=args.block_size)

    def dense(q, k, v, pos=pos):
      return dot_product_attention(q, k, v, attention_mask(pos, pos, None, None, True, 0))

    impls = {"blockwise": blockwise, **({"dense": dense} if length <= args.dense_max else {})}
    fns = {}
    for name, attend in impls.items():
      grads = jax.jit(lambda q, k, v, d, attend=attend: jax.vjp(attend, q, k, v)[1](d)).lower(q, k, v, d_out).compile()
      fns[name] = (jax.jit(attend).lower(q, k, v).compile(), grads, grads.memory_analysis())
    times = {(name, part): [] for name in fns for part in ("forward", "backward")}
    for _ in range(args.rounds + 1):  # the first round warms up and is not counted
      for name, (forward, grads, _) in fns.items():
        times[(name, "forward")].append(_timed(forward, q, k, v))
        times[(name, "backward")].append(_timed(grads, q, k, v, d_out))
    for name, (_, _, memory) in fns.items():
      rows.append(
        {
          "length": length,
          "attention": name,
          "forward_ms": statistics.median(times[(name, "forward")][1:]) * 1e3,
          "forward_backward_ms": statistics.median(times[(name, "backward")][1:]) * 1e3,
          "gradient_temp_mib": memory.temp_size_in_bytes / 2**20,
        }
      )
  print("| length | attention | forward ms | forward + backward ms | gradient temporaries MiB |")
  print("|---:|---|---:|---:|---:|")
  for r in rows:
    print(
      f"| {r['length']} | {r['attention']} | {r['forward_ms']:.1f} | {r['forward_backward_ms']:.1f} "
      f"| {r['gradient_temp_mib']:.1f} |"
    )
  print(json.dumps({"heads": args.heads, "head_dim": args.head_dim, "block_size": args.block_size, "rows": rows}))


if __name__ == "__main__":
  main()
