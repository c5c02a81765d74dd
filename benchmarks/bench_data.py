#!/usr/bin/env python3
"""Data benchmarks: streaming preparation of a large generated corpus, and the input pipeline
against the train step (bucketed and packed batches), each in one run.

  prepare   writes a synthetic parallel corpus of --pairs sentence pairs (two aligned text
            files; 2,000,000 pairs are about 300 MB), then prepares it (`data.dataset=files`:
            SentencePiece on a sample of --input-sentence-size sentences, tokenization into
            ArrayRecord shards) in a child process, and reports pairs/s and the child's peak RSS.
  pipeline  for `--config` (default configs/multi30k_small.yaml): the non-padding target
            tokens/s that the input pipeline delivers (`TrainBatches` / `PackedBatches`) and
            that the compiled train step consumes, bucketed and packed, steps interleaved;
            the ratio of the two; and the padding fraction of each.

Usage:
  python benchmarks/bench_data.py prepare --pairs 2000000 --dir /tmp/jaxformer-bench
  python benchmarks/bench_data.py pipeline --steps 20
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WORDS = 5000


def make_corpus(folder: Path, pairs: int, seed: int = 0) -> tuple[Path, Path]:
  """Two aligned files of `pairs` sentences of 4-24 Zipf-distributed words (the target is the
  source in reverse word order with a suffix), written in blocks; 2,000,000 pairs are about
  300 MB."""
  src, tgt = folder / f"corpus{pairs}.xx", folder / f"corpus{pairs}.yy"
  if src.is_file() and tgt.is_file():
    return src, tgt
  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  vocab = np.array(["".join(rng.choice(letters, n)) for n in rng.integers(2, 10, WORDS)])  # 2-9 letters
  with open(src, "w") as fs, open(tgt, "w") as ft:
    for start in range(0, pairs, 100_000):
      n = min(100_000, pairs - start)
      lengths = rng.integers(4, 25, n)
      ids = np.minimum(rng.zipf(1.3, lengths.sum()), WORDS) - 1
      words = np.split(vocab[ids], np.cumsum(lengths)[:-1])
      fs.write("".join(" ".join(w) + "\n" for w in words))
      ft.write("".join(" ".join(w[::-1]) + "en\n" for w in words))
  return src, tgt


def prepare(args) -> dict:
  """The `prepare` benchmark (see the module docstring): pairs/s and the child's peak RSS."""
  folder = Path(args.dir)
  src, tgt = make_corpus(folder, args.pairs)
  code = (
    "import sys, time; from jaxformer.config import config_from_dict; from jaxformer.tasks import get_task\n"
    f"c = config_from_dict({{'data': {{'dataset': 'files', 'train_files': '{src},{tgt}', "
    f"'source_lang': 'xx', 'target_lang': 'yy', 'data_dir': '{folder}/cache{args.pairs}', "
    f"'input_sentence_size': {args.input_sentence_size}}}}})\n"
    "t = time.perf_counter(); _, s = get_task(c).load_data(); print(time.perf_counter() - t, "
    "len(s['train']) + len(s['validation']))"
  )
  before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  seconds, kept = out.stdout.split()
  return {
    "pairs": args.pairs,
    "corpus_bytes": src.stat().st_size + tgt.stat().st_size,
    "kept_pairs": int(kept),
    "seconds": float(seconds),
    "pairs_per_sec": args.pairs / float(seconds),
    "peak_rss_mib": max(peak_kib, before) / 1024,
    "input_sentence_size": args.input_sentence_size,
  }


def _tokens(batch) -> int:
  return int(np.count_nonzero(batch["targets"]))


def pipeline(args) -> dict:
  """The `pipeline` benchmark (see the module docstring): tokens/s delivered and consumed."""
  import dataclasses  # noqa: PLC0415

  import jax  # noqa: PLC0415

  from jaxformer import data as D  # noqa: PLC0415
  from jaxformer import sharding as sh  # noqa: PLC0415
  from jaxformer.config import load_config  # noqa: PLC0415
  from jaxformer.runtime.startup import build_mesh  # noqa: PLC0415
  from jaxformer.tasks import get_task  # noqa: PLC0415
  from jaxformer.train.optim import make_optimizer  # noqa: PLC0415
  from jaxformer.train.state import abstract_state, create_state  # noqa: PLC0415
  from jaxformer.train.step import make_train_call  # noqa: PLC0415

  base = load_config(args.config, ["train.steps_per_call=1"])
  settings = {
    "bucketed": base,
    "packed": dataclasses.replace(
      base,
      data=dataclasses.replace(base.data, packing=True),
      train=dataclasses.replace(base.train, batch_size=args.packed_batch_size),
    ),
  }
  task = get_task(base)
  _, splits = task.load_data()
  mesh = build_mesh(base)
  model = task.make_model()
  tx = make_optimizer(base.optim, base.model.d_model)
  _, logical = abstract_state(model, tx)
  shardings = sh.logical_to_sharding(logical, mesh)
  out = {}
  runs = {}
  for name, config in settings.items():
    batches = get_task(config).make_batches(splits)[0]
    start = time.perf_counter()
    host = [batches[s] for s in range(args.steps)]
    produce = time.perf_counter() - start
    step = make_train_call(model, tx, config, mesh, shardings)
    state = create_state(model, tx, mesh, 0, shardings, 1.0)
    for shape in {tuple(b["inputs"].shape): b for b in host}.values():  # compile every shape first
      state, _ = step(state, D.global_batch(shape, mesh), jax.random.key(0))
    jax.block_until_ready(state)
    runs[name] = [step, state, host, []]
    out[name] = {
      "pipeline_tokens_per_sec": sum(map(_tokens, host)) / produce,
      "padding_fraction": float(np.mean([D.padding_fraction(b) for b in host])),
      "batch_size": config.train.batch_size,
      "tokens_per_step": float(np.mean([_tokens(b) for b in host])),
    }
  for i in range(args.steps):  # interleaved, so background load hits both alike
    for run in runs.values():
      step, state, host, times = run
      batch = D.global_batch(host[i], mesh)
      start = time.perf_counter()
      state, metrics = step(state, batch, jax.random.key(0))
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
      run[1] = state
  for name, (_, _, _, times) in runs.items():
    step_time = statistics.median(times)
    consumed = out[name]["tokens_per_step"] / step_time
    out[name].update(
      step_time_s=step_time,
      train_tokens_per_sec=consumed,
      pipeline_over_train=out[name]["pipeline_tokens_per_sec"] / consumed,
    )
  out["packed_over_bucketed_train_tokens_per_sec"] = (
    out["packed"]["train_tokens_per_sec"] / out["bucketed"]["train_tokens_per_sec"]
  )
  return out


def main() -> None:
  """Runs the benchmark the command line names and prints its JSON result."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  pr = sub.add_parser("prepare")
  pr.add_argument("--pairs", type=int, default=2_000_000)
  pr.add_argument("--dir", default="/tmp/jaxformer-bench-data")
  pr.add_argument("--input-sentence-size", type=int, default=200_000)
  pi = sub.add_parser("pipeline")
  pi.add_argument("--config", default="configs/multi30k_small.yaml")
  pi.add_argument("--steps", type=int, default=20)
  pi.add_argument("--packed-batch-size", type=int, default=32, help="rows of data.max_length per packed batch")
  args = p.parse_args()
  print(json.dumps(prepare(args) if args.command == "prepare" else pipeline(args), indent=1), flush=True)


if __name__ == "__main__":
  main()
