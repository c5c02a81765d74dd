#!/usr/bin/env python3
"""Chaos test of resuming: kill a training run at random moments, rerun it until it finishes,
and check that nothing changed.

It trains `--config` once without interruption (the reference), then runs the same command in
another workdir, sending each run a signal after a random delay: `kill -9` (SIGKILL, a crash:
the run resumes from its last committed checkpoint and replays the steps after it) or SIGTERM
(a preemption: the run checkpoints the step it is at and exits with status 143), as `--signals`
says, in turn. After `--kills` signals it lets the run finish, then checks:

  * the final params are bitwise equal to the reference's;
  * `metrics.jsonl` has one training row per step (logging every step), none duplicated or
    missing, and each row's loss equals the reference's at that step;
  * every SIGTERM exited with 143 and lost no step (its checkpoint is the last step it logged).

Prints one JSON object (kills by signal, steps replayed after crashes, the checks, seconds) and
exits with 1 if a check fails.

Usage:
  python scripts/chaos_resume.py --kills 20 --dir /tmp/chaos train.num_steps=300
  python scripts/chaos_resume.py --kills 3 --signals KILL,TERM --dir /tmp/chaos train.num_steps=40
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A run that logs and checkpoints often, so kills land in every phase: start-up, steps, saves.
DEFAULTS = [
  "train.num_steps=60",
  "train.log_every=1",
  "train.eval_every=1000",
  "train.checkpoint_every=7",
  "train.batch_size=16",
  "data.buckets=[32,64]",
]
# The child takes SIGINT/SIGTERM as a user's terminal or a scheduler would send them (a background
# job of a script inherits SIGINT ignored, which `jaxformer train` respects).
LAUNCH = (
  "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
  "sys.argv = ['jaxformer'] + sys.argv[1:]; runpy.run_module('jaxformer', run_name='__main__')"
)


def _train(workdir: Path, args, overrides: list[str]) -> subprocess.Popen:
  cmd = [
    sys.executable,
    "-c",
    LAUNCH,
    "train",
    "--config",
    args.config,
    "--workdir",
    str(workdir),
    f"data.data_dir={args.dir}/data",
    *DEFAULTS,
    *overrides,
  ]
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _rows(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  if not path.is_file():
    return []
  rows = []
  for line in path.read_text().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:  # a line being written, or cut short by a kill
      pass
  return rows


def _steps(workdir: Path) -> list[int]:
  folder = workdir / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def _params(workdir: Path):
  import jax  # noqa: PLC0415

  from jaxformer.inference import restore as inference_restore  # noqa: PLC0415

  config = inference_restore.workdir_config(workdir, ["runtime.num_cpu_devices=0"])
  return jax.device_get(inference_restore.restore(workdir, config).params)


def main() -> int:
  """Runs the check (see the module docstring); returns the exit status."""
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
  parser.add_argument("--dir", required=True, help="folder for the data cache and both workdirs (emptied first)")
  parser.add_argument("--kills", type=int, default=20, help="signals to send before letting the run finish")
  parser.add_argument("--signals", default="KILL,TERM", help="comma-separated, sent in turn: KILL, TERM, INT")
  parser.add_argument("--seed", type=int, default=0, help="seed of the random delays")
  parser.add_argument(
    "--max-steps-per-run",
    type=int,
    default=25,
    help="a kill in the step loop lands at most this many steps after the run's resume point",
  )
  parser.add_argument("overrides", nargs="*", help="dotted config overrides after the script's own")
  args = parser.parse_args()
  folder = Path(args.dir)
  for name in ("reference", "chaos"):
    shutil.rmtree(folder / name, ignore_errors=True)
  start = time.perf_counter()
  ref = _train(folder / "reference", args, args.overrides)
  _, err = ref.communicate()
  if ref.returncode != 0:
    print(err[-3000:], file=sys.stderr)
    return 1
  num_steps = max(r["step"] for r in _rows(folder / "reference") if "loss" in r)
  rng = random.Random(args.seed)
  sent = [getattr(signal, "SIG" + name.strip().upper()) for name in args.signals.split(",")]
  report = {"kills": {}, "replayed_steps": [], "term_lost_steps": [], "term_status_ok": True, "runs": 0, "events": []}
  workdir = folder / "chaos"
  while True:
    proc = _train(workdir, args, args.overrides)
    report["runs"] += 1
    kill_number = sum(report["kills"].values())
    done = max(_steps(workdir), default=0)  # where this run resumes
    if kill_number < args.kills and done < num_steps - 1:
      # One kill in five lands in start-up (imports, data, restore, compiling); the others once a
      # random step (at most --max-steps-per-run after the resume point) is logged, plus up to
      # 0.3 s, so that steps and checkpoint saves get hit.
      if rng.random() < 0.2:
        deadline, target = time.perf_counter() + rng.uniform(0.5, 5.0), None
      else:
        deadline, target = None, rng.randrange(done + 1, min(num_steps, done + 1 + args.max_steps_per_run))
      while proc.poll() is None:
        if target is not None and max([r["step"] for r in _rows(workdir) if "loss" in r], default=0) >= target:
          deadline, target = time.perf_counter() + rng.uniform(0.0, 0.3), None
        if deadline is not None and time.perf_counter() >= deadline:
          break
        time.sleep(0.02)
      if proc.poll() is None:
        sig = sent[kill_number % len(sent)]
        proc.send_signal(sig)
        report["kills"][sig.name] = report["kills"].get(sig.name, 0) + 1
        _, err = proc.communicate(timeout=300)
        logged = max([r["step"] for r in _rows(workdir) if "loss" in r], default=0)
        saved = max(_steps(workdir), default=0)
        report["events"].append(
          {"signal": sig.name, "status": proc.returncode, "resumed_at": done, "logged": logged, "saved": saved}
        )
        if sig == signal.SIGKILL:
          report["replayed_steps"].append(logged - saved)
        elif proc.returncode != 0:  # stopped before finishing: by the signal, at a step boundary
          # 143 for SIGTERM; a signal that lands before start-up installs the handler kills the
          # process instead (Popen says -15; a shell says 143 for both).
          report["term_status_ok"] &= proc.returncode in (128 + sig, -sig)
          if "stopping after the current step" in err:  # it was in the step loop: no step lost
            report["term_lost_steps"].append(logged - saved)
        continue
    _, err = proc.communicate()
    if proc.returncode == 0:
      break
    print(err[-3000:], file=sys.stderr)
    return 1
  ref_rows = {r["step"]: r["loss"] for r in _rows(folder / "reference") if "loss" in r}
  chaos_train = [r for r in _rows(workdir) if "loss" in r]
  chaos_rows = {r["step"]: r["loss"] for r in chaos_train}
  params_ref, params_chaos = _params(folder / "reference"), _params(workdir)
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  report.update(
    params_bitwise_equal=all(
      np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params_ref), jax.tree.leaves(params_chaos))
    ),
    metrics_one_row_per_step=len(chaos_train) == len(chaos_rows) and sorted(chaos_rows) == sorted(ref_rows),
    losses_equal=chaos_rows == ref_rows,
    seconds=round(time.perf_counter() - start, 1),
  )
  ok = (
    report["params_bitwise_equal"]
    and report["metrics_one_row_per_step"]
    and report["losses_equal"]
    and report["term_status_ok"]
    and not any(report["term_lost_steps"])
  )
  report["ok"] = ok
  print(json.dumps(report))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
