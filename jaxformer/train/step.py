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
from jaxformer.precision import all_finite, next_loss_scale, select_tree
from jaxformer.train.losses import cross_entropy_sums
from jaxformer.train.optim import make_schedule
from jaxformer.train.state import TrainState
from jaxformer.tasks import get_task
from jaxformer.tasks.base import Task

Batch = dict[str, jax.Array]


def loss_fn(task: Task, model: nn.Module, params, batch: Batch, rng: jax.Array | None, label_smoothing: float,
            z_loss: float = 0.0):
  """(float32 loss per real target token, metric sums) of `task`'s `model` on `batch`.

  `batch` holds int32 `inputs` and `targets` `[batch, length]` (0 is padding; what they
  mean depends on the task, see `jaxformer/tasks/`) and, when packed, segment ids and
  positions; `rng` is the step's key (dropout,
  MLM masks), None for evaluation. The sums are those of `cross_entropy_sums` (with
  `z_loss`); the loss is computed in float32 whatever the compute dtype.
  """
  logits, targets, weights = task.outputs(model, params, batch, rng)
  sums = cross_entropy_sums(logits, targets, weights, label_smoothing, z_loss)
  # Normalise by the global count of real target tokens (section 5.4 loss per token).
  return sums["loss"] / jnp.maximum(sums["num_tokens"], 1.0), sums


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, config: Config, mesh: Mesh,
                    state_shardings: TrainState) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict]]:
  """Returns jitted `(state, batch, rng) -> (state, metrics)`: one optimizer step.

  `batch` holds int32 `inputs` and `targets` `[global_batch, length]`, sharded over the
  data axes; `rng` is the run's base key: the step's dropout key is fold_in(rng, step),
  so it continues exactly across restarts. `state` is donated.

  With dynamic loss scaling (`config.precision.dynamic_loss_scale`, float16 by default) the
  loss is multiplied by `state.loss_scale.scale` before differentiation and the float32
  gradients divided by it. A step with a non-finite gradient is skipped: params and
  opt_state stay bit-identical, `step` still advances, and the scale is updated by
  `precision.next_loss_scale` (backoff on overflow, growth after `growth_interval` finite steps).

  Metrics: `loss`, `nll`, `correct`, `num_tokens` (sums), `grad_norm` (of the unscaled
  gradients), `learning_rate` (the schedule at `step`; the optimizer's own count lags by the
  skipped steps), `skipped` (1.0 if the update was skipped, else 0.0) and `loss_scale` (the
  scale this step used; 1.0 without scaling).
  """
  step = _step_function(model, tx, config)
  jitted = jax.jit(step, in_shardings=(state_shardings, sh.batch_sharding(mesh), sh.replicated(mesh)),
                   out_shardings=(state_shardings, sh.replicated(mesh)), donate_argnums=(0,))
  return _with_mesh(jitted, mesh)


def make_multi_step(model: nn.Module, tx: optax.GradientTransformation, config: Config, mesh: Mesh,
                    state_shardings: TrainState) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict]]:
  """Returns jitted `(state, batches, rng) -> (state, metrics)`: n optimizer steps in one call.

  `batches` holds int32 `inputs` and `targets` `[n, global_batch, length]` (the data axes
  shard dimension 1); the call runs `make_train_step`'s step on `batches[i]` for i = 0..n-1
  as one `lax.scan`, so step i gets exactly its own batch and dropout key and the result
  equals n single-step calls. Each metric comes back stacked, `[n]`. One program per n
  (and per length): `train.steps_per_call` sets the usual n.

  Why: on CPU every call pays a fixed cost (dispatch, and XLA allocating and faulting in
  its temporary buffers afresh), which is a large share of a small model's step.
  """
  step = _step_function(model, tx, config)

  def steps(state: TrainState, batches: Batch, rng: jax.Array):
    return jax.lax.scan(lambda s, batch: step(s, batch, rng), state, batches)

  stacked = sh.batch_sharding(mesh, stacked=True)  # one sharding for every key of the batch dict
  jitted = jax.jit(steps, in_shardings=(state_shardings, stacked, sh.replicated(mesh)),
                   out_shardings=(state_shardings, sh.replicated(mesh)), donate_argnums=(0,))
  return _with_mesh(jitted, mesh)


def make_train_call(model: nn.Module, tx: optax.GradientTransformation, config: Config, mesh: Mesh,
                    state_shardings: TrainState) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict]]:
  """The loop's unit of work: `make_multi_step` (stacked `[n, batch, length]` batches, metrics
  `[n]`) when `train.steps_per_call > 1`, else `make_train_step`."""
  factory = make_multi_step if config.train.steps_per_call > 1 else make_train_step
  return factory(model, tx, config, mesh, state_shardings)


def _step_function(model: nn.Module, tx: optax.GradientTransformation, config: Config):
  """The unjitted `(state, batch, rng) -> (state, metrics)` that both factories compile."""
  schedule = make_schedule(config.optim, config.model.d_model)
  label_smoothing, z_loss = config.optim.label_smoothing, config.train.z_loss
  task = get_task(config)
  use_rng = config.model.dropout_rate > 0 or config.model.attention_dropout_rate > 0 or task.needs_rng
  precision = config.precision
  dynamic = precision.dynamic_loss_scale

  def scaled_loss(params, batch, rng, scale):
    loss, sums = loss_fn(task, model, params, batch, rng, label_smoothing, z_loss)
    return loss * scale, sums

  def step(state: TrainState, batch: Batch, rng: jax.Array):
    step_rng = jax.random.fold_in(rng, state.step) if use_rng else None
    scale = state.loss_scale.scale if dynamic else jnp.ones((), jnp.float32)
    (_, sums), grads = jax.value_and_grad(scaled_loss, has_aux=True)(state.params, batch, step_rng, scale)
    if dynamic:
      grads = jax.tree.map(lambda g: g / scale, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    loss_scale, skipped = state.loss_scale, jnp.zeros((), jnp.float32)
    if dynamic:
      finite = all_finite(grads)
      params, opt_state = select_tree(finite, (params, opt_state), (state.params, state.opt_state))
      loss_scale = next_loss_scale(state.loss_scale, finite, precision.growth_interval,
                                   precision.growth_factor, precision.backoff_factor)
      skipped = 1.0 - finite.astype(jnp.float32)
    metrics = dict(sums, grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step),
                   skipped=skipped, loss_scale=scale)
    return TrainState(state.step + 1, params, opt_state, loss_scale), metrics

  return step


def make_eval_step(model: nn.Module, config: Config, mesh: Mesh,
                   param_shardings) -> Callable[[object, Batch], dict]:
  """Returns jitted `(params, batch) -> metric sums` with dropout off (validation loss)."""
  label_smoothing, z_loss = config.optim.label_smoothing, config.train.z_loss
  task = get_task(config)

  def step(params, batch: Batch):
    return loss_fn(task, model, params, batch, None, label_smoothing, z_loss)[1]

  jitted = jax.jit(step, in_shardings=(param_shardings, sh.batch_sharding(mesh)),
                   out_shardings=sh.replicated(mesh))
  return _with_mesh(jitted, mesh)


def _with_mesh(fn, mesh: Mesh):
  """Runs `fn` with the mesh and the logical-axis rules active at construction time (the
  run's `mesh.rules`), so `constrain` resolves the same way at every call."""
  rules = sh.current_rules()

  def wrapped(*args):
    with jax.set_mesh(mesh), sh.axis_rules(rules):
      return fn(*args)
  wrapped.jitted = fn
  return wrapped
