"""Checkpoint averaging (paper section 6.1): the mean of the params of a run's last N
checkpoints, which the paper reports its results with (the last 5 for base, the last 20 for big).

`average_params` averages on the fly (`eval --average-last N`, `translate`, `generate`);
`write_averaged` writes the mean as a workdir of its own (`jaxformer average`): its config,
tokenizers and one params-only checkpoint, which `eval`, `translate`, `generate` and export
read like any workdir. Keep enough checkpoints to average: `train.keep_checkpoints >= N`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxformer.checkpoint import manager as ckpt
from jaxformer.checkpoint import run_files as rf
from jaxformer.errors import CheckpointError

AVERAGE_FILE = "average.json"  # marks a workdir written by `write_averaged`: which run, which steps


def last_steps(checkpointer: ckpt.Checkpointer, n: int) -> list[int]:
  """The newest `n` checkpoint steps, oldest first.

  Raises:
    CheckpointError: `n` < 1, or fewer than `n` checkpoints (names the steps there are and
      the setting that keeps more).
  """
  steps = sorted(checkpointer.all_steps())
  if n < 1:
    raise CheckpointError(f"--average-last must be >= 1, got {n}")
  if len(steps) < n:
    raise CheckpointError(
      f"cannot average the last {n} checkpoints: {checkpointer.directory} holds {len(steps)} ({steps}); "
      f"train with train.keep_checkpoints >= {n}, or average fewer"
    )
  return steps[-n:]


@jax.jit
def _accumulate(total: Any, params: Any) -> Any:
  return jax.tree.map(lambda t, p: t + p.astype(jnp.float32), total, params)


def average_params(read: Callable[[int], Any], steps: list[int]) -> Any:
  """Elementwise mean over `steps` of the params `read(step)` returns (each leaf in its own
  dtype and sharding; `inference.restore.restore` reads them with `models.layout.restore_params`, so
  the steps may be of either layer layout).

  Checkpoints are read one at a time into a float32 running sum, so memory is two copies of
  the params whatever `len(steps)` is. The N-1 float32 additions and the division round to
  within N * 2^-24 of the mean of the |values| (tested against a float64 mean).
  """
  total = params = None
  for step in steps:
    params = read(step)
    total = jax.tree.map(lambda p: p.astype(jnp.float32), params) if total is None else _accumulate(total, params)
  return jax.tree.map(lambda t, p: (t / len(steps)).astype(p.dtype), total, params)


def default_output(workdir: str | Path, n: int) -> Path:
  """Where `jaxformer average` writes by default: `<workdir>/average-last-<n>`."""
  return Path(workdir) / f"average-last-{n}"


def write_averaged(workdir: str | Path, output: str | Path, steps: list[int], params: Any) -> Path:
  """Writes `params` (the mean of `steps`) as a workdir at `output`: the run's config and
  tokenizers, `average.json` (`{"workdir", "steps"}`), and one params-only checkpoint
  labelled with the newest averaged step. The folder is written under a temporary name and
  renamed when complete, so an interrupted write leaves nothing that reads as a workdir.

  Raises:
    CheckpointError: `output` exists (it is never overwritten: remove it or pick another).
  """
  workdir, output = Path(workdir), Path(output)
  if output.exists():
    raise CheckpointError(f"{output} already exists; remove it or pass another --output")
  tmp = output.with_name(output.name + ".incomplete")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  rf.copy_run_files(workdir, tmp)
  (tmp / AVERAGE_FILE).write_text(json.dumps({"workdir": str(workdir.absolute()), "steps": steps}) + "\n")
  saver = ckpt.Checkpointer(tmp, async_save=False)
  saver.save_params(max(steps), params)
  saver.close()
  tmp.rename(output)
  return output
