#!/usr/bin/env python
"""Long-context extrapolation of RoPE: trains the character LM (configs/shakespeare_char.yaml
with model.position=rope) at context 64, then reports validation perplexity over the whole
validation split in windows of 64, 128, 256 and 512 tokens with each `model.rope_scaling`
(factor = length / 64 for the scalings). Then fine-tunes a copy of the model for a few steps at
the longer length with each scaling (factor = that length / 64; interpolation's documented use,
Chen et al. 2023) and evaluates again with that factor.

  PYTHONPATH=. python benchmarks/bench_extrapolation.py --root runs/extrap

A finished run (base or fine-tune) is reused. Prints a Markdown table; the last stdout line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from jaxformer.checkpoint import run_files as rf
from jaxformer.config import config_from_dict, dump_config, load_config, to_dict
from jaxformer.inference.restore import restore
from jaxformer.tasks import get_task
from jaxformer.tasks.base import EvalOptions

SCALINGS = ("none", "linear", "ntk", "yarn")


def _train(workdir: Path, overrides: list[str]) -> None:
  cmd = [
    sys.executable,
    "-m",
    "jaxformer",
    "train",
    "--config",
    "configs/shakespeare_char.yaml",
    "--workdir",
    str(workdir),
    *overrides,
  ]
  print("+", " ".join(cmd), file=sys.stderr, flush=True)
  subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _scaled(model: dict, scaling: str, factor: float, trained: int) -> dict:
  return dict(
    model, rope_scaling=scaling, rope_scaling_factor=factor if scaling != "none" else 1.0, rope_trained_length=trained
  )


def _perplexity(workdir: Path, scaling: str, factor: float, trained: int, length: int) -> float:
  """Validation perplexity of the workdir's model in windows of `length` tokens."""
  saved = to_dict(load_config(rf.run_file(workdir, rf.CONFIG_FILE)))
  saved.pop("mesh")
  saved["model"] = _scaled(saved["model"], scaling, factor, trained)
  saved["data"]["max_length"] = length
  config = config_from_dict(saved)
  result = get_task(config).evaluate(lambda: restore(workdir, config), EvalOptions(split="val", workdir=str(workdir)))
  return float(result["perplexity"])


def main() -> None:
  """Runs the benchmark (see the module docstring)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--root", default="runs/extrap", help="folder of the base and fine-tuned workdirs")
  parser.add_argument("--trained", type=int, default=64, help="training context, tokens")
  parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
  parser.add_argument("--finetune-length", type=int, default=256)
  parser.add_argument("--finetune-steps", type=int, default=150)
  parser.add_argument("overrides", nargs="*", help="extra overrides of the base run, e.g. train.num_steps=1000")
  args = parser.parse_args()
  root, longest = Path(args.root), max(args.lengths)
  base = root / "base"
  _train(
    base, ["model.position=rope", f"model.max_length={longest}", f"data.max_length={args.trained}", *args.overrides]
  )
  base_steps = load_config(rf.run_file(base, rf.CONFIG_FILE)).train.num_steps
  rows = []
  for scaling in SCALINGS:
    ppl = {n: _perplexity(base, scaling, max(1.0, n / args.trained), args.trained, n) for n in args.lengths}
    rows.append({"model": f"trained at {args.trained}", "scaling": scaling, "perplexity": ppl})
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  factor = args.finetune_length / args.trained
  for scaling in SCALINGS:
    tuned = root / f"finetune_{scaling}"
    if not tuned.exists():  # start from the base run's checkpoint, the scaling recorded in its config
      shutil.copytree(base, tuned)
      config = load_config(tuned / rf.CONFIG_FILE)
      tree = to_dict(config)
      tree["model"] = _scaled(tree["model"], scaling, factor, args.trained)
      text = dump_config(config_from_dict(tree))
      (tuned / "config.yaml.tmp").write_text(text)
      (tuned / "config.yaml.tmp").rename(tuned / rf.CONFIG_FILE)
    _train(
      tuned,
      [
        "model.position=rope",
        f"model.max_length={longest}",
        f"data.max_length={args.finetune_length}",
        f"model.rope_scaling={scaling}",
        f"model.rope_scaling_factor={factor if scaling != 'none' else 1.0}",
        f"model.rope_trained_length={args.trained}",
        f"train.num_steps={base_steps + args.finetune_steps}",
        *args.overrides,
      ],
    )
    ppl = {n: _perplexity(tuned, scaling, factor, args.trained, n) for n in args.lengths}
    rows.append(
      {"model": f"+{args.finetune_steps} steps at {args.finetune_length}", "scaling": scaling, "perplexity": ppl}
    )
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  print("| model | rope_scaling | " + " | ".join(f"ppl @ {n}" for n in args.lengths) + " |")
  print("|---|---|" + "---|" * len(args.lengths))
  for r in rows:
    print(f"| {r['model']} | {r['scaling']} | " + " | ".join(f"{r['perplexity'][n]:.2f}" for n in args.lengths) + " |")
  print(json.dumps({"trained": args.trained, "finetune_length": args.finetune_length, "rows": rows}))


if __name__ == "__main__":
  main()
