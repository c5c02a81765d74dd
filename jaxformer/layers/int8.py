"""Int8 kernels in the layers: `QuantizedArray` (int8 values, float32 per-output-channel scales)
and the products and row lookups the layers run on one.

A product with a quantized kernel quantizes its activations as well, one scale per row
(dynamic, absmax / 127), multiplies int8 by int8 with int32 accumulation (exact, so the result
does not depend on the order of the sums) and scales each int32 result by its row's scale
times its channel's scale. XLA:CPU runs that int8 dot about twice as fast as the float32
product at 8-32 rows of a decode step; dequantizing the kernel first runs at float32's speed
(benchmarks/results/2026-12-03-int8-decoding.md). `inference.quantize` builds the kernels; the
layers take either a float array or a `QuantizedArray` for each kernel listed in
`inference.quantize.INT8_MATMUL`.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

INT8_MAX = 127


@flax.struct.dataclass
class QuantizedArray:
  """A kernel stored as int8 values and float32 per-output-channel scales (a pytree node).

  Attributes:
    values: int8, the kernel's shape, in [-127, 127].
    scale: float32, the kernel's shape with the contracted (input) axes of size 1, e.g.
      `[1, heads, head_dim]` for a `[d_model, heads, head_dim]` projection, `[layers, 1, d_ff]`
      for stacked `[layers, d_model, d_ff]` kernels, `[vocab, 1]` for an embedding table.
  """

  values: jax.Array
  scale: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    """The kernel's shape (its values')."""
    return self.values.shape

  def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
    """`values * scale` (computed in float32) as `dtype`, the kernel's shape."""
    return (self.values.astype(jnp.float32) * self.scale).astype(dtype)


def is_quantized(x: Any) -> bool:
  """Whether `x` is a `QuantizedArray` (an `is_leaf` for tree maps that stop at one)."""
  return isinstance(x, QuantizedArray)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 quantization of float `[rows, k]` activations, one scale per row: (int8
  `[rows, k]` `round(x / scale)`, float32 `[rows, 1]` scale = max |row| / 127; an all-zero row
  gets scale 0 and values 0)."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=1, keepdims=True) / INT8_MAX
  values = jnp.round(x / jnp.where(scale > 0, scale, 1.0)).astype(jnp.int8)  # |x / scale| <= 127
  return values, scale


def _int8_dot(x: jax.Array, w: jax.Array, contract_w: int) -> jax.Array:
  """int32 product of int8 `x` `[rows, k]` and int8 `w` contracted on its axis `contract_w` (of 2)."""
  return jax.lax.dot_general(x, w, (((1,), (contract_w,)), ((), ())), preferred_element_type=jnp.int32)


def matmul(x: jax.Array, w: QuantizedArray, in_axes: int = 1, dtype: Any = jnp.float32) -> jax.Array:
  """`x` times a quantized kernel whose first `in_axes` axes are its input: float `[rows, k]`
  x `[*in, *out]` (prod(in) = k, scales `[1, ..., *out]`) -> `[rows, prod(out)]` in `dtype`.
  The activations are quantized per row (module docstring)."""
  values = w.values.reshape(math.prod(w.shape[:in_axes]), -1)  # [k, out]
  xq, x_scale = quantize_rows(x)
  acc = _int8_dot(xq, values, 0)  # [rows, out]
  return (acc.astype(jnp.float32) * (x_scale * w.scale.reshape(1, -1))).astype(dtype)


def matmul_rows(x: jax.Array, table: QuantizedArray, dtype: Any = jnp.float32) -> jax.Array:
  """`x` times the transpose of a quantized table scaled per row: float `[rows, d]` and
  `[n, d]` (scales `[n, 1]`) -> `[rows, n]` in `dtype` (the tied output layer's logits)."""
  xq, x_scale = quantize_rows(x)
  acc = _int8_dot(xq, table.values, 1)  # [rows, n]
  return (acc.astype(jnp.float32) * (x_scale * table.scale.reshape(1, -1))).astype(dtype)


def take_rows(table: jax.Array | QuantizedArray, ids: jax.Array, **kwargs) -> jax.Array:
  """`jnp.take(table, ids, axis=0, **kwargs)` of a float table or, dequantized (float32), of a
  quantized one scaled per row (`[n, d]`, scales `[n, 1]`): `[*ids.shape, d]`."""
  if not is_quantized(table):
    return jnp.take(table, ids, axis=0, **kwargs)
  values = jnp.take(table.values, ids, axis=0, **kwargs)
  return values.astype(jnp.float32) * jnp.take(table.scale, ids, axis=0, **kwargs)
