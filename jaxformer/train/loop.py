"""The training loop: data, sharded state, jitted step, logging, validation, checkpoints.

`train(config, workdir)` starts fresh or resumes from the latest checkpoint in `workdir`
(step, optimizer state and schedule continue; dropout keys are derived from the step, and
the batch at step k is a pure function of (seed, k), so a resumed run sees the same data).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tqdm

from jaxformer import sharding as sh
from jaxformer.checkpoint import manager as ckpt
from jaxformer.checkpoint import run_files as rf
from jaxformer.checkpoint.average import AVERAGE_FILE
from jaxformer.config import Config, ConfigError, TrainConfig, check_directory, dump_config, load_config
from jaxformer.data import PAIRS, absolute_paths, global_batch, padding_fraction, stack_batches
from jaxformer.errors import NonFiniteError
from jaxformer.runtime import interrupt, workdir_lock
from jaxformer.runtime.distributed import main_process_first, max_over_processes
from jaxformer.runtime.host_memory import release_free_memory
from jaxformer.runtime.startup import build_mesh
from jaxformer.tasks import get_task
from jaxformer.tasks.objective import evaluate_loss, make_eval_step
from jaxformer.tasks.router import summarise_router
from jaxformer.train import lora
from jaxformer.train.best import BEST_FILE, BestCheckpoint, task_scores
from jaxformer.train.metrics_log import MetricsLog
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import abstract_state, create_state
from jaxformer.train.step import make_train_call
from jaxformer.train.summary import format_summary

# Data settings that choose the tokenizer: a workdir's checkpoints only work with the one it saved.
TOKENIZER_KEYS = ("tokenizer", "tokenizer_model", "shared_vocab", "input_sentence_size")


def _check_resume_config(workdir: Path, config: Config) -> bool:
  """Checks `workdir` before anything is written there: a writable directory (or one that can
  be created) and, if it holds a run, one that `config` may resume.

  Returns:
    Whether that run is complete: its latest checkpoint is at `train.num_steps` (nothing to train).

  Raises:
    ConfigError: the workdir is a file or read-only, or it holds a run with another model or
      tokenizer, another steps_per_call (bucketed pairs), or a checkpoint past train.num_steps.
  """
  check_directory("--workdir", workdir, writable=True)
  saved_path = workdir / rf.CONFIG_FILE
  if not saved_path.is_file():
    return False
  saved = load_config(saved_path)
  # Safe to change on resume: the compute dtype (params and optimizer state are float32 either
  # way; LoRA's frozen kernels are cast on restore), the remat policy, and the layer layout (the
  # restore converts: models/layout.py).
  safe = dict(
    dtype=config.model.dtype,
    remat=config.model.remat,
    scan_layers=config.model.scan_layers,
    frozen_dtype=config.model.frozen_dtype,
  )
  if not saved.model.lora_rank:  # LoRA adapters may be added to a run without them (train/lora.py)
    safe.update({k: getattr(config.model, k) for k in ("lora_rank", "lora_alpha", "lora_targets")})
  if dataclasses.replace(saved.model, **safe) != config.model:
    raise ConfigError(
      f"{workdir} holds a run with a different model config; use a new --workdir or the same model.* settings to resume"
    )
  k = saved.train.steps_per_call
  bucketed = get_task(saved).data_kind == PAIRS and not saved.data.packing
  if bucketed and k != config.train.steps_per_call:
    # Bucketed sentence-pair batches are shuffled in runs of steps_per_call: changing it changes the data order.
    raise ConfigError(
      f"{workdir} was trained with train.steps_per_call={k}, which sets its batch order; "
      f"resume with train.steps_per_call={k} or use a new --workdir"
    )
  new_data = absolute_paths(config).data  # the saved config holds absolute paths
  changed = [k for k in TOKENIZER_KEYS if getattr(saved.data, k) != getattr(new_data, k)]
  if changed:
    was = ", ".join(f"data.{k}={getattr(saved.data, k)!r}" for k in changed)
    now = ", ".join(f"data.{k}={getattr(new_data, k)!r}" for k in changed)
    raise ConfigError(
      f"{workdir} was trained with {was} (not {now}) and its checkpoints only fit that tokenizer; "
      "resume with the same data settings or use a new --workdir"
    )
  checkpointer = ckpt.Checkpointer(workdir, read_only=True)
  latest = checkpointer.latest_step()
  checkpointer.close()
  num_steps = config.train.num_steps
  if latest is not None and latest > num_steps:
    raise ConfigError(
      f"{workdir} already holds the step-{latest} checkpoint, past train.num_steps={num_steps}; "
      f"raise train.num_steps above {latest} to train on, or use a new --workdir"
    )
  if latest == num_steps and jax.process_index() == 0:
    print(
      f"nothing to train: {workdir} already holds the step-{latest} checkpoint (train.num_steps={num_steps}); "
      "raise train.num_steps to train on",
      file=sys.stderr,
      flush=True,
    )
  return latest == num_steps


def call_length(step: int, train: TrainConfig) -> int:
  """Steps in the jitted call that starts after `step` steps: at most `train.steps_per_call`,
  ending at the next multiple of it (calls stay aligned with the data's runs after any short
  call) and at the next log, eval or checkpoint step and the end of the run, so those see
  the state of exactly that step."""
  ends = [
    step + every - step % every
    for every in (train.steps_per_call, train.log_every, train.eval_every, train.checkpoint_every)
  ]
  return min(*ends, train.num_steps) - step


def train(config: Config, workdir: str | Path, dry_run: bool = False, verbose: bool = False) -> dict[str, Any]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint if there is one.

  Prints the sharding summary first: the parameter table and per-device totals to stdout
  and nothing else when `dry_run`; else the totals (and with `verbose` the table) to stderr.
  Returns the last logged training metrics. Raises ConfigError for a mesh,
  `mesh.rules` or batch that does not fit the devices, or a workdir that holds a
  different model.
  """
  # One run per workdir: process 0 holds its lock until the last checkpoint is written.
  lock = workdir_lock.hold(workdir) if not dry_run and jax.process_index() == 0 else contextlib.nullcontext()
  with lock:
    return _train(config, Path(workdir), dry_run, verbose)


def _train(config: Config, workdir: Path, dry_run: bool, verbose: bool) -> dict[str, Any]:
  for marker, made_by in ((AVERAGE_FILE, "jaxformer average"), (BEST_FILE, "train.keep_best")):
    if (workdir / marker).is_file():
      raise ConfigError(
        f"{workdir} holds params written by `{made_by}` for evaluation, not a training run; "
        "train in the run's own --workdir"
      )
  # A workdir keeps its tokenizers: a resumed run reads its data with the ids it trained on.
  saved_vocab = rf.load_vocabulary(workdir)
  config, vocab = get_task(config).fit_vocab_size(saved_vocab)  # a char vocabulary sizes an unset model.vocab_size
  if _check_resume_config(workdir, config) and not dry_run:
    return {}  # a complete run: nothing is trained or rewritten
  mesh = build_mesh(config)
  task = get_task(config)
  model = task.make_model()
  tx = make_optimizer(config.optim, config.model.d_model)
  abstract, logical = abstract_state(model, tx)
  rules = sh.rules_for(config.mesh)
  shardings = sh.logical_to_sharding(logical, mesh, rules)
  sh.check_divisible(abstract, shardings)
  if jax.process_index() == 0:
    print(
      format_summary(abstract, logical, shardings, mesh, table=dry_run or verbose),
      file=sys.stdout if dry_run else sys.stderr,
      flush=True,
    )
  if dry_run:
    return {}
  # Process 0 builds the dataset and tokenizer cache in data_dir; the others wait, then read them.
  if saved_vocab is not None and jax.process_index() == 0:
    print(f"using the tokenizer saved in {workdir}", file=sys.stderr, flush=True)
  vocab, splits = main_process_first(lambda: task.load_data(vocab), "prepare_data")
  if jax.process_index() == 0:
    rf.save_run_files(
      workdir,
      dump_config(absolute_paths(config)),
      vocab.target.serialized,
      None if vocab.shared else vocab.source.serialized,
    )
  checkpointer = ckpt.Checkpointer(
    workdir, config.train.checkpoint_every, config.train.keep_checkpoints, config.train.async_checkpoint
  )
  fresh = functools.partial(
    create_state, model, tx, mesh, config.runtime.seed, shardings, config.precision.start_scale, rules
  )
  if checkpointer.latest_step() is None:
    state = fresh()
    start = 0
  else:
    # The newest intact step (damaged newer ones are reported and moved to damaged_checkpoints/);
    # one without adapters gets new ones when the model has them (train/lora.py).
    state = lora.restore_state(checkpointer, ckpt.sharded_target(abstract, shardings), model, fresh)
    start = int(jax.device_get(state.step))
    if jax.process_index() == 0:
      print(f"resuming from the step-{start} checkpoint in {workdir}", file=sys.stderr, flush=True)
  stacked = config.train.steps_per_call > 1
  train_step = make_train_call(model, tx, config, mesh, shardings)
  eval_step = make_eval_step(model, config, mesh, shardings.params)
  rng = jax.random.key(config.runtime.seed)

  batches, val_batches = task.make_batches(splits, jax.process_index(), jax.process_count())
  logger = MetricsLog(workdir, start)
  show_bar = jax.process_index() == 0 and sys.stderr.isatty()
  bar = tqdm.tqdm(total=config.train.num_steps, initial=start, disable=not show_bar, unit="step")
  record: dict[str, Any] = {}
  pending: list[dict] = []  # metrics of each call since the last log line
  padding: list[float] = []
  step, seconds, last_time = start, 0.0, time.perf_counter()
  stream = batches.iterate(start)
  guard = _NonFiniteGuard(config.train)
  best = BestCheckpoint(workdir, config.train.keep_best, config.train.early_stop_patience, start)
  early_stop = best.should_stop()  # a resumed run that had stopped early stays stopped
  compiled: set[tuple[int, ...]] = set()  # batch shapes the train step has been compiled for
  try:
    while step < config.train.num_steps and not early_stop:
      n = call_length(step, config.train)
      local = [next(stream) for _ in range(n)]
      local = stack_batches(local) if stacked else local[0]
      padding += [padding_fraction(local, config.model.pad_id)] * n
      state, metrics = train_step(state, global_batch(local, mesh, rules), rng)
      if local["inputs"].shape not in compiled:  # this call compiled: give back what the compiler freed
        compiled.add(local["inputs"].shape)
        release_free_memory()
      interrupt.loop_active.set()  # from the first call on (compiled): Ctrl-C stops at a step boundary
      pending.append(metrics)
      guard.add(step, metrics["nonfinite"])
      step += n
      bar.update(n)
      # A preemption signal on any process: log, checkpoint this step, stop (all at the same step).
      stop = max_over_processes(interrupt.pending())
      if stop:
        interrupt.adopt(stop)  # a process that was not signalled exits with the signalled one's status
      if step % config.train.eval_every == 0 or step == config.train.num_steps:
        # Time the queued steps, not the evaluation: wait for them, then pause the clock.
        jax.block_until_ready(state)
        seconds += time.perf_counter() - last_time
        limited = itertools.islice(val_batches, config.train.eval_batches or None)
        scores = {f"val_{k}": v for k, v in evaluate_loss(eval_step, state.params, limited, mesh, rules).items()}
        if config.train.keep_best.removeprefix("val_") in task.validation_scores:
          scores.update(task_scores(task, vocab, model, mesh, state.params, step, splits["validation"]))
        logger.write({"step": step, **scores}, prefix="validation")
        if jax.process_index() == 0:
          print(json.dumps({"step": step, **{k: v for k, v in scores.items() if k != "val_num_tokens"}}), flush=True)
        early_stop = best.update(step, scores, state.params)
        release_free_memory()  # the evaluation's temporaries (and its compiles' on the first one)
        last_time = time.perf_counter()
      if stop or early_stop or step % config.train.log_every == 0 or step == config.train.num_steps:
        guard.check()
        history = _unstack(jax.device_get(pending))
        seconds += time.perf_counter() - last_time
        record = _summarise(history, step, seconds, padding)
        logger.write(record)
        bar.set_postfix(loss=record["loss"])
        if not show_bar and jax.process_index() == 0:
          print(json.dumps(record), flush=True)
        pending, padding, seconds, last_time = [], [], 0.0, time.perf_counter()
      if stop or early_stop or step % config.train.checkpoint_every == 0 or step == config.train.num_steps:
        guard.check()  # never checkpoint the state after a non-finite step under nan_policy=abort
        checkpointer.save(state, force=True)
      checkpointer.check()  # a failed background save stops the run now, not at the next save
      if stop:
        raise KeyboardInterrupt  # `finally` waits until the checkpoint is committed
    if early_stop and jax.process_index() == 0:
      print(best.stop_message(), file=sys.stderr, flush=True)
  finally:
    interrupt.loop_active.clear()
    bar.close()
    checkpointer.close()  # waits for pending asynchronous checkpoint writes
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
  steps whose update was skipped (float16 overflow or non-finite values), `nonfinite_skips`
  those skipped for non-finite values (`train.nan_policy=skip`), which the loss, nll and
  accuracy leave out (None if all were), `grad_norm` averages the applied steps (None if
  none was), `loss_scale` is the scale of the last step."""
  tokens = sum(float(m["num_tokens"]) for m in history)
  finite = [m for m in history if not float(m["nonfinite"])]
  n = max(sum(float(m["num_tokens"]) for m in finite), 1.0)
  applied = [float(m["grad_norm"]) for m in history if not float(m["skipped"])]

  def mean(key: str) -> float | None:
    return sum(float(m[key]) for m in finite) / n if finite else None

  return {
    "step": step,
    "loss": mean("loss"),
    "nll": mean("nll"),
    "accuracy": mean("correct"),
    "learning_rate": float(history[-1]["learning_rate"]),
    "grad_norm": float(np.mean(applied)) if applied else None,
    "skipped": int(sum(float(m["skipped"]) for m in history)),
    "nonfinite_skips": len(history) - len(finite),
    "loss_scale": float(history[-1]["loss_scale"]),
    "tokens_per_sec": tokens / max(seconds, 1e-9),
    "steps_per_sec": len(history) / max(seconds, 1e-9),
    "padding_fraction": float(np.mean(padding)),
    **summarise_router(finite, n),
  }


class _NonFiniteGuard:
  """Applies `train.nan_policy` to the steps' `nonfinite` flags (see `make_train_step`).

  The flags are fetched, in step order, only where the loop waits anyway: before a log line
  and before a checkpoint (a per-step fetch would stall the dispatch queue). Under `abort` the
  steps queued after a non-finite one are discarded with it: no state from it on is saved.
  The step never applies a non-finite update, so params stay finite either way. Consecutive
  skips are counted across calls (`steps_per_call` > 1 gives `[n]` flags per call) but not
  across a restart.
  """

  def __init__(self, train: TrainConfig):
    self.policy, self.limit = train.nan_policy, train.max_consecutive_skips
    self.in_a_row = 0
    self._calls: list[tuple[int, jax.Array]] = []  # (steps before the call, its flags: scalar or [n])

  def add(self, step: int, flags: jax.Array) -> None:
    self._calls.append((step, flags))

  def check(self) -> None:
    """Raises NonFiniteError (one line naming the step) at the first non-finite step under
    `abort`, or at the `max_consecutive_skips`-th non-finite step in a row under `skip`."""
    calls, self._calls = self._calls, []
    for start, flags in jax.device_get(calls):
      for step, bad in enumerate(np.atleast_1d(flags), start=start + 1):
        self.in_a_row = self.in_a_row + 1 if bad else 0
        if bad and self.policy == "abort":
          raise NonFiniteError(
            f"step {step} has a non-finite loss, gradient or update (train.nan_policy=abort); nothing from it on "
            "was checkpointed: lower optim.learning_rate or set train.nan_policy=skip, then rerun to resume "
            "from the last checkpoint"
          )
        if self.in_a_row >= self.limit:
          raise NonFiniteError(
            f"steps {step - self.limit + 1} to {step} all had a non-finite loss, gradient or update "
            f"(train.max_consecutive_skips={self.limit}); lower optim.learning_rate, then rerun to resume "
            "from the last checkpoint"
          )
