"""Parameters added or multiplied at every token (biases, norm scales and offsets), with
gradients summed over the tokens by a matrix-vector product.

The gradient of a parameter broadcast over `[batch, length, ...]` is a sum over the batch and
length axes. XLA:CPU splits such a reduction for accuracy into a strided `reduce-window` of 32-row
windows and a final reduce; that pair ran 9-14x slower than the same sum as a product with a
vector of ones, which Eigen runs as a matvec (f32[12, 64, 512] -> [512]: 1.0 ms against 0.07 ms, 2
cores; `benchmarks/profile_train_step.py` found the pairs at a fifth of a character LM's step).
The forward passes are the plain `x + b` and `y * scale + bias`; the backward passes are the
autodiff ones with each broadcast's sum taken by `token_sum` (in float32).
"""

import math

import jax
import jax.numpy as jnp


def token_sum(a: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
  """The sum of `a` `[..., *shape]` over its leading axes, as `ones @ a.reshape(n, prod(shape))`
  with float32 accumulation, cast to `dtype`: `[*shape]`.

  Raises:
    ValueError: `a`'s trailing axes are not `shape`.
  """
  if tuple(a.shape[a.ndim - len(shape) :]) != tuple(shape):
    raise ValueError(f"token_sum: trailing axes of {a.shape} are not {shape}")
  size = math.prod(shape)
  rows = a.size // size if size else 0
  # HIGHEST: exact float32 products on GPU and TPU too, whose default would round a float32
  # gradient to TF32 or bfloat16 before summing (no cost on CPU).
  total = jnp.dot(
    jnp.ones((rows,), a.dtype),
    a.reshape(rows, size),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  return total.reshape(shape).astype(dtype)


@jax.custom_vjp
def add_bias(x: jax.Array, bias: jax.Array) -> jax.Array:
  """`x + bias` for `x` `[..., *bias.shape]` and `bias` of `x`'s dtype, broadcast over the leading
  axes; the bias gradient is `token_sum` of the output gradient."""
  return x + bias


def _add_bias_fwd(x, bias):
  return x + bias, bias  # (residuals are arrays: the bias stands for its shape and dtype)


def _add_bias_bwd(bias, g):
  return g, token_sum(g, bias.shape, bias.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


@jax.custom_vjp
def scale_shift(y: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
  """`y * scale + bias` for float32 `y` `[..., d]` and `scale`, `bias` `[d]` (a norm's affine
  part, float32 out); their gradients are `token_sum`s, `y`'s is `g * scale`."""
  return y * scale + bias


def _scale_shift_fwd(y, scale, bias):
  return y * scale + bias, (y, scale, bias)


def _scale_shift_bwd(residuals, g):
  y, scale, bias = residuals
  return (g * scale).astype(y.dtype), token_sum(g * y, scale.shape, scale.dtype), token_sum(g, bias.shape, bias.dtype)


scale_shift.defvjp(_scale_shift_fwd, _scale_shift_bwd)


@jax.custom_vjp
def scale_only(y: jax.Array, scale: jax.Array) -> jax.Array:
  """`y * scale` for float32 `y` `[..., d]` and `scale` `[d]` (RMSNorm's gain); `scale`'s
  gradient is a `token_sum`."""
  return y * scale


def _scale_only_fwd(y, scale):
  return y * scale, (y, scale)


def _scale_only_bwd(residuals, g):
  y, scale = residuals
  return (g * scale).astype(y.dtype), token_sum(g * y, scale.shape, scale.dtype)


scale_only.defvjp(_scale_only_fwd, _scale_only_bwd)
