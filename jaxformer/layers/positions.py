"""Position schemes beyond the paper's sinusoids: learned absolute embeddings (GPT/BERT),
rotary embeddings (RoPE, Su et al. 2021) and linear attention biases (ALiBi, Press et al. 2022).

Learned positions are added to the token embeddings; RoPE rotates queries and keys and
ALiBi adds a bias to the attention scores, both inside self-attention only.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import sharding as sh


class LearnedPositions(nn.Module):
  """A trained table `[max_length, d_model]`; maps int `[batch, length]` positions to
  `[batch, length, d_model]` vectors in `dtype`. Positions must be < max_length."""
  max_length: int
  d_model: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, positions: jax.Array) -> jax.Array:
    table = self.param("embedding", sh.param_with_axes(nn.initializers.normal(0.02), (None, sh.EMBED)),
                       (self.max_length, self.d_model))
    return jnp.take(table, positions, axis=0).astype(self.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotates each head vector by position-dependent angles (RoPE, Su et al. 2021, eq. 34).

  Dimension pair (i, i + head_dim/2) is rotated by the angle positions * base^(-2i/head_dim),
  so the score q(m) . k(n) depends on m - n only.

  Args:
    x: `[batch, length, heads, head_dim]` queries or keys; head_dim must be even.
    positions: int `[batch, length]` absolute token positions.
  Returns:
    `[batch, length, heads, head_dim]` in x's dtype (the rotation is computed in float32).
  """
  half = x.shape[-1] // 2
  if x.shape[-1] % 2:
    raise ValueError(f"rope needs an even head_dim, got {x.shape[-1]}")
  inv_freq = base ** (-np.arange(half, dtype=np.float32) / half)                    # [H/2]
  angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq                # [B, T, 1, H/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)                               # [B, T, N, H/2] each
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """Per-head ALiBi slopes, float32 `[num_heads]` (Press et al. 2022, section 3).

  For n heads with n a power of two: the geometric sequence starting at 2^(-8/n) with
  that ratio (8 heads: 1/2, 1/4, ..., 1/256). Otherwise the slopes of the next lower
  power of two p, followed by every other slope of 2p, as the paper's code does.
  """
  def power_of_two(n):
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]
  p = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = power_of_two(p) + power_of_two(2 * p)[0::2][:num_heads - p]
  return np.asarray(slopes, np.float32)


def alibi_bias(slopes: jax.Array, q_positions: jax.Array, kv_positions: jax.Array) -> jax.Array:
  """Score bias -slope * |query position - key position|, float32 `[batch, heads, T, S]`.

  For causal attention this is the paper's -m * (i - j); the absolute distance also
  gives a symmetric bias for bidirectional (encoder) self-attention.

  Args:
    slopes: float `[heads]` (see `alibi_slopes`).
    q_positions: int `[batch, T]`; kv_positions: int `[batch, S]`.
  """
  distance = jnp.abs(q_positions[:, :, None] - kv_positions[:, None, :]).astype(jnp.float32)  # [B, T, S]
  return -slopes.astype(jnp.float32)[None, :, None, None] * distance[:, None]
