"""The training state and how it is created already sharded on a mesh."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.layers import lora
from jaxformer.models.abstract import abstract_params, init_params
from jaxformer.train.loss_scale import LossScale, initial_loss_scale


@flax.struct.dataclass
class TrainState:
  """Everything a checkpoint holds: `step` (int32 scalar, steps taken, skipped ones
  included), `params` and `opt_state` (float32), and `loss_scale` (dynamic loss-scale state,
  replicated; scale 1 and unused unless float16 loss scaling is on).

  With LoRA adapters in `params` the optimizer state is that of `lora.trainable(params)`: the
  adapters alone; the frozen base has no moments (`make_optimizer` never sees it), and with
  `precision.policy=params=bfloat16` (or float16) its projection kernels are held in that dtype
  (`lora.hold_frozen`).

  Dropout randomness is derived from (seed, step), so it needs no stored key and a
  resumed run draws the same bits it would have drawn without the interruption. The
  loss scale is always present so the checkpoint layout does not depend on the precision
  policy: a run may resume, or be evaluated, under another policy.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  loss_scale: LossScale


def abstract_state(model: nn.Module, tx: optax.GradientTransformation) -> tuple[TrainState, TrainState]:
  """Shapes and logical PartitionSpecs of the train state, without allocating it.

  Returns:
    (abstract TrainState of ShapeDtypeStructs, TrainState of logical PartitionSpecs).
  """
  params, param_specs = abstract_params(model)
  abstract = jax.eval_shape(
    lambda p: TrainState(jnp.array(0, jnp.int32), p, tx.init(lora.trainable(p)), initial_loss_scale(1.0)), params
  )
  # Optimizer moments mirror the trained params; scalars (counts) are replicated.
  opt_specs = optax.tree_map_params(
    tx,
    lambda _, spec: spec,
    abstract.opt_state,
    lora.trainable(param_specs),
    transform_non_params=lambda _: jax.sharding.PartitionSpec(),
  )
  replicated = jax.sharding.PartitionSpec()
  specs = TrainState(replicated, param_specs, opt_specs, LossScale(replicated, replicated))
  return abstract, specs


def state_shardings(
  model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh, rules: sh.Rules = sh.LOGICAL_RULES
) -> tuple[TrainState, TrainState]:
  """(abstract state, NamedSharding tree) for `mesh` by `rules` (the run's `sh.rules_for(config.mesh)`).

  Raises:
    ConfigError: a dimension does not split evenly over its mesh axes.
  """
  abstract, specs = abstract_state(model, tx)
  shardings = sh.logical_to_sharding(specs, mesh, rules)
  sh.check_divisible(abstract, shardings)
  return abstract, shardings


def create_state(
  model: nn.Module,
  tx: optax.GradientTransformation,
  mesh: Mesh,
  seed: int,
  shardings: TrainState,
  loss_scale: float = 1.0,
  rules: sh.Rules = sh.LOGICAL_RULES,
  known: Any = None,
  step: int = 0,
) -> TrainState:
  """Initialises the state directly into `shardings`: no device ever holds the full,
  unsharded parameters unless the mesh says so. `loss_scale` is the starting dynamic
  loss scale (`PrecisionConfig.start_scale`); `rules` those `shardings` were made by.
  `known`: params that replace their initial values (a nested dict of some of the paths, such
  as a base checkpoint's params under new LoRA adapters; their initialisation is never
  computed); the state starts at `step` with a fresh optimizer state."""

  def init(rng, known):
    params = init_params(model, rng, known)
    return TrainState(
      jnp.array(step, jnp.int32), params, tx.init(lora.trainable(params)), initial_loss_scale(loss_scale)
    )

  with sh.bind(mesh, rules):
    # `known`'s buffers are donated: they become the state's, so the params are never held twice.
    return jax.jit(init, out_shardings=shardings, donate_argnums=1)(jax.random.key(seed), known)
