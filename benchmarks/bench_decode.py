#!/usr/bin/env python
"""Decoding benchmark: KV-cached greedy decoding against recomputing the prefix, and (with
--workdir of a trained run) greedy and beam-search throughput on test2016 plus how often
beam search finds a better hypothesis than greedy on its own objective.

Speed part (always): the same batch of random sources, `--out-len` (64) tokens generated
per row by both paths, EOS ignored so both run exactly `--out-len` steps:
  * cached:    `jaxformer.inference.decode.greedy_decode` (prefill, then one token per step through the
               KV cache inside `lax.while_loop`);
  * recompute: a jitted `lax.fori_loop` that runs the decoder over the whole padded prefix
               `[batch, out_len]` every step without a cache and reads the logits at the step's
               position (the encoder runs once, as in the cached path).
Both are compiled before timing; each time is the median of `--repeats` runs. Params come
from --workdir, else a random init of --config (speed does not depend on the values).

test2016 part (with --workdir): `jaxformer.evaluate.decode_sources` with greedy search and
beam search (`--beam-size`, length penalty `--alpha`), compiles excluded (one warm-up batch
per shape), giving sentences/s and generated tokens/s (EOS included). Every hypothesis is
then scored by `jaxformer.evaluate.hypothesis_scores` (sum log p / length penalty, beam
search's objective); `beam_ge_greedy_fraction` is the share of sentences where beam's score
is >= greedy's (within `--tolerance`).

  PYTHONPATH=. nice -n 19 python benchmarks/bench_decode.py --workdir runs/long > bench.txt

Prints a table; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import sharding as sh
from jaxformer.config import load_config
from jaxformer.inference import restore as inference_restore
from jaxformer.inference.decode import SearchOptions, greedy_decode
from jaxformer.inference.search import LENGTH_PENALTY
from jaxformer.models.transformer import BOS_ID, EncoderDecoder
from jaxformer.tasks import evaluate, get_task

NO_EOS = -1  # an id no argmax can return: decoding runs the full output length


def recompute_greedy(model: nn.Module, params: Any, inputs: jax.Array, out_len: int) -> jax.Array:
  """Greedy decoding without a KV cache (the baseline): step i runs the decoder over the
  whole padded prefix buffer int32 `[batch, out_len]` (BOS, the tokens so far, then PAD;
  the causal mask hides the rest) and takes the argmax of position i's logits.

  Returns int32 `[batch, out_len]`; EOS does not stop it.
  """
  batch = inputs.shape[0]
  encoded = model.apply({"params": params}, inputs, method="encode")
  prefix = jnp.zeros((batch, out_len), jnp.int32).at[:, 0].set(BOS_ID)

  def step(i, carry):
    prefix, out = carry
    logits = model.apply({"params": params}, encoded, inputs, prefix, method="decode")  # [B, out_len, V]
    token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False), axis=-1)
    token = token.astype(jnp.int32)
    out = out.at[:, i].set(token)
    prefix = prefix.at[:, i + 1].set(token, mode="drop")  # the last step has no next slot
    return prefix, out

  return jax.lax.fori_loop(0, out_len, step, (prefix, jnp.zeros((batch, out_len), jnp.int32)))[1]


def median_seconds(fn: Callable[[], jax.Array], repeats: int) -> tuple[float, float, jax.Array]:
  """Median wall seconds and median process CPU seconds (all threads) of `repeats` calls
  after one untimed compile/warm-up call, and the last output. CPU seconds are the steadier
  figure on a shared machine, where wall time depends on what else runs."""
  out = jax.block_until_ready(fn())
  wall, cpu = [], []
  for _ in range(repeats):
    start, start_cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn())
    wall.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  return statistics.median(wall), statistics.median(cpu), out


def random_sources(batch: int, src_len: int, vocab: int, seed: int) -> jax.Array:
  """int32 `[batch, src_len]`: random ids >= 4 (no special tokens), no padding."""
  return jnp.asarray(np.random.default_rng(seed).integers(4, vocab, (batch, src_len)), jnp.int32)


def speed(model: nn.Module, params: Any, args) -> dict[str, Any]:
  """Cached vs recompute greedy decoding of `args.out_len` tokens for one batch."""
  inputs = random_sources(args.batch_size, args.src_len, model.config.vocab_size, args.seed)
  cached = jax.jit(lambda p, x: greedy_decode(model, p, x, args.out_len, eos_id=NO_EOS))
  recompute = jax.jit(lambda p, x: recompute_greedy(model, p, x, args.out_len))
  cached_s, cached_cpu_s, cached_out = median_seconds(lambda: cached(params, inputs), args.repeats)
  recompute_s, recompute_cpu_s, recompute_out = median_seconds(lambda: recompute(params, inputs), args.repeats)
  tokens = args.batch_size * args.out_len
  return {
    "batch_size": args.batch_size,
    "src_len": args.src_len,
    "out_len": args.out_len,
    "repeats": args.repeats,
    "cached_s": cached_s,
    "recompute_s": recompute_s,
    "speedup": recompute_s / cached_s,
    "cached_cpu_s": cached_cpu_s,
    "recompute_cpu_s": recompute_cpu_s,
    "speedup_cpu": recompute_cpu_s / cached_cpu_s,
    "cached_tokens_per_s": tokens / cached_s,
    "recompute_tokens_per_s": tokens / recompute_s,
    # Same argmax path in both: tokens agree up to float rounding on near-ties.
    "same_tokens_fraction": float(np.mean(np.asarray(cached_out) == np.asarray(recompute_out))),
  }


def compare_on_split(restored: inference_restore.Restored, sources: list[str], args) -> dict[str, Any]:
  """Greedy and beam search over `sources`: speed, and beam vs greedy on beam's objective."""
  out: dict[str, Any] = {"num_sentences": len(sources), "batch_size": args.eval_batch_size}
  runs = {}
  for name, options in (
    ("greedy", SearchOptions()),
    (f"beam{args.beam_size}", SearchOptions(beam_size=args.beam_size, length_penalty=args.alpha)),
  ):
    batches, stats = evaluate.decode_sources(restored, sources, args.eval_batch_size, options, warmup=True)
    runs[name] = batches
    out[name] = {k: round(v, 3) for k, v in stats.items()}
  model, mesh = restored.model, restored.mesh
  score = jax.jit(lambda p, x, t: evaluate.hypothesis_scores(model, p, x, t, args.alpha))
  scores = {name: [] for name in runs}
  rows = sh.batch_sharding(mesh, rules=restored.rules)
  with sh.bind(mesh, restored.rules):
    for name, batches in runs.items():
      for b in batches:
        s = np.asarray(score(restored.params, jax.device_put(b["inputs"], rows), jax.device_put(b["tokens"], rows)))
        scores[name].append(s[b["index"] >= 0])
  greedy, beam = (np.concatenate(v) for v in scores.values())
  same = np.concatenate([np.all(g["tokens"] == k["tokens"], axis=1)[g["index"] >= 0] for g, k in zip(*runs.values())])
  out.update(
    alpha=args.alpha,
    tolerance=args.tolerance,
    beam_ge_greedy_fraction=float(np.mean(beam >= greedy - args.tolerance)),
    beam_gt_greedy_fraction=float(np.mean(beam > greedy + args.tolerance)),
    same_output_fraction=float(np.mean(same)),
    mean_score_greedy=float(greedy.mean()),
    mean_score_beam=float(beam.mean()),
  )
  return out


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--config", default="configs/multi30k_small.yaml", help="model shape when --workdir is not given")
  p.add_argument("--workdir", help="trained run: its params for the speed part, and the test2016 part")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  p.add_argument("--batch-size", type=int, default=32, help="rows per batch in the speed part (both paths)")
  p.add_argument("--eval-batch-size", type=int, default=64, help="sentences per batch on test2016 (as `eval`)")
  p.add_argument("--src-len", type=int, default=20, help="source tokens per row in the speed part")
  p.add_argument("--out-len", type=int, default=64, help="tokens generated per row in the speed part")
  p.add_argument("--repeats", type=int, default=5, help="timed runs per path (median reported)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--beam-size", type=int, default=4)
  p.add_argument("--alpha", type=float, default=LENGTH_PENALTY, help="length penalty of beam search and scoring")
  p.add_argument("--tolerance", type=float, default=1e-5, help="score slack for beam >= greedy (float rounding)")
  p.add_argument("--num-sentences", type=int, default=None, help="first N test2016 sentences only (default: all)")
  p.add_argument("--skip-test-split", action="store_true", help="with --workdir: speed part only")
  return p


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark (see the module docstring); returns the exit status."""
  args = _parser().parse_args(argv)
  result: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "num_devices": jax.device_count()}
  if args.workdir:
    config = inference_restore.workdir_config(args.workdir)
    restored = inference_restore.restore(args.workdir, config, args.step)
    model, params = restored.model, restored.params
    result.update(workdir=args.workdir, step=restored.step)
  else:
    config = load_config(args.config)
    model = EncoderDecoder(config.model)
    src = jnp.ones((1, args.src_len), jnp.int32)
    params = jax.jit(lambda k: nn.meta.unbox(model.init(k, src, src)["params"]))(jax.random.key(args.seed))
  if not 1 <= args.out_len <= config.model.max_length:
    print(f"error: --out-len must be in [1, model.max_length={config.model.max_length}]", file=sys.stderr)
    return 2
  result["model"] = config.name
  result.update(speed(model, params, args))
  print(f"| greedy, {args.out_len} tokens x {args.batch_size} rows | median wall s | median CPU s | tokens/s (wall) |")
  print("|---|---|---|---|")
  for name, key in (("KV cache", "cached"), ("recompute prefix", "recompute")):
    print(f"| {name} | {result[key + '_s']:.3f} | {result[key + '_cpu_s']:.3f} | {result[key + '_tokens_per_s']:.0f} |")
  print(
    f"speedup {result['speedup']:.1f}x wall, {result['speedup_cpu']:.1f}x CPU; "
    f"same tokens {result['same_tokens_fraction']:.3f}",
    flush=True,
  )
  if args.workdir and not args.skip_test_split:
    sources = get_task(config).load_data()[1]["test"].source_texts[: args.num_sentences]
    test = compare_on_split(restored, sources, args)
    result["test2016"] = test
    print(f"\n| test2016 ({test['num_sentences']} sentences) | sentences/s | tokens/s | mean score |")
    print("|---|---|---|---|")
    for name in ("greedy", f"beam{args.beam_size}"):
      mean = test["mean_score_greedy" if name == "greedy" else "mean_score_beam"]
      print(f"| {name} | {test[name]['sentences_per_sec']:.1f} | {test[name]['tokens_per_sec']:.0f} | {mean:.4f} |")
    print(
      f"beam{args.beam_size} score >= greedy on {test['beam_ge_greedy_fraction']:.3f} of sentences "
      f"(> on {test['beam_gt_greedy_fraction']:.3f}; same output on {test['same_output_fraction']:.3f})"
    )
  print(json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
