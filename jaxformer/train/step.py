"""Factories for the jitted train and eval steps.

Each factory closes over the model and config and returns a pure function jitted with
explicit in/out shardings; the train step donates the state so its buffers are reused.
Metrics are sums plus a token count (normalised on the host), so they add up exactly
across devices, batches and processes.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.config import Config, ConfigError
from jaxformer.layers import lora
from jaxformer.models.pipeline import pipelined
from jaxformer.tasks import get_task
from jaxformer.tasks.objective import loss_fn
from jaxformer.train.loss_scale import next_loss_scale, select_tree
from jaxformer.train.optim import make_schedule
from jaxformer.train.state import TrainState

Batch = dict[str, jax.Array]


def make_train_step(
  model: nn.Module, tx: optax.GradientTransformation, config: Config, mesh: Mesh, state_shardings: TrainState
) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict]]:
  """Returns jitted `(state, batch, rng) -> (state, metrics)`: one optimizer step.

  `batch` holds int32 `inputs` and `targets` `[global_batch, length]`, sharded over the
  data axes; `rng` is the run's base key: the step's dropout key is fold_in(rng, step),
  so it continues exactly across restarts. `state` is donated.

  Gradient accumulation (`train.grad_accum_steps` = k > 1): the batch is split into k
  microbatches of rows j, j + k, j + 2k, ... (each device keeps its own rows, see
  `_microbatches`), run one after another in a `lax.scan` (activation memory of one
  microbatch). The gradients of the microbatch loss sums are added and divided by the real
  target tokens of the whole batch, so the step equals the big-batch step up to float rounding
  and the metric sums are those of the whole batch. Microbatch j draws its dropout (and MLM
  masking) from fold_in(step key, j): with dropout on, the step is an equally valid sample, not
  the big batch's bits. The batch rows must divide by k times the data-parallel size
  (ConfigError at the first call otherwise).

  Pipeline parallelism (`mesh.stage` = S > 1): the model's layer stacks run as a GPipe
  pipeline of S stages fed `train.microbatches` microbatches of each (accumulation) batch
  (`models.pipeline`); the losses and params equal the unpipelined step's up to float rounding.

  With dynamic loss scaling (`config.precision.dynamic_loss_scale`, float16 by default) the
  loss is multiplied by `state.loss_scale.scale` before differentiation and the float32
  gradients divided by it. A step whose loss, gradient norm or update norm is not finite (so
  some gradient, param or moment would not be, or a squared norm overflows float32) is skipped:
  params and opt_state stay bit-identical, `step` still advances, and the scale is updated by
  `loss_scale.next_loss_scale` (backoff on a skipped step, growth after `growth_interval`
  applied steps). Such a step is flagged `nonfinite` for
  `train.nan_policy` unless it is a loss-scale overflow: a finite loss whose scaled gradients
  overflowed, the normal way dynamic scaling finds its scale.

  LoRA (params holding adapters, `model.lora_rank` > 0): the loss is differentiated with respect to
  `lora.trainable(params)`, the adapters, only, and only they are updated; the frozen base params
  come back bitwise unchanged, get no gradient buffers, and clipping, weight decay, the finiteness
  checks and `grad_norm` see the adapters' gradients alone.

  Metrics: `loss`, `nll`, `correct`, `num_tokens` (sums; with experts also the router's, see
  `loss_fn`), `grad_norm` (of the unscaled gradients), `learning_rate` (the schedule at
  `step`; the optimizer's own count lags by the skipped steps), `skipped` (1.0 if the update
  was skipped, else 0.0), `nonfinite` (1.0 if it was skipped for non-finite values other than
  a loss-scale overflow) and `loss_scale` (the scale this step used; 1.0 without scaling).
  """
  step = _step_function(model, tx, config, mesh, state_shardings.params)
  rules = sh.rules_for(config.mesh)
  jitted = jax.jit(
    step,
    in_shardings=(state_shardings, sh.batch_sharding(mesh, rules=rules), sh.replicated(mesh)),
    out_shardings=(state_shardings, sh.replicated(mesh)),
    donate_argnums=(0,),
  )
  return sh.with_mesh(jitted, mesh, rules)


def make_multi_step(
  model: nn.Module, tx: optax.GradientTransformation, config: Config, mesh: Mesh, state_shardings: TrainState
) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict]]:
  """Returns jitted `(state, batches, rng) -> (state, metrics)`: n optimizer steps in one call.

  `batches` holds int32 `inputs` and `targets` `[n, global_batch, length]` (the data axes
  shard dimension 1); the call runs `make_train_step`'s step on `batches[i]` for i = 0..n-1
  as one `lax.scan`, so step i gets exactly its own batch and dropout key and the result
  equals n single-step calls. Each metric comes back stacked, `[n]`. One program per n
  (and per length): `train.steps_per_call` sets the usual n.

  Why: on CPU every call pays a fixed cost (dispatch, and XLA allocating and faulting in
  its temporary buffers afresh), which is a large share of a small model's step.
  """
  step = _step_function(model, tx, config, mesh, state_shardings.params)

  def steps(state: TrainState, batches: Batch, rng: jax.Array):
    return jax.lax.scan(lambda s, batch: step(s, batch, rng), state, batches)

  rules = sh.rules_for(config.mesh)
  stacked = sh.batch_sharding(mesh, stacked=True, rules=rules)  # one sharding for every key of the batch dict
  jitted = jax.jit(
    steps,
    in_shardings=(state_shardings, stacked, sh.replicated(mesh)),
    out_shardings=(state_shardings, sh.replicated(mesh)),
    donate_argnums=(0,),
  )
  return sh.with_mesh(jitted, mesh, rules)


def make_train_call(
  model: nn.Module, tx: optax.GradientTransformation, config: Config, mesh: Mesh, state_shardings: TrainState
) -> Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict]]:
  """The loop's unit of work: `make_multi_step` (stacked `[n, batch, length]` batches, metrics
  `[n]`) when `train.steps_per_call > 1`, else `make_train_step`."""
  factory = make_multi_step if config.train.steps_per_call > 1 else make_train_step
  return factory(model, tx, config, mesh, state_shardings)


def _step_function(model: nn.Module, tx: optax.GradientTransformation, config: Config, mesh: Mesh, param_shardings):
  """The unjitted `(state, batch, rng) -> (state, metrics)` that both factories compile."""
  model = pipelined(model, config, mesh)
  schedule = make_schedule(config.optim, config.model.d_model)
  label_smoothing, z_loss = config.optim.label_smoothing, config.train.z_loss
  task = get_task(config)
  use_rng = config.model.dropout_rate > 0 or config.model.attention_dropout_rate > 0 or task.needs_rng
  precision = config.precision
  dynamic = precision.dynamic_loss_scale
  accum = config.train.grad_accum_steps
  rules = sh.rules_for(config.mesh)

  def scaled_loss(trained, params, batch, rng, factor, per_token=True):
    loss, sums = loss_fn(task, model, lora.replace(params, trained), batch, rng, label_smoothing, z_loss)
    return (loss if per_token else sums["loss"]) * factor, sums

  grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)  # with respect to the trained params only

  def grads_and_sums(params, batch, rng, scale):
    """(gradient of `scale` times the loss per real target token of `batch` with respect to
    `lora.trainable(params)`, metric sums)."""
    trained = lora.trainable(params)
    if accum == 1:
      (_, sums), grads = grad_fn(trained, params, batch, rng, scale)
      return grads, sums
    # Microbatches differentiate loss sums over a fixed count, the batch's target positions (at least
    # its real tokens, so float16 cotangents are no larger than the big batch's); the total is then
    # rescaled to the real tokens, so each token weighs the same whichever microbatch holds it.
    positions = batch["targets"].size

    def microstep(total, xs):
      index, micro = xs
      micro_rng = None if rng is None else jax.random.fold_in(rng, index)
      (_, sums), grads = grad_fn(trained, params, micro, micro_rng, scale / positions, False)
      return jax.tree.map(jnp.add, total, grads), sums

    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, trained), lora.trainable(param_shardings))
    grads, sums = jax.lax.scan(microstep, zeros, (jnp.arange(accum), _microbatches(batch, accum, mesh, rules)))
    sums = jax.tree.map(lambda x: jnp.sum(x, axis=0), sums)
    return jax.tree.map(lambda g: g * (positions / jnp.maximum(sums["num_tokens"], 1.0)), grads), sums

  def step(state: TrainState, batch: Batch, rng: jax.Array):
    step_rng = jax.random.fold_in(rng, state.step) if use_rng else None
    scale = state.loss_scale.scale if dynamic else jnp.ones((), jnp.float32)
    grads, sums = grads_and_sums(state.params, batch, step_rng, scale)
    if dynamic:
      grads = jax.tree.map(lambda g: g / scale, grads)
    trained = lora.trainable(state.params)  # all params, or with LoRA the adapters
    with jax.named_scope("optimizer"):  # names the ops in profiles (benchmarks/profile_train_step.py)
      updates, opt_state = tx.update(grads, state.opt_state, trained)
      params = optax.apply_updates(trained, updates)
    # Finiteness from two global norms, one reduction per leaf: a finite squared norm has finite
    # elements, Adam's moments are then convex mixes of finite values, and finite params plus a
    # finite update stay finite. (An is-finite check of every leaf of the gradients, params and
    # both moments was 40% of a tiny train step's compile.) A float32 overflow of a squared norm,
    # past about 1.8e19 in one element, counts as non-finite too.
    grad_norm = optax.tree.norm(grads)
    loss_finite, grads_finite = jnp.isfinite(sums["loss"]), jnp.isfinite(grad_norm)
    applied = loss_finite & grads_finite & jnp.isfinite(optax.tree.norm(updates))
    params, opt_state = select_tree(applied, (params, opt_state), (trained, state.opt_state))
    params = lora.replace(state.params, params)
    loss_scale = state.loss_scale
    if dynamic:
      loss_scale = next_loss_scale(
        state.loss_scale, applied, precision.growth_interval, precision.growth_factor, precision.backoff_factor
      )
    # Under loss scaling, overflowing gradients of a finite loss are the scale's business, not a fault.
    overflow = loss_finite & ~grads_finite if dynamic else jnp.zeros((), bool)
    metrics = dict(
      sums,
      grad_norm=grad_norm,
      learning_rate=schedule(state.step),
      skipped=1.0 - applied.astype(jnp.float32),
      nonfinite=(~applied & ~overflow).astype(jnp.float32),
      loss_scale=scale,
    )
    return TrainState(state.step + 1, params, opt_state, loss_scale), metrics

  return step


def _microbatches(batch: Batch, k: int, mesh: Mesh, rules: sh.Rules) -> Batch:
  """Each `[rows, ...]` array of `batch` as `[k, rows / k, ...]`: microbatch j holds rows j, j + k, j + 2k, ...

  The data axes shard the rows in contiguous blocks, one per device; a block of a multiple of k
  rows holds its share of every strided microbatch, so the split moves no data and each
  microbatch stays sharded over the data axes (a contiguous split would put microbatch 0 on the
  first devices alone).

  Raises:
    ConfigError: the rows are not a multiple of k times the data-parallel size.
  """
  rows = batch["targets"].shape[0]
  dp = sh.data_parallel_size(mesh, rules)
  if rows % (k * dp):
    raise ConfigError(
      f"train.grad_accum_steps={k} splits the batch of {rows} rows into microbatches that do not "
      f"divide over the {dp} data-parallel devices (mesh.data*mesh.fsdp*mesh.expert); use a "
      f"train.batch_size that is a multiple of {k * dp}, or fewer train.grad_accum_steps"
    )
  sharding = sh.batch_sharding(mesh, stacked=True, rules=rules)

  def split(x):
    x = x.reshape(rows // k, k, *x.shape[1:]).swapaxes(0, 1)  # [k, rows / k, ...]
    return jax.lax.with_sharding_constraint(x, sharding)

  return jax.tree.map(split, batch)
