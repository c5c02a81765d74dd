#!/usr/bin/env python3
r"""Runs `jaxformer bench` over a matrix of settings, each in its own process (the simulated
CPU device count is fixed when JAX starts), prints one table and writes every result as JSON.

Matrices:
  targets  multi30k_small (batch 64, 32 + 32 tokens) against torch.nn.Transformer, one and four
           steps per jitted call (train.steps_per_call=4), and the multi30k_base step's MFU;
           checks the targets (>= 1.2x torch tokens/s, MFU >= 55%).
  remat    multi30k_base at source and target length 512 with model.scan_layers=true for each
           --remat policy (model.remat=...): temporary memory saved and extra step time against `none`.
  mesh     multi30k_small on 1, 2 and 4 simulated CPU devices, every data x fsdp x tensor
           shape: tokens/s and the first steps' losses, which must match across meshes.
  custom   only the --variant rows.

Examples:
  benchmarks/benchmark.py targets --output runs/bench_targets.json
  benchmarks/benchmark.py remat --remat none full save_dots --batch-size 4
  benchmarks/benchmark.py custom \
      --variant 'bf16: --config configs/multi30k_small.yaml precision.policy=compute=bfloat16'
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--config", str(ROOT / "configs" / "multi30k_small.yaml")]
BASE = ["--config", str(ROOT / "configs" / "multi30k_base.yaml")]


def mesh_shapes(num_devices: int) -> list[tuple[int, int, int]]:
  """Every (data, fsdp, tensor) whose product is `num_devices`."""
  return [
    (d, f, num_devices // (d * f))
    for d, f in itertools.product(range(1, num_devices + 1), repeat=2)
    if num_devices % (d * f) == 0
  ]


def matrix_rows(args) -> list[tuple[str, list[str]]]:
  """(row name, `jaxformer bench` arguments) of the chosen matrix plus any --variant rows."""
  timing = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
  rows: list[tuple[str, list[str]]] = []
  if args.matrix == "targets":
    rows += [
      ("small vs torch", SMALL + ["--batch-size", "64"] + timing),
      ("small 4/call vs torch", SMALL + ["--batch-size", "64"] + timing + ["train.steps_per_call=4"]),
      ("base MFU", BASE + ["--batch-size", str(args.batch_size or 32), "--no-torch"] + timing),
    ]
  elif args.matrix == "remat":
    shape = ["--batch-size", str(args.batch_size or 4), "--src-length", "512", "--tgt-length", "512", "--no-torch"]
    # Layers under nn.scan: XLA:CPU merges an unrolled stack's recomputation back into the
    # forward pass (no memory saved there); the scan loop keeps them apart, as on GPU/TPU.
    rows += [
      (
        f"remat={policy}",
        BASE + shape + timing + ["model.max_length=512", "model.scan_layers=true", f"model.remat={policy}"],
      )
      for policy in args.remat
    ]
  elif args.matrix == "mesh":
    for n in (1, 2, 4):
      for d, f, t in mesh_shapes(n):
        rows.append(
          (
            f"{n} dev {d}x{f}x{t}",
            SMALL
            + ["--batch-size", str(args.batch_size or 64), "--no-torch"]
            + timing
            + [f"runtime.num_cpu_devices={n}", f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.tensor={t}"],
          )
        )
  for variant in args.variant:
    name, _, rest = variant.partition(":")
    rows.append((name.strip(), timing + shlex.split(rest)))
  return rows


def run_row(name: str, bench_args: list[str]) -> dict:
  """One `jaxformer bench` process; its last stdout line (JSON), or the error it printed."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  env.pop("XLA_FLAGS", None)  # the device count comes from runtime.num_cpu_devices
  print(f"[{name}] jaxformer bench {' '.join(bench_args)}", file=sys.stderr, flush=True)
  proc = subprocess.run(
    [sys.executable, "-m", "jaxformer", "bench", *bench_args], capture_output=True, text=True, env=env, cwd=ROOT
  )
  lines = proc.stdout.strip().splitlines()
  if proc.returncode != 0 or not lines:
    error = (proc.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("error: ")
    print(f"[{name}] failed: {error}", file=sys.stderr, flush=True)
    return {"name": name, "error": error}
  return {"name": name, **json.loads(lines[-1])}


def _fmt(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def format_rows(results: list[dict]) -> str:
  """One line per row: speed, MFU, memory, compile time, the torch ratio and the first losses."""
  header = (
    f"{'row':<20} {'tokens/s':>9} {'step ms':>8} {'MFU':>6} {'temp MB':>8} {'compile s':>9} "
    f"{'torch tok/s':>11} {'ratio':>6}  first losses"
  )
  lines = [header]
  for r in results:
    if "error" in r:
      lines.append(f"{r['name']:<20} error: {r['error']}")
      continue
    temp = r.get("temp_memory_bytes")
    lines.append(
      f"{r['name']:<20} {r['tokens_per_sec']:>9.0f} {r['step_time_s'] * 1e3:>8.0f} {_fmt(r['mfu'], '>6.1%')} "
      f"{_fmt(temp and temp / 2**20, '>8.1f')} {r['compile_time_s']:>9.1f} "
      f"{_fmt(r.get('torch_tokens_per_sec'), '>11.0f')} {_fmt(r.get('jax_over_torch'), '>6.2f')}  "
      + " ".join(f"{x:.4f}" for x in r["losses"][:3])
    )
  return "\n".join(lines)


def summarise(matrix: str, results: list[dict]) -> list[str]:
  """The matrix's conclusions: targets met, remat savings, or loss agreement across meshes."""
  ok = [r for r in results if "error" not in r]
  notes = []
  if matrix == "targets":
    for r in ok:
      if "jax_over_torch" in r:
        notes.append(
          f"{r['name']}: {r['jax_over_torch']:.2f}x torch tokens/s (target >= 1.2x): "
          f"{'met' if r['jax_over_torch'] >= 1.2 else 'missed'}"
        )
      elif r["config"] == "multi30k_base" and r["mfu"] is not None:
        notes.append(f"{r['name']}: MFU {r['mfu']:.1%} (target >= 55%): {'met' if r['mfu'] >= 0.55 else 'missed'}")
  elif matrix == "remat":
    none = next((r for r in ok if r["name"] == "remat=none"), None)
    for r in ok:
      if none is not None and r is not none:
        cut = 1 - r["temp_memory_bytes"] / none["temp_memory_bytes"]
        extra = r["step_time_s"] / none["step_time_s"] - 1
        notes.append(f"{r['name']}: temp memory {cut:+.1%} cut, step time {extra:+.1%} vs remat=none")
  elif matrix == "mesh" and ok:
    first = ok[0]
    n = min(len(r["losses"]) for r in ok)
    worst = max(abs(a - b) for r in ok for a, b in zip(r["losses"][:n], first["losses"][:n]))
    notes.append(f"largest loss difference from {first['name']} over the first {n} steps: {worst:.2e}")
  return notes


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark matrix the command line names; returns the exit status."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("matrix", choices=("targets", "remat", "mesh", "custom"))
  p.add_argument("--steps", type=int, default=10, help="timed steps per row (median reported)")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps per row after compiling")
  p.add_argument(
    "--batch-size", type=int, default=None, help="batch of the base/remat/mesh rows (default: 32, 4 and 64)"
  )
  p.add_argument("--remat", nargs="+", default=["none", "full"], help="model.remat policies of the remat matrix")
  p.add_argument("--variant", action="append", default=[], help="extra row 'NAME: bench flags and overrides'")
  p.add_argument("--output", help="write all results to this JSON file")
  args = p.parse_args(argv)
  rows = matrix_rows(args)
  if not rows:
    p.error("the custom matrix needs at least one --variant")
  results = [run_row(name, bench_args) for name, bench_args in rows]
  print(format_rows(results))
  notes = summarise(args.matrix, results)
  for note in notes:
    print(note)
  if args.output:
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"matrix": args.matrix, "results": results, "notes": notes}, indent=1))
  return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
  sys.exit(main())
