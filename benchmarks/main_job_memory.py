"""Peak resident memory of the README's main job (`jaxformer train` of `multi30k_small`, then
`jaxformer eval`), phase by phase, over a given number of steps.

Runs both commands as child processes in a fresh workdir and a fresh `data.data_dir` (so the
SentencePiece training and the tokenisation are measured, as in a fresh clone), with
`train.log_every=1` and validation and checkpoints every `--every` steps so that every phase
happens. A sampler reads the child's `VmRSS` from `/proc` every `--interval` seconds; each
sample is put in the phase named by the last line the child printed:

- `start-up`: Python, the CLI, JAX and the backend, until the sharding summary (`mesh ...`);
- `data, state`: data preparation (tokenizer training, tokenisation into ArrayRecord shards)
  and the initial state, until the first training log line;
- `train`: training steps (each new bucket length compiles the step once), the validation
  loss (its step compiles once per bucket length too) and checkpoints;
- `eval`: the whole `jaxformer eval` process (restore, greedy decoding of test2016, BLEU,
  reference loss).

Prints a Markdown table (peak RSS per phase, MiB; the process's `ru_maxrss`; the RSS after
each logged step) and ends with one JSON line. Peak RSS does not depend on machine load, only
on what the process does, so a loaded machine measures it as well as a quiet one.

  python benchmarks/main_job_memory.py --steps 60 --every 30 [--root /tmp/jaxformer-mem] [-- KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rss_mib(pid: int) -> float | None:
  """The resident set of process `pid` in MiB (None once it has exited)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    return None
  return None


def _step_of(line: str) -> int | None:
  """The step of a training log line (None for any other line, validation lines included)."""
  if not line.startswith("{"):
    return None
  try:
    row = json.loads(line)
  except json.JSONDecodeError:
    return None
  return row["step"] if "loss" in row and "val_loss" not in row else None


def run_measured(command: list[str], interval: float, first_phase: str) -> dict:
  """Runs `command`, sampling its RSS; returns the peak per phase, the RSS at each logged step
  and the process's `ru_maxrss` (MiB).

  Raises:
    RuntimeError: the command failed (its last output lines in the message).
  """
  child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
  state = {"phase": first_phase}
  peaks: dict[str, float] = {}
  steps: list[tuple[int, float]] = []
  tail: list[str] = []

  def sample():
    while not done.is_set():
      rss = rss_mib(child.pid)
      if rss is not None:
        peaks[state["phase"]] = max(peaks.get(state["phase"], 0.0), rss)
      time.sleep(interval)

  done = threading.Event()
  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  for line in child.stdout:
    line = line.rstrip("\n")
    tail = (tail + [line])[-20:]
    step = _step_of(line)
    if line.startswith("mesh ") and state["phase"] == "start-up":
      state["phase"] = "data, state"
    elif step is not None:
      state["phase"] = "train"
      rss = rss_mib(child.pid)
      if rss is not None:
        steps.append((step, rss))
  _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage (its peak RSS, KiB on Linux)
  child.returncode = os.waitstatus_to_exitcode(status)
  done.set()
  sampler.join()
  if child.returncode:
    raise RuntimeError(f"{' '.join(command[:4])} ... exited {child.returncode}:\n" + "\n".join(tail))
  return {"peaks": peaks, "steps": steps, "ru_maxrss_mib": usage.ru_maxrss / 1024}


def main() -> None:
  """Parses the flags, runs and measures both commands, prints the tables and the JSON line."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=60, help="train.num_steps (the README job: 480)")
  parser.add_argument("--every", type=int, default=30, help="train.eval_every and train.checkpoint_every")
  parser.add_argument(
    "--root", default="/tmp/jaxformer-main-job-memory", help="workdir and data_dir go here (emptied first)"
  )
  parser.add_argument("--interval", type=float, default=0.25, help="seconds between RSS samples")
  parser.add_argument("--no-eval", action="store_true", help="measure the train command only")
  parser.add_argument("overrides", nargs="*", help="more KEY=VALUE overrides for the train command")
  args = parser.parse_args()
  root = Path(args.root)
  shutil.rmtree(root, ignore_errors=True)
  root.mkdir(parents=True)
  workdir = root / "workdir"
  jaxformer = [sys.executable, "-m", "jaxformer"]
  train = [
    *jaxformer,
    "train",
    "--config",
    "configs/multi30k_small.yaml",
    "--workdir",
    str(workdir),
    f"data.data_dir={root / 'data'}",
    f"train.num_steps={args.steps}",
    "train.log_every=1",
    f"train.eval_every={args.every}",
    f"train.checkpoint_every={args.every}",
    *args.overrides,
  ]
  env_note = {k: os.environ[k] for k in ("MALLOC_ARENA_MAX", "XLA_FLAGS") if k in os.environ}
  results = {"train": run_measured(train, args.interval, "start-up")}
  if not args.no_eval:
    results["eval"] = run_measured([*jaxformer, "eval", "--workdir", str(workdir)], args.interval, "eval")
  print("| command | phase | peak RSS (MiB) |\n|---|---|---:|")
  for command, result in results.items():
    for phase, peak in result["peaks"].items():
      print(f"| {command} | {phase} | {peak:,.0f} |")
    print(f"| {command} | whole process (`ru_maxrss`) | {result['ru_maxrss_mib']:,.0f} |")
  steps = results["train"]["steps"]
  print("\nRSS after logged steps (MiB): " + ", ".join(f"{s}: {r:,.0f}" for s, r in steps))
  print(
    json.dumps(
      {
        "steps": args.steps,
        "every": args.every,
        "env": env_note,
        **{f"{c}_peak_mib": round(r["ru_maxrss_mib"]) for c, r in results.items()},
        "phases": {c: {p: round(v) for p, v in r["peaks"].items()} for c, r in results.items()},
      }
    )
  )


if __name__ == "__main__":
  main()
