"""A run's metrics: JSON lines in WORKDIR/metrics.jsonl, one row per log interval, evaluation
and summary, mirrored as scalars to TensorBoard files in WORKDIR/tensorboard."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np


def _summary_writer(folder: Path):
  """A tensorboardX SummaryWriter writing to `folder`, imported without PyTorch: tensorboardX
  imports torch when it can (only to accept torch tensors; we log floats), which costs a
  train run seconds of start-up wherever torch is installed."""
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # makes `import torch` raise ImportError inside tensorboardX
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415
  finally:
    if blocked:
      del sys.modules["torch"]
  return SummaryWriter(str(folder))


class MetricsLog:
  """Appends JSON lines to metrics.jsonl and mirrors scalars to TensorBoard (process 0 only).

  A run resumed from the step-`start` checkpoint first drops the rows of later steps (a crash
  logged them, then undid them: the resumed run logs them again), so every step is covered by
  exactly one training row and no row is duplicated.
  """

  def __init__(self, workdir: Path, start: int):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      _drop_rows_after(workdir / "metrics.jsonl", start)
      self._file = open(workdir / "metrics.jsonl", "a")
      self._tb = _summary_writer(workdir / "tensorboard")

  def write(self, record: dict[str, Any], prefix: str = "train") -> None:
    """Appends `record` (a JSON-safe dict with a "step") as one line, and its numbers as
    TensorBoard scalars `prefix/key` at that step (a list: one curve per element)."""
    if not self.enabled:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for k, v in record.items():
      if k != "step" and isinstance(v, (int, float)):
        self._tb.add_scalar(f"{prefix}/{k}", v, record["step"])
      elif isinstance(v, list):  # per layer (the router's load): one curve per layer, per expert
        for index, value in np.ndenumerate(np.asarray(v)):
          self._tb.add_scalar(f"{prefix}/{k}/{'/'.join(map(str, index))}", float(value), record["step"])
    self._tb.flush()

  def close(self) -> None:
    """Closes the JSON-lines file and the TensorBoard writer."""
    if self.enabled:
      self._file.close()
      self._tb.close()


def _drop_rows_after(path: Path, step: int) -> None:
  """Rewrites the JSON-lines file `path` without its rows of steps after `step` (and without a
  torn last line), atomically; says on stderr how many it dropped."""
  if not path.is_file():
    return
  kept, dropped = [], 0
  for line in path.read_text().splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:  # a line cut short by a kill
      dropped += 1
      continue
    if row.get("step", 0) > step:
      dropped += 1
    else:
      kept.append(line)
  if dropped:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    print(f"{path}: dropped {dropped} rows after step {step}, which this run replays", file=sys.stderr, flush=True)
