"""Mixed precision: dynamic loss scaling for float16 compute (the dtype policy itself is
parsed by `jaxformer/config/policy.py`).

float16 has 5 exponent bits, so small gradients underflow to zero in the backward pass.
Dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2)
multiplies the loss by `scale` before differentiation and divides the float32 gradients by
it; a step whose gradients are not finite is skipped and the scale halved, and after
`growth_interval` finite steps in a row the scale doubles.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

MIN_LOSS_SCALE = 1.0  # the scale never backs off below this: gradients are never scaled down


@flax.struct.dataclass
class LossScale:
  """Dynamic loss-scale state, part of the train state (replicated, checkpointed).

  Attributes:
    scale: float32 scalar multiplying the loss before differentiation.
    good_steps: int32 scalar, finite steps since the scale last changed.
  """

  scale: jax.Array
  good_steps: jax.Array


def initial_loss_scale(scale: float) -> LossScale:
  """A fresh `LossScale` at `scale` with no good steps counted."""
  return LossScale(jnp.asarray(scale, jnp.float32), jnp.asarray(0, jnp.int32))


def next_loss_scale(
  state: LossScale, finite: jax.Array, growth_interval: int, growth_factor: float, backoff_factor: float
) -> LossScale:
  """The scale after a step whose gradients were `finite` (bool scalar).

  Non-finite: scale * backoff_factor (not below MIN_LOSS_SCALE), good steps reset to 0.
  Finite: good steps + 1; on reaching `growth_interval` the scale is multiplied by
  `growth_factor` (unless that overflows float32) and the count restarts from 0.
  """
  good = state.good_steps + 1
  grow = good >= growth_interval
  grown = state.scale * growth_factor
  grown = jnp.where(grow & jnp.isfinite(grown), grown, state.scale)
  backed_off = jnp.maximum(state.scale * backoff_factor, MIN_LOSS_SCALE)
  return LossScale(
    scale=jnp.where(finite, grown, backed_off).astype(jnp.float32),
    good_steps=jnp.where(finite & ~grow, good, 0).astype(jnp.int32),
  )


def select_tree(pred: jax.Array, on_true, on_false):
  """`on_true` if the bool scalar `pred` holds, else `on_false` (two trees of the same structure).

  One `lax.cond`, not a `jnp.where` per leaf: XLA fuses the scalar flag's whole computation (a
  reduction over every leaf) into each leaf's select, which made a train step's compile
  grow with leaves x leaves (a minute for a 2-layer model)."""
  return jax.lax.cond(pred, lambda: on_true, lambda: on_false)


__all__ = ["LossScale", "MIN_LOSS_SCALE", "initial_loss_scale", "next_loss_scale", "select_tree"]
