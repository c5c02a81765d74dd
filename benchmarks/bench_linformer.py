#!/usr/bin/env python
"""Linformer against dense attention on the masked LM (configs/shakespeare_mlm.yaml, context
128) at the same budget: trains each (reusing a finished run), then reports `jaxformer eval`'s
validation loss and accuracy over the masked tokens.

  PYTHONPATH=. python benchmarks/bench_linformer.py --root runs/linformer --steps 1000 --k 32

Prints a Markdown table; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def _cli(*args: str) -> str:
  cmd = [sys.executable, "-m", "jaxformer", *args]
  print("+", " ".join(cmd), file=sys.stderr, flush=True)
  return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main() -> None:
  """Runs the benchmark (see the module docstring)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--root", default="runs/linformer", help="folder of the two workdirs")
  parser.add_argument("--steps", type=int, default=1000, help="training steps of each run")
  parser.add_argument("--k", type=int, default=32, help="model.linformer_k")
  args = parser.parse_args()
  budget = [f"train.num_steps={args.steps}", f"optim.decay_steps={args.steps}"]
  runs = {"dense": [], f"linformer k={args.k}": ["model.attention=linformer", f"model.linformer_k={args.k}"]}
  rows = []
  for (name, overrides), folder in zip(runs.items(), ("dense", f"k{args.k}")):
    workdir = Path(args.root) / folder
    _cli("train", "--config", "configs/shakespeare_mlm.yaml", "--workdir", str(workdir), *budget, *overrides)
    result = json.loads(_cli("eval", "--workdir", str(workdir)).strip().splitlines()[-1])
    rows.append({"attention": name, "step": result["step"], "loss": result["loss"], "accuracy": result["accuracy"]})
  print("| attention | steps | val loss (masked) | val accuracy (masked) |")
  print("|---|---|---|---|")
  for r in rows:
    print(f"| {r['attention']} | {r['step']} | {r['loss']:.3f} | {r['accuracy']:.3f} |")
  print(json.dumps({"rows": rows}))


if __name__ == "__main__":
  main()
