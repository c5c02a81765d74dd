"""Where a train step's memory goes, per batch shape: what each compiled executable keeps resident
and what one call of it allocates (XLA's temporary buffers), for the bucket lengths a run compiles.

For each `--lengths` L (source and target length L, `--batch-size` rows, the config's mesh on the
local devices) the script lowers and compiles the train step as `jaxformer bench` does, and keeps
the executable alive. It reports:

- `resident MiB`: the growth of the process's RSS over the compile, after `malloc_trim(0)` (the
  part the executable keeps, as in a `jaxformer train` that has compiled that bucket length);
- `temp MiB`: XLA's `temp_size_in_bytes`, the buffers one call of that executable allocates and
  frees (activations kept for the backward pass, the logits and their gradient, ...);
- `args MiB`: the train state and batch passed in.

Each `--variant` (a list of `key=value` overrides, `;`-separated) is compiled at the longest
length only, to split the temporaries between their causes: for example a smaller vocabulary
(the logits' share) or fewer layers (a layer's share). Sizes do not depend on machine load.

  python benchmarks/train_step_memory.py --config configs/multi30k_small.yaml --lengths 12,20,32,64 \
      --variant "model.vocab_size=512;model.num_encoder_layers=1,model.num_decoder_layers=1"
"""

from __future__ import annotations

import argparse
import json
import os
import time

from main_job_memory import rss_mib

from jaxformer.bench.step import BenchOptions, prepare_step
from jaxformer.config import load_config
from jaxformer.runtime.host_memory import release_free_memory
from jaxformer.runtime.startup import init_runtime

MIB = 2**20


def _compile(config, batch_size: int, length: int):
  options = BenchOptions(batch_size, src_length=length, tgt_length=length, steps=1, warmup=0, peer=False)
  prepared = prepare_step(config, options.validate(config.model))
  start = time.perf_counter()
  compiled = prepared.lowered.compile()
  return compiled, time.perf_counter() - start


def main() -> None:
  """Parses the flags, compiles the train step per length and per variant, prints both tables and a JSON line."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/multi30k_small.yaml")
  parser.add_argument("--lengths", default="12,20,32,64", help="comma-separated source = target lengths")
  parser.add_argument("--batch-size", type=int, default=None, help="rows per batch (default: train.batch_size)")
  parser.add_argument("--variant", default="", help="';'-separated variants, each ','-separated key=value overrides")
  parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every compile")
  args = parser.parse_args()
  config = load_config(args.config, args.overrides)
  init_runtime(config.runtime)  # as `jaxformer train`: malloc arenas, the XLA flags of runtime.deterministic
  batch_size = args.batch_size or config.train.batch_size
  lengths = [int(x) for x in args.lengths.split(",")]

  kept, rows = [], []
  release_free_memory()
  before = rss_mib(os.getpid())
  for length in lengths:
    compiled, seconds = _compile(config, batch_size, length)
    kept.append(compiled)  # alive, as in a run that has compiled this length
    release_free_memory()
    after = rss_mib(os.getpid())
    m = compiled.memory_analysis()
    rows.append(
      {
        "length": length,
        "resident_mib": round(after - before, 1),
        "temp_mib": round(m.temp_size_in_bytes / MIB, 1),
        "args_mib": round(m.argument_size_in_bytes / MIB, 1),
        "compile_s": round(seconds, 1),
      }
    )
    before = after
  variants = []
  for text in filter(None, args.variant.split(";")):
    overrides = [*args.overrides, *text.split(",")]
    compiled, _ = _compile(load_config(args.config, overrides), batch_size, lengths[-1])
    variants.append({"overrides": text, "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / MIB, 1)})
    del compiled

  print(f"train step of {args.config}, batch {batch_size}, on the config's mesh\n")
  print("| length | resident MiB (executable) | temp MiB (one call) | args MiB | compile s |")
  print("|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['length']} | {r['resident_mib']} | {r['temp_mib']} | {r['args_mib']} | {r['compile_s']} |")
  if variants:
    print(f"\n| variant at length {lengths[-1]} | temp MiB |\n|---|---:|\n| as configured | {rows[-1]['temp_mib']} |")
    for v in variants:
      print(f"| {v['overrides']} | {v['temp_mib']} |")
  print(json.dumps({"config": args.config, "batch_size": batch_size, "lengths": rows, "variants": variants}))


if __name__ == "__main__":
  main()
