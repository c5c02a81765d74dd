"""The training loop: data, sharded state, jitted step, logging, validation, checkpoints.

`train(config, workdir)` starts fresh or resumes from the latest checkpoint in `workdir`
(step, optimizer state and schedule continue; dropout keys are derived from the step, and
the batch at step k is a pure function of (seed, k), so a resumed run sees the same data).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tqdm
from tensorboardX import SummaryWriter

from jaxformer import checkpoint as ckpt
from jaxformer import interrupt
from jaxformer import sharding as sh
from jaxformer.config import Config, ConfigError, TrainConfig, dump_config, load_config
from jaxformer.distributed import main_process_first
from jaxformer.data import PAIRS, absolute_paths, global_batch, padding_fraction, stack_batches
from jaxformer.runtime import build_mesh
from jaxformer.train.optim import make_optimizer
from jaxformer.summary import format_summary
from jaxformer.train.state import abstract_state, create_state
from jaxformer.train.step import make_eval_step, make_train_call
from jaxformer.tasks import get_task


def _check_resume_config(workdir: Path, config: Config) -> None:
  saved_path = workdir / ckpt.CONFIG_FILE
  if not saved_path.is_file():
    return
  saved = load_config(saved_path)
  # The compute dtype may change on resume: params and optimizer state are float32 either way.
  if dataclasses.replace(saved.model, dtype=config.model.dtype) != config.model:
    raise ConfigError(
        f"{workdir} holds a run with a different model config; use a new --workdir "
        "or the same model.* settings to resume")
  k = saved.train.steps_per_call
  bucketed = get_task(saved).data_kind == PAIRS and not saved.data.packing
  if bucketed and k != config.train.steps_per_call:
    # Bucketed sentence-pair batches are shuffled in runs of steps_per_call: changing it changes the data order.
    raise ConfigError(f"{workdir} was trained with train.steps_per_call={k}, which sets its batch order; "
                      f"resume with train.steps_per_call={k} or use a new --workdir")


def call_length(step: int, train: TrainConfig) -> int:
  """Steps in the jitted call that starts after `step` steps: at most `train.steps_per_call`,
  ending at the next multiple of it (calls stay aligned with the data's runs after any short
  call) and at the next log, eval or checkpoint step and the end of the run, so those see
  the state of exactly that step."""
  ends = [step + every - step % every for every in
          (train.steps_per_call, train.log_every, train.eval_every, train.checkpoint_every)]
  return min(*ends, train.num_steps) - step


def evaluate_loss(eval_step, params, batches, mesh) -> dict[str, float]:
  """Token-averaged validation loss, NLL and accuracy over `batches` (dropout off)."""
  totals: dict[str, float] = {}
  for batch in batches:
    sums = jax.device_get(eval_step(params, global_batch(batch, mesh)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  n = max(totals["num_tokens"], 1.0)
  return {"loss": totals["loss"] / n, "nll": totals["nll"] / n, "accuracy": totals["correct"] / n,
          "num_tokens": totals["num_tokens"]}


class _Logger:
  """Appends JSON lines to metrics.jsonl and mirrors scalars to TensorBoard (process 0 only)."""

  def __init__(self, workdir: Path):
    self.enabled = jax.process_index() == 0
    if self.enabled:
      self._file = open(workdir / "metrics.jsonl", "a")
      self._tb = SummaryWriter(str(workdir / "tensorboard"))

  def write(self, record: dict[str, Any], prefix: str = "train") -> None:
    if not self.enabled:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for k, v in record.items():
      if k != "step" and isinstance(v, (int, float)):
        self._tb.add_scalar(f"{prefix}/{k}", v, record["step"])
    self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._file.close()
      self._tb.close()


def train(config: Config, workdir: str | Path, dry_run: bool = False, verbose: bool = False) -> dict[str, Any]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint if there is one.

  Prints the sharding summary first: the parameter table and per-device totals to stdout
  and nothing else when `dry_run`; else the totals (and with `verbose` the table) to stderr. Returns the last logged training metrics. Raises ConfigError for a mesh,
  `mesh.rules` or batch that does not fit the devices, or a workdir that holds a
  different model.
  """
  with sh.axis_rules(sh.parse_rules(config.mesh.rules)):
    return _train(config, Path(workdir), dry_run, verbose)


def _train(config: Config, workdir: Path, dry_run: bool, verbose: bool) -> dict[str, Any]:
  _check_resume_config(workdir, config)
  mesh = build_mesh(config)
  task = get_task(config)
  model = task.make_model()
  tx = make_optimizer(config.optim, config.model.d_model)
  abstract, logical = abstract_state(model, tx)
  shardings = sh.logical_to_sharding(logical, mesh)
  sh.check_divisible(abstract, shardings)
  if jax.process_index() == 0:
    print(format_summary(abstract, logical, shardings, mesh, table=dry_run or verbose),
          file=sys.stdout if dry_run else sys.stderr,
          flush=True)
  if dry_run:
    return {}
  # Process 0 builds the dataset and tokenizer cache in data_dir; the others wait, then read them.
  # A workdir keeps its tokenizers: a resumed run reads its data with the ids it trained on.
  saved_vocab = ckpt.load_vocabulary(workdir)
  if saved_vocab is not None and jax.process_index() == 0:
    print(f"using the tokenizer saved in {workdir}", file=sys.stderr, flush=True)
  vocab, splits = main_process_first(lambda: task.load_data(saved_vocab), "prepare_data")
  if jax.process_index() == 0:
    ckpt.save_run_files(workdir, dump_config(absolute_paths(config)), vocab.target.serialized,
                        None if vocab.shared else vocab.source.serialized)
  checkpointer = ckpt.Checkpointer(workdir, config.train.checkpoint_every, config.train.keep_checkpoints,
                                   config.train.async_checkpoint)
  start = checkpointer.latest_step()
  if start is None:
    state = create_state(model, tx, mesh, config.runtime.seed, shardings, config.precision.start_scale)
    start = 0
  else:
    state = checkpointer.restore(ckpt.sharded_target(abstract, shardings), start)
    if jax.process_index() == 0:
      print(f"resuming from the step-{start} checkpoint in {workdir}", file=sys.stderr, flush=True)
  stacked = config.train.steps_per_call > 1
  train_step = make_train_call(model, tx, config, mesh, shardings)
  eval_step = make_eval_step(model, config, mesh, shardings.params)
  rng = jax.random.key(config.runtime.seed)

  batches, val_batches = task.make_batches(splits, jax.process_index(), jax.process_count())
  logger = _Logger(workdir)
  show_bar = jax.process_index() == 0 and sys.stderr.isatty()
  bar = tqdm.tqdm(total=config.train.num_steps, initial=start, disable=not show_bar, unit="step")
  record: dict[str, Any] = {}
  pending: list[dict] = []   # metrics of each call since the last log line
  padding: list[float] = []
  step, seconds, last_time = start, 0.0, time.perf_counter()
  stream = batches.iterate(start)
  try:
    while step < config.train.num_steps:
      interrupt.check()
      n = call_length(step, config.train)
      local = [next(stream) for _ in range(n)]
      local = stack_batches(local) if stacked else local[0]
      padding += [padding_fraction(local)] * n
      state, metrics = train_step(state, global_batch(local, mesh), rng)
      interrupt.loop_active.set()   # from the first call on (compiled): Ctrl-C stops at a step boundary
      pending.append(metrics)
      step += n
      bar.update(n)
      if step % config.train.log_every == 0 or step == config.train.num_steps:
        history = _unstack(jax.device_get(pending))
        seconds += time.perf_counter() - last_time
        record = _summarise(history, step, seconds, padding)
        logger.write(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}")
        if not show_bar and jax.process_index() == 0:
          print(json.dumps(record), flush=True)
        pending, padding, seconds, last_time = [], [], 0.0, time.perf_counter()
      if step % config.train.eval_every == 0 or step == config.train.num_steps:
        # Time the queued steps, not the evaluation: wait for them, then pause the clock.
        jax.block_until_ready(state)
        seconds += time.perf_counter() - last_time
        val = evaluate_loss(eval_step, state.params, val_batches, mesh)
        logger.write({"step": step, **{f"val_{k}": v for k, v in val.items()}}, prefix="validation")
        if jax.process_index() == 0:
          print(json.dumps({"step": step, "val_loss": val["loss"], "val_nll": val["nll"]}), flush=True)
        last_time = time.perf_counter()
      if step % config.train.checkpoint_every == 0 or step == config.train.num_steps:
        checkpointer.save(state, force=True)
  finally:
    interrupt.loop_active.clear()
    bar.close()
    checkpointer.close()   # waits for pending asynchronous checkpoint writes
    logger.close()
  return record


def _unstack(calls: list[dict]) -> list[dict]:
  """Per-step metric dicts from each call's host metrics (scalars, or stacked `[n]`)."""
  history = []
  for metrics in calls:
    n = np.shape(metrics["loss"])
    history += [{k: v[i] for k, v in metrics.items()} for i in range(n[0])] if n else [metrics]
  return history


def _summarise(history: list[dict], step: int, seconds: float, padding: list[float]) -> dict[str, Any]:
  """Token-weighted averages over the steps since the last log line; `skipped` counts the
  steps whose update was skipped (non-finite float16 gradients), `grad_norm` averages the
  others (None if all were skipped), `loss_scale` is the scale of the last step."""
  tokens = sum(float(m["num_tokens"]) for m in history)
  n = max(tokens, 1.0)
  applied = [float(m["grad_norm"]) for m in history if not float(m["skipped"])]
  return {
      "step": step,
      "loss": sum(float(m["loss"]) for m in history) / n,
      "nll": sum(float(m["nll"]) for m in history) / n,
      "accuracy": sum(float(m["correct"]) for m in history) / n,
      "learning_rate": float(history[-1]["learning_rate"]),
      "grad_norm": float(np.mean(applied)) if applied else None,
      "skipped": int(sum(float(m["skipped"]) for m in history)),
      "loss_scale": float(history[-1]["loss_scale"]),
      "tokens_per_sec": tokens / max(seconds, 1e-9),
      "steps_per_sec": len(history) / max(seconds, 1e-9),
      "padding_fraction": float(np.mean(padding)),
  }
