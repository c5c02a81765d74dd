#!/usr/bin/env python
r"""Speculative decoding on test2016: acceptance rate and speed of greedy decoding with a draft
model against plain greedy decoding of the same target, compiles excluded (one warm-up batch
per shape), at several batch sizes; checks the hypotheses are identical.

  PYTHONPATH=. python benchmarks/bench_speculative.py --workdir runs/main_check --draft-workdir runs/draft \
      --sentences 200 --batch-sizes 1 16 --draft-tokens 2 4

Prints a table; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json

from jaxformer.inference import restore as inference_restore
from jaxformer.tasks import evaluate, get_task
from jaxformer.tasks.base import EvalOptions


def main() -> None:
  """Runs the benchmark (see the module docstring)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="the target model's workdir")
  parser.add_argument("--draft-workdir", required=True, help="a smaller model with the same tokenizer")
  parser.add_argument("--sentences", type=int, default=200, help="the first N test2016 sentences")
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
  parser.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 4])
  args = parser.parse_args()

  config = inference_restore.workdir_config(args.workdir)
  target = inference_restore.restore(args.workdir, config)
  _, sources, _ = get_task(config).eval_texts(EvalOptions(split="test", workdir=args.workdir))
  sources = sources[: args.sentences]
  rows = []
  for batch in args.batch_sizes:
    plain, speed = evaluate.decode_sources(target, sources, batch, warmup=True)
    base = {"batch_size": batch, "draft_tokens": 0, "sentences_per_sec": speed["sentences_per_sec"]}
    rows.append(base)
    for k in args.draft_tokens:
      draft = inference_restore.restore_draft(args.draft_workdir, target, num_tokens=k)
      fast, speed = evaluate.decode_sources(target, sources, batch, warmup=True, draft=draft)
      same = all((a["tokens"] == b["tokens"]).all() for a, b in zip(plain, fast))
      rows.append(
        {
          "batch_size": batch,
          "draft_tokens": k,
          "sentences_per_sec": speed["sentences_per_sec"],
          "draft_acceptance": speed["draft_acceptance"],
          "identical": bool(same),
          "speedup": speed["sentences_per_sec"] / base["sentences_per_sec"],
        }
      )
  print("| batch | draft tokens k | sentences/s | acceptance | speed-up | identical |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['batch_size']} | {r['draft_tokens'] or '- (plain greedy)'} | {r['sentences_per_sec']:.2f} | "
      f"{r.get('draft_acceptance', float('nan')):.2f} | {r.get('speedup', 1.0):.2f}x | {r.get('identical', '')} |"
    )
  print(json.dumps({"sentences": len(sources), "rows": rows}))


if __name__ == "__main__":
  main()
