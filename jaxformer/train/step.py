"""Factories for the jitted train and eval steps.

Each factory closes over the model and config and returns a pure function jitted with
explicit in/out shardings; the train step donates the state so its buffers are reused.
Metrics are sums plus a token count (normalised on the host), so they add up exactly
across devices, batches and processes.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.config import Config
from jaxformer.train.losses import cross_entropy_sums
from jaxformer.train.optim import make_schedule
from jaxformer.train.state import TrainState
from jaxformer.train.tasks import Task

Batch = dict[str, jax.Array]


def _loss_fn(task: Task, params, batch: Batch, rng: jax.Array | None, label_smoothing: float):
  logits, targets, weights = task.outputs(params, batch, rng)
  sums = cross_entropy_sums(logits, targets, weights, label_smoothing)
  # Normalise by the global count of real target tokens (section 5.4 loss per token).
  return sums["loss"] / jnp.maximum(sums["num_tokens"], 1.0), sums


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, config: Config, mesh: Mesh,
                    state_shardings: TrainState) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict]]:
  """Returns jitted `(state, batch, rng) -> (state, metrics)`.

  `batch` holds int32 `inputs` and `targets` `[global_batch, length]`, sharded over the
  data axes; `rng` is the run's base key: the step's dropout key is fold_in(rng, step),
  so it continues exactly across restarts. `state` is donated.
  Metrics: `loss`, `nll`, `correct`, `num_tokens` (sums), `grad_norm`, `learning_rate`.
  """
  schedule = make_schedule(config.optim, config.model.d_model)
  label_smoothing = config.optim.label_smoothing
  task = Task(model, config)
  use_rng = config.model.dropout_rate > 0 or config.model.attention_dropout_rate > 0 or task.needs_rng

  def step(state: TrainState, batch: Batch, rng: jax.Array):
    step_rng = jax.random.fold_in(rng, state.step) if use_rng else None
    grad_fn = jax.value_and_grad(lambda p: _loss_fn(task, p, batch, step_rng, label_smoothing), has_aux=True)
    (_, sums), grads = grad_fn(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(sums, grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step))
    return TrainState(state.step + 1, params, opt_state), metrics

  jitted = jax.jit(step, in_shardings=(state_shardings, _batch_shardings(mesh), sh.replicated(mesh)),
                   out_shardings=(state_shardings, sh.replicated(mesh)), donate_argnums=(0,))
  return _with_mesh(jitted, mesh)


def make_eval_step(model: nn.Module, config: Config, mesh: Mesh,
                   param_shardings) -> Callable[[object, Batch], dict]:
  """Returns jitted `(params, batch) -> metric sums` with dropout off (validation loss)."""
  label_smoothing = config.optim.label_smoothing
  task = Task(model, config)

  def step(params, batch: Batch):
    return _loss_fn(task, params, batch, None, label_smoothing)[1]

  jitted = jax.jit(step, in_shardings=(param_shardings, _batch_shardings(mesh)), out_shardings=sh.replicated(mesh))
  return _with_mesh(jitted, mesh)


def _batch_shardings(mesh: Mesh) -> dict:
  return {"inputs": sh.batch_sharding(mesh), "targets": sh.batch_sharding(mesh)}


def _with_mesh(fn, mesh: Mesh):
  """Runs `fn` with the mesh and logical-axis rules active, so `constrain` resolves."""
  def wrapped(*args):
    with jax.set_mesh(mesh), sh.axis_rules():
      return fn(*args)
  wrapped.jitted = fn
  return wrapped
