#!/usr/bin/env python
r"""What speculative decoding costs per round on this CPU, and the acceptance rate it would need
to pay: per-step timings of a target and a draft model at batch 1, from their configs with
random weights (speed does not depend on the values).

Measured, compiles excluded, medians of `--repeats` runs, `--out-len` tokens per run with EOS
ignored so every run does the same work:
  * t_target, t_draft: seconds per token of plain greedy decoding (`greedy_decode`) of each
    model, i.e. one cached decode step inside the loop;
  * verify(K): seconds of the target's cached pass over K + 1 tokens alone, in a compiled loop
    at `--out-len / 2` tokens of prefix;
  * the draft's passes: its catch-up pass over 2 tokens and K - 1 single-token passes, timed
    the same way;
  * round(K): seconds per round of `speculative_greedy` with K draft tokens. A round does the
    same work whatever is accepted (the draft's catch-up and K - 1 steps, the target's pass over
    K + 1 tokens, the bookkeeping), so it is wall time over the rounds run. How much random
    weights accept varies (none or all of it in the runs of 2026-12-06); the round's work does not.

Derived, per K, with each proposal accepted independently with probability a (Leviathan et al.
2023, eq. 1): a round keeps E(a) = (1 - a^(K+1)) / (1 - a) tokens, so the speed-up over plain
greedy is E(a) * t_target / round(K). Printed: the round's cost in target steps, the largest
possible speed-up (a = 1), the acceptance rate needed to break even and to reach 1.5x, the
verification pass's cost in target steps, the draft's share of the round, and what is left (the
round minus both: the loop's bookkeeping), from which the draft/target step ratio needed for 1.5x
at a given acceptance follows.

  PYTHONPATH=. python benchmarks/speculative_costs.py --target-config configs/multi30k_base.yaml \
      --draft-config configs/multi30k_small.yaml --draft-tokens 2 4 8

Overrides (`--target-override`, `--draft-override`, repeatable) are dotted config keys. The
runtime mode is the target config's (`runtime.deterministic`, true by default, as the CLI).
Prints a table; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.bench_decode import NO_EOS, median_seconds, random_sources
from jaxformer.config import load_config
from jaxformer.inference import cache as kv
from jaxformer.inference.decode import greedy_decode
from jaxformer.inference.speculative import speculative_greedy
from jaxformer.models.abstract import init_params
from jaxformer.runtime.startup import init_runtime
from jaxformer.tasks import get_task


def random_model(config, seed: int) -> tuple[Any, Any, int]:
  """(module, params, parameter count) of `config`'s model with random weights."""
  model = get_task(config).make_model()
  params = jax.jit(lambda key: init_params(model, key))(jax.random.key(seed))
  return model, params, sum(x.size for x in jax.tree.leaves(params))


def pass_seconds(model, params, inputs: jax.Array, width: int, prefix: int, repeats: int, calls: int = 32) -> float:
  """Median seconds of one cached pass (`kv.extend`) of the model over `width` tokens of a row
  that already holds `prefix` decoder tokens, timed over `calls` passes in one compiled loop
  (each pass's keys are undone by resetting the row's length, as a rejected round does)."""
  src_len = inputs.shape[1]

  def run(params, inputs):
    cache = kv.contiguous_cache(model, params, 1, src_len, prefix + width + 8)
    _, cache = kv.prefill(model, params, cache, inputs)
    _, cache = kv.extend(model, params, cache, jnp.tile(inputs, (1, -(-prefix // src_len)))[:, :prefix])
    lengths, tokens = cache.state.lengths, jnp.tile(inputs, (1, -(-width // src_len)))[:, :width]

    def body(_, carry):
      cache, total = carry
      logits, cache = kv.extend(model, params, cache, tokens)
      return kv.KVCache(cache.layers, cache.state.replace(lengths=lengths)), total + logits[0, -1, 0]

    return jax.lax.fori_loop(0, calls, body, (cache, jnp.float32(0)))[1]

  run = jax.jit(run)
  return median_seconds(lambda: run(params, inputs), repeats)[0] / calls


def needed_acceptance(tokens_per_round: float, k: int) -> float | None:
  """The acceptance rate a in [0, 1] at which a round of K proposals keeps `tokens_per_round`
  tokens on average (bisection on E(a), which increases from 1 to K + 1); None: not reachable."""
  if tokens_per_round > k + 1:
    return None
  low, high = 0.0, 1.0
  for _ in range(60):
    mid = (low + high) / 2
    kept = (k + 1) if mid == 1.0 else (1 - mid ** (k + 1)) / (1 - mid)
    low, high = (mid, high) if kept < tokens_per_round else (low, mid)
  return high


def main() -> None:
  """Runs the benchmark (see the module docstring)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target-config", default="configs/multi30k_base.yaml")
  parser.add_argument("--draft-config", default="configs/multi30k_small.yaml")
  parser.add_argument("--target-override", action="append", default=[], help="dotted key=value")
  parser.add_argument("--draft-override", action="append", default=[], help="dotted key=value")
  parser.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 4, 8])
  parser.add_argument("--src-len", type=int, default=16, help="source tokens (a typical Multi30k sentence)")
  parser.add_argument("--out-len", type=int, default=32, help="tokens generated per run")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  target_config = load_config(args.target_config, args.target_override)
  draft_config = load_config(args.draft_config, args.draft_override)
  init_runtime(target_config.runtime)
  target, target_params, target_size = random_model(target_config, args.seed)
  draft, draft_params, draft_size = random_model(draft_config, args.seed + 1)
  inputs = random_sources(1, args.src_len, target_config.model.vocab_size, args.seed)

  def per_token(model, params):
    run = jax.jit(lambda p, x: greedy_decode(model, p, x, args.out_len, eos_id=NO_EOS))
    return median_seconds(lambda: run(params, inputs), args.repeats)[0] / args.out_len

  t_target, t_draft = per_token(target, target_params), per_token(draft, draft_params)
  draft_step, draft_catch_up = (
    pass_seconds(draft, draft_params, inputs, w, args.out_len // 2, args.repeats) for w in (1, 2)
  )
  rows = []
  for k in args.draft_tokens:
    run = jax.jit(lambda tp, dp, x, k=k: speculative_greedy(target, tp, draft, dp, x, args.out_len, k, eos_id=NO_EOS))
    seconds, _, (_, accepted, rounds) = median_seconds(
      lambda run=run: run(target_params, draft_params, inputs), args.repeats
    )
    round_s = seconds / int(rounds[0])
    cost = round_s / t_target  # a round in target steps
    verify = pass_seconds(target, target_params, inputs, k + 1, args.out_len // 2, args.repeats)
    draft_passes = draft_catch_up + (k - 1) * draft_step
    rows.append(
      {
        "draft_tokens": k,
        "round_ms": 1e3 * round_s,
        "round_in_target_steps": cost,
        "verify_ms": 1e3 * verify,
        "verify_in_target_steps": verify / t_target,
        "draft_ms": 1e3 * draft_passes,
        "other_ms": 1e3 * (round_s - verify - draft_passes),
        "draft_share_of_round": draft_passes / round_s,
        "max_speedup": (k + 1) / cost,
        "acceptance_for_1x": needed_acceptance(cost, k),
        "acceptance_for_1_5x": needed_acceptance(1.5 * cost, k),
        "measured_acceptance": int(accepted[0]) / (k * int(rounds[0])),
      }
    )
  mode = "deterministic" if target_config.runtime.deterministic else "fast"
  print(
    f"target {target_size / 1e6:.1f}M params: {1e3 * t_target:.2f} ms/token; draft {draft_size / 1e6:.1f}M "
    f"params: {1e3 * t_draft:.2f} ms/token (draft/target step {t_draft / t_target:.2f}; its own pass over 1 token "
    f"{1e3 * draft_step:.2f} ms, over 2 {1e3 * draft_catch_up:.2f} ms); batch 1, {mode} mode"
  )
  print(
    "| K | round ms | verify ms | draft ms | other ms | round / target step | verify / target step "
    "| max speed-up | a for 1x | a for 1.5x |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")

  def show(a):
    return "unreachable" if a is None else f"{a:.2f}"

  for r in rows:
    print(
      f"| {r['draft_tokens']} | {r['round_ms']:.2f} | {r['verify_ms']:.2f} | {r['draft_ms']:.2f} | "
      f"{r['other_ms']:.2f} | {r['round_in_target_steps']:.2f} | {r['verify_in_target_steps']:.2f} | "
      f"{r['max_speedup']:.2f}x | "
      f"{show(r['acceptance_for_1x'])} | {show(r['acceptance_for_1_5x'])} |"
    )
  print(
    json.dumps(
      {
        "target_params": target_size,
        "draft_params": draft_size,
        "target_ms_per_token": 1e3 * t_target,
        "draft_ms_per_token": 1e3 * t_draft,
        "draft_step_ms": 1e3 * draft_step,
        "draft_catch_up_ms": 1e3 * draft_catch_up,
        "mode": mode,
        "rows": rows,
      }
    )
  )


if __name__ == "__main__":
  main()
