"""Mixed precision: one dtype policy and dynamic loss scaling for float16 compute.

A policy names three dtypes: `params` (storage of parameters and optimizer state),
`compute` (activations and matmuls inside the model) and `output` (logits and the loss).
Parameters and optimizer state are always float32, and so are LayerNorm statistics,
attention softmax, logits and the loss; only `compute` varies (float32, bfloat16, float16).

float16 has 5 exponent bits, so small gradients underflow to zero in the backward pass.
Dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2)
multiplies the loss by `scale` before differentiation and divides the float32 gradients by
it; a step whose gradients are not finite is skipped and the scale halved, and after
`growth_interval` finite steps in a row the scale doubles.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

DTYPES = ("float32", "bfloat16", "float16")
KEYS = ("params", "compute", "output")
MIN_LOSS_SCALE = 1.0  # the scale never backs off below this: gradients are never scaled down


@dataclasses.dataclass(frozen=True)
class Policy:
  """Dtypes of parameters, compute and outputs (each a `jnp.dtype`)."""
  param_dtype: jnp.dtype = jnp.dtype("float32")
  compute_dtype: jnp.dtype = jnp.dtype("float32")
  output_dtype: jnp.dtype = jnp.dtype("float32")

  def __str__(self) -> str:
    return f"params={self.param_dtype.name},compute={self.compute_dtype.name},output={self.output_dtype.name}"


def parse_policy(text: str) -> Policy:
  """Parses "params=float32,compute=bfloat16,output=float32" (keys in any order; a missing
  key means float32).

  Raises:
    ValueError: one line naming the problem: empty text, an item without "=", an unknown
      or repeated key, an unknown dtype, or params/output other than float32.
  """
  names = {}
  for item in text.split(","):
    if "=" not in item:
      raise ValueError(f"{item.strip()!r} is not key=dtype; write e.g. params=float32,compute=bfloat16,output=float32")
    key, name = (part.strip() for part in item.split("=", 1))
    if key not in KEYS:
      raise ValueError(f"unknown key {key!r}; use {', '.join(KEYS)}")
    if key in names:
      raise ValueError(f"{key} is given twice")
    if name not in DTYPES:
      raise ValueError(f"unknown dtype {name!r} for {key}; use {', '.join(DTYPES)}")
    names[key] = name
  if names.get("params", "float32") != "float32":
    raise ValueError(f"params={names['params']}: parameters and optimizer state stay float32; use params=float32")
  if names.get("output", "float32") != "float32":
    raise ValueError(f"output={names['output']}: logits and the loss are always float32; use output=float32")
  return Policy(compute_dtype=jnp.dtype(names.get("compute", "float32")))


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


def all_finite(tree) -> jax.Array:
  """bool scalar: every element of every array leaf of `tree` is finite."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def next_loss_scale(state: LossScale, finite: jax.Array, growth_interval: int, growth_factor: float,
                    backoff_factor: float) -> LossScale:
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
      good_steps=jnp.where(finite & ~grow, good, 0).astype(jnp.int32))


def select_tree(pred: jax.Array, on_true, on_false):
  """Leafwise `jnp.where(pred, on_true, on_false)` over two trees of the same structure."""
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


__all__ = ["DTYPES", "KEYS", "LossScale", "MIN_LOSS_SCALE", "Policy", "all_finite", "initial_loss_scale",
           "next_loss_scale", "parse_policy", "select_tree"]
