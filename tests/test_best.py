"""The best checkpoint by a validation metric (`train.keep_best`) and early stopping
(`train.early_stop_patience`): which step is kept, when a run stops, and resuming."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from test_cli import TINY, run_cli
from test_own_data import TINY_MODEL, _reverse, _sentences

from jaxformer.checkpoint import manager as ckpt
from jaxformer.checkpoint import run_files as rf
from jaxformer.train.best import BestCheckpoint


def _params(value):
  return {"w": jnp.full((2, 3), value, jnp.float32)}


def _restore(directory):
  target = {"w": np.zeros((2, 3), np.float32)}
  return ckpt.Checkpointer(directory, async_save=False).restore_params(target)


def test_keeps_the_best_step_and_counts_evaluations_without_improvement(tmp_path):
  (tmp_path / rf.CONFIG_FILE).write_text("name: x\n")
  best = BestCheckpoint(tmp_path, "val_bleu", patience=2, start=0)
  stops = [
    best.update(step, {"val_bleu": bleu, "val_loss": 1.0}, _params(step))
    for step, bleu in ((10, 5.0), (20, 7.5), (30, float("nan")), (40, 7.5))
  ]
  # BLEU is higher-better; NaN never wins; a tie keeps the earlier step; two evaluations
  # without improvement after step 20 stop the run at step 40.
  assert stops == [False, False, False, True]
  assert best.best() == (20, 7.5) and best.evaluations_since_best() == 2
  step, params = _restore(tmp_path / "best")
  assert step == 20 and np.all(params["w"] == 20)
  assert (tmp_path / "best" / rf.CONFIG_FILE).read_text() == "name: x\n"  # a workdir of its own
  saved = json.loads((tmp_path / "best" / "best.json").read_text())
  assert saved["step"] == 20 and saved["metric"] == "val_bleu" and len(saved["history"]) == 4
  assert "val_bleu has not improved for 2 evaluations" in best.stop_message()
  assert "best was 7.5000 at step 20" in best.stop_message()


def test_resume_drops_the_evaluations_it_replays(tmp_path):
  best = BestCheckpoint(tmp_path, "val_loss", patience=0, start=0)
  for step, loss in ((10, 3.0), (20, 2.0), (30, 1.0)):
    best.update(step, {"val_loss": loss}, _params(step))
  assert _restore(tmp_path / "best")[0] == 30
  # Resumed from step 20: the evaluation at 30 (and its best checkpoint) was undone by the crash.
  resumed = BestCheckpoint(tmp_path, "val_loss", patience=0, start=20)
  assert resumed.history == [(10, 3.0), (20, 2.0)] and resumed.best() == (20, 2.0)
  assert not (tmp_path / "best" / "checkpoints" / "30").exists()
  resumed.update(30, {"val_loss": 1.5}, _params(31))
  step, params = _restore(tmp_path / "best")
  assert step == 30 and np.all(params["w"] == 31)
  assert not BestCheckpoint(tmp_path, "", patience=0, start=30).enabled


def test_lower_is_better_for_losses():
  best = BestCheckpoint.__new__(BestCheckpoint)
  best.metric = "val_loss"
  assert best._better(1.0, 2.0) and not best._better(2.0, 1.0) and best._better(1.0, math.nan)
  best.metric = "val_accuracy"
  assert best._better(0.9, 0.5) and not best._better(math.nan, 0.5)


@pytest.mark.slow
def test_training_stops_early_and_the_best_step_evaluates(tmp_path):
  workdir = tmp_path / "run"
  # Validation BLEU decodes the whole validation split at every evaluation: a corpus of 200
  # pairs (the last 20 held out) keeps that short.
  sentences = _sentences(200)
  (tmp_path / "train.xx").write_text("".join(s + "\n" for s in sentences))
  (tmp_path / "train.yy").write_text("".join(_reverse(s) + "\n" for s in sentences))
  # A learning rate far below float32's resolution leaves the params as they are: BLEU never improves.
  args = [
    "train",
    "--config",
    TINY,
    "--workdir",
    str(workdir),
    *TINY_MODEL,
    "data.dataset=files",
    f"data.train_files={tmp_path}/train.xx,{tmp_path}/train.yy",
    "data.source_lang=xx",
    "data.target_lang=yy",
    f"data.data_dir={tmp_path}/data",
    "data.buckets=[64]",
    "train.batch_size=16",
    "train.num_steps=40",
    "train.eval_every=5",
    "train.log_every=2",
    "train.checkpoint_every=20",
    "train.keep_best=val_bleu",
    "train.early_stop_patience=2",
    "optim.learning_rate=1e-30",
  ]
  proc = run_cli(*args)
  assert "early stop: val_bleu has not improved for 2 evaluations" in proc.stderr
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "val_bleu" in r] == [5, 10, 15]
  assert max(r["step"] for r in rows if "loss" in r) == 15  # the stop step got its training row
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())[-1] == 15
  assert json.loads((workdir / "best" / "best.json").read_text())["step"] == 5
  # Rerunning the same command stays stopped; the best step evaluates like any workdir.
  again = run_cli(*args)
  assert "early stop" in again.stderr and "loss" not in again.stdout
  result = json.loads(run_cli("eval", "--workdir", str(workdir / "best"), "--split", "val").stdout.splitlines()[-1])
  assert result["step"] == 5 and result["num_sentences"] == 20 and 0.0 <= result["bleu"] <= 100.0
