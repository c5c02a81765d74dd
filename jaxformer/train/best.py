"""The best checkpoint by a validation metric (`train.keep_best`), and early stopping
(`train.early_stop_patience`).

After each evaluation the loop calls `BestCheckpoint.update` with the validation scores. The
history of every evaluation's value lives in `<workdir>/best/best.json`; whenever the newest
value is the best so far (the first of equal values wins), its params are written to
`<workdir>/best/` as a workdir of their own (config, tokenizers, one params-only checkpoint),
apart from the last-N window that `train.keep_checkpoints` rotates, so `eval`, `translate`
and export read it with `--workdir <workdir>/best`.

A resumed run drops the evaluations after the step it resumes from (it replays them, with the
same values, since a run is a pure function of its seed), so the best step and the count of
evaluations without improvement are those of an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import jax

from jaxformer.checkpoint import manager as ckpt
from jaxformer.checkpoint import run_files as rf

BEST_DIR = "best"
BEST_FILE = "best.json"
LOWER_IS_BETTER = {"val_loss": True, "val_nll": True, "val_accuracy": False, "val_bleu": False}


class BestCheckpoint:
  """Tracks `metric` over evaluations, keeps the best step's params, decides early stopping.

  `metric` is a validation metric name (`val_loss`, `val_nll`, `val_accuracy`, `val_bleu`) or
  "" (no best checkpoint; early stopping then watches `val_loss`); `patience` is the number of
  evaluations without improvement after which `update` says stop (0: never).
  """

  def __init__(self, workdir: Path, metric: str, patience: int, start: int):
    self.workdir, self.keep = Path(workdir), bool(metric)
    self.metric, self.patience = metric or "val_loss", patience
    self.directory = self.workdir / BEST_DIR
    self.history: list[tuple[int, float]] = []
    saved = self.directory / BEST_FILE
    if saved.is_file():
      record = json.loads(saved.read_text())
      if record.get("metric") == self.metric:
        self.history = [(int(s), float(v)) for s, v in record["history"] if s <= start]
    if jax.process_index() == 0 and (self.directory / "checkpoints").is_dir():
      for folder in (self.directory / "checkpoints").iterdir():  # saved by evaluations this run replays
        if folder.name.isdigit() and int(folder.name) > start:
          shutil.rmtree(folder)

  @property
  def enabled(self) -> bool:
    """Whether a best checkpoint is kept or early stopping is on."""
    return self.keep or self.patience > 0

  def _better(self, a: float, b: float) -> bool:
    if math.isnan(a):
      return False
    return math.isnan(b) or (a < b if LOWER_IS_BETTER[self.metric] else a > b)

  def best(self) -> tuple[int, float] | None:
    """(step, value) of the best evaluation so far, or None before the first."""
    top = None
    for entry in self.history:
      if top is None or self._better(entry[1], top[1]):
        top = entry
    return top

  def evaluations_since_best(self) -> int:
    """Evaluations after the best one (0 before any)."""
    top = self.best()
    return 0 if top is None else sum(1 for step, _ in self.history if step > top[0])

  def should_stop(self) -> bool:
    """Whether `patience` evaluations in a row have not improved on the best."""
    return self.patience > 0 and self.evaluations_since_best() >= self.patience

  def stop_message(self) -> str:
    """The one line that explains an early stop (the metric, the patience, the best value and step)."""
    step, value = self.best()
    return (
      f"early stop: {self.metric} has not improved for {self.evaluations_since_best()} evaluations "
      f"(train.early_stop_patience={self.patience}); the best was {value:.4f} at step {step}"
    )

  def update(self, step: int, scores: dict[str, float], params: Any) -> bool:
    """Records the evaluation of `step` (`scores` holds `metric`), saves `params` as the best
    checkpoint if it is the best so far, and returns whether to stop early. Every process
    calls it (the save is collective); process 0 writes the files."""
    if not self.enabled:
      return False
    self.history = [entry for entry in self.history if entry[0] < step] + [(step, float(scores[self.metric]))]
    if self.keep and self.best()[0] == step:
      self._save(step, params)
    if jax.process_index() == 0:
      self.directory.mkdir(parents=True, exist_ok=True)
      tmp = self.directory / (BEST_FILE + ".tmp")
      best_step, best_value = self.best()
      tmp.write_text(
        json.dumps({"metric": self.metric, "step": best_step, "value": best_value, "history": self.history}) + "\n"
      )
      tmp.replace(self.directory / BEST_FILE)
    return self.should_stop()

  def _save(self, step: int, params: Any) -> None:
    saver = ckpt.Checkpointer(self.directory, keep=1, async_save=False)  # Orbax drops the older one once saved
    if step not in saver.all_steps():  # a replayed evaluation: the same params are there already
      saver.save_params(step, params)
    saver.close()
    if jax.process_index() == 0:
      rf.copy_run_files(self.workdir, self.directory)
      print(f"best {self.metric} so far at step {step}: saved to {self.directory}", file=sys.stderr, flush=True)


def task_scores(task, vocab, model, mesh, params, step: int, split) -> dict[str, float]:
  """`task.score_validation` of the training `params` on the validation `split`, as
  `val_<name>` scores (`vocab` is the run's `data.Vocabulary`)."""
  from jaxformer import sharding as sh  # noqa: PLC0415
  from jaxformer.inference.restore import Restored  # noqa: PLC0415  (restore imports the train state)

  restored = Restored(
    task.config, vocab.target, model, mesh, params, step, sh.rules_for(task.config.mesh), vocab.source
  )
  return {f"val_{name}": value for name, value in task.score_validation(restored, split).items()}
