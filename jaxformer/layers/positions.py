"""Position schemes beyond the paper's sinusoids: learned absolute embeddings (GPT/BERT),
rotary embeddings (RoPE, Su et al. 2021) with context-extension scalings, linear attention
biases (ALiBi, Press et al. 2022) and T5's bucketed relative position bias (Raffel et al. 2020).

Learned positions are added to the token embeddings; RoPE rotates queries and keys, and
ALiBi and T5 add a bias to the attention scores, all inside self-attention only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import sharding as sh
from jaxformer.layers import int8


class LearnedPositions(nn.Module):
  """A trained table `[offset + max_length, d_model]`; maps int `[batch, length]` positions to
  `[batch, length, d_model]` vectors in `dtype`: position p reads row `p + offset` (RoBERTa
  numbers its first token `pad_id + 1`; its rows before that hold padding's position). Positions
  must be < max_length."""

  max_length: int
  d_model: int
  dtype: jnp.dtype = jnp.float32
  offset: int = 0

  @nn.compact
  def __call__(self, positions: jax.Array) -> jax.Array:
    """int `[batch, length]` positions -> `[batch, length, d_model]` table rows in `dtype`."""
    table = sh.param(
      self, "embedding", nn.initializers.normal(0.02), (None, sh.EMBED), (self.offset + self.max_length, self.d_model)
    )
    return int8.take_rows(table, positions + self.offset).astype(self.dtype)  # float or int8 (decoding)


# A score bias and its params: (alibi_bias, slopes `[heads]`) or (a T5Bias, its table
# `[num_buckets, heads]`). The function is static (hashable), the params are an array;
# called as fn(params, q_positions `[batch, T]`, kv_positions `[batch, S]`) -> `[batch, heads, T, S]`.
PositionBias = tuple[Callable[[jax.Array, jax.Array, jax.Array], jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE's base and how its frequencies are rescaled to run past the trained context.

  The kinds are those transformers defines for Llama, Mistral and Qwen2 (`rope_type`), computed
  as it does, so imported models rotate as they were trained:

  Attributes:
    kind: none | linear (position interpolation, Chen et al. 2023: frequencies / factor) | ntk
      (static "NTK-aware" base change, base * factor^(d/(d-2)), bloc97 2023) | dynamic (the same
      base change computed from the sequence length L' > L: base * (s L'/L - (s - 1))^(d/(d-2)),
      nothing within the trained context) | yarn (Peng et al. 2023: frequencies interpolated by a
      ramp over the dimension index, between the dimensions that turn `beta_fast` and `beta_slow`
      times over L, rounded outward, plus the attention factor 0.1 ln(s) + 1) | llama3 (Llama 3.1:
      wavelengths longer than L / low_freq_factor divided by s, shorter than L / high_freq_factor
      kept, a smooth ramp between).
    factor: s >= 1, the extended context over the trained one.
    original_length: the trained context L, tokens (dynamic, yarn, llama3); 0 = unused.
    base: the base of the frequencies, `rope_theta` (10000 in the RoPE paper, 500000 in Llama 3).
    low_freq_factor, high_freq_factor: llama3's wavelength bounds (1 and 4 in Llama 3.1).
  """

  kind: str = "none"
  factor: float = 1.0
  original_length: int = 0
  base: float = 10000.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0


# YaRN's ramp bounds (Peng et al. 2023, section 3.2: alpha = 1, beta = 32 for LLaMA), in
# rotations of a frequency over the trained context.
YARN_ALPHA, YARN_BETA = 1.0, 32.0


def _yarn_ramp(half: int, base: float, length: int) -> np.ndarray:
  """Weight of the interpolated frequency per dimension pair, float32 `[half]`: 0 up to the pair that
  turns YARN_BETA times over `length` tokens (rounded down), 1 from the one that turns YARN_ALPHA
  times (rounded up), linear in the pair index between."""

  def pair(rotations):  # the (fractional) pair index i whose frequency base^(-i/half) turns `rotations` times
    return half * math.log(length / (rotations * 2 * math.pi)) / math.log(base)

  low, high = max(math.floor(pair(YARN_BETA)), 0), min(math.ceil(pair(YARN_ALPHA)), 2 * half - 1)
  high = high + 0.001 if high == low else high
  return np.clip((np.arange(half, dtype=np.float32) - low) / (high - low), 0.0, 1.0)


def rope_frequencies(head_dim: int, scaling: RopeScaling = RopeScaling()) -> tuple[np.ndarray, float]:
  """RoPE's angular frequencies theta_i = base^(-2i/head_dim), float32 `[head_dim/2]` (radians
  per token), after `scaling` (any kind but dynamic, which depends on the length: see
  `dynamic_base`), and the factor q and k are each multiplied by (1 but for yarn, whose
  sqrt(1/t) = 0.1 ln(s) + 1 sharpens the softmax, YaRN eq. 22)."""
  half = head_dim // 2
  s, base = float(scaling.factor), float(scaling.base)
  if scaling.kind == "ntk":
    base = base * s ** (head_dim / (head_dim - 2))
  theta = base ** (-np.arange(half, dtype=np.float32) / half)  # float32 as before scaling existed: same bits
  mscale = 1.0
  if scaling.kind == "linear":
    theta = theta / s
  elif scaling.kind == "yarn":
    ramp = _yarn_ramp(half, base, scaling.original_length)
    theta = (theta / s) * ramp + theta * (1 - ramp)  # slow frequencies interpolate, fast keep
    mscale = 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
  elif scaling.kind == "llama3":
    wavelength = 2 * np.pi / theta
    length = scaling.original_length
    smooth = (length / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    theta = np.where(
      wavelength > length / scaling.low_freq_factor,
      theta / s,
      np.where(wavelength < length / scaling.high_freq_factor, theta, (1 - smooth) * theta / s + smooth * theta),
    )
  return theta.astype(np.float32), mscale


def dynamic_base(scaling: RopeScaling, head_dim: int, positions: jax.Array) -> jax.Array:
  """Dynamic NTK scaling's base for each row of int `[batch, length]` `positions`: float32 `[batch]`,
  from the row's largest position (L' = max + 1), `scaling.base` while L' stays within the trained
  context L. Per row, so a sequence's values never depend on its batch-mates (transformers takes
  the batch's largest; equal for one sequence)."""
  length = jnp.maximum(jnp.max(positions, axis=-1).astype(jnp.float32) + 1, scaling.original_length)
  s = scaling.factor
  return scaling.base * (s * length / scaling.original_length - (s - 1)) ** (head_dim / (head_dim - 2))


def apply_rope(x: jax.Array, positions: jax.Array, scaling: RopeScaling = RopeScaling()) -> jax.Array:
  """Rotates each head vector by position-dependent angles (RoPE, Su et al. 2021, eq. 34).

  Dimension pair (i, i + head_dim/2) is rotated by the angle positions * theta_i
  (`rope_frequencies`: base^(-2i/head_dim) unless `scaling` changes it), so the score
  q(m) . k(n) depends on m - n only. This pairing is Llama's `rotate_half` convention.

  Args:
    x: `[batch, length, heads, head_dim]` queries or keys; head_dim must be even.
    positions: int `[batch, length]` absolute token positions.
    scaling: the base and context-extension scaling of the frequencies (`RopeScaling`).

  Returns:
    `[batch, length, heads, head_dim]` in x's dtype (the rotation is computed in float32).

  Raises:
    ValueError: odd head_dim.
  """
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"rope needs an even head_dim, got {head_dim}")
  if scaling.kind == "dynamic":
    exponents = jnp.arange(head_dim // 2, dtype=jnp.float32) / (head_dim // 2)
    base = dynamic_base(scaling, head_dim, positions)[:, None, None, None]  # [B, 1, 1, 1]
    inv_freq, mscale = base**-exponents, 1.0  # [B, 1, 1, H/2]
  else:
    inv_freq, mscale = rope_frequencies(head_dim, scaling)  # [H/2]
  angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, H/2]
  cos, sin = jnp.cos(angles) * mscale, jnp.sin(angles) * mscale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, N, H/2] each
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
  slopes = power_of_two(p) + power_of_two(2 * p)[0::2][: num_heads - p]
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


def t5_buckets(relative: jax.Array, bidirectional: bool, num_buckets: int, max_distance: int) -> jax.Array:
  """T5's relative position buckets (Raffel et al. 2020, section 2.1), int32, shape of `relative`.

  `relative` = key position - query position. Half the buckets (all when causal) hold exact
  distances 0..n/2-1; the rest cover distances up to `max_distance` logarithmically, and
  farther ones share the last bucket. Bidirectional: buckets [0, n/2) for keys at or before
  the query, [n/2, n) for keys after it; causal: future keys fall in bucket 0 (masked anyway).
  """
  n = num_buckets
  offset = jnp.zeros_like(relative)
  if bidirectional:
    n //= 2
    offset = jnp.where(relative > 0, n, 0)
    distance = jnp.abs(relative)
  else:
    distance = jnp.maximum(-relative, 0)
  exact = n // 2
  # log-spaced buckets from `exact` up to max_distance (distance >= exact here; 1 guards the log)
  ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact) / math.log(max_distance / exact)
  far = jnp.minimum(exact + (ratio * (n - exact)).astype(jnp.int32), n - 1)
  return (offset + jnp.where(distance < exact, distance, far)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class T5Bias:
  """T5 bias settings: `num_buckets`, `max_distance` (tokens) and `bidirectional` (encoder) or causal."""

  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True

  def __call__(self, table: jax.Array, q_positions: jax.Array, kv_positions: jax.Array) -> jax.Array:
    """Score bias float32 `[batch, heads, T, S]` from the learned `table` `[num_buckets, heads]`
    for int positions `[batch, T]` / `[batch, S]` (batch may be 1)."""
    relative = kv_positions[:, None, :] - q_positions[:, :, None]  # [B, T, S]
    buckets = t5_buckets(relative, self.bidirectional, self.num_buckets, self.max_distance)
    return jnp.moveaxis(jnp.take(table.astype(jnp.float32), buckets, axis=0), -1, 1)  # [B, N, T, S]


def t5_table(module: nn.Module, name: str, num_buckets: int, num_heads: int) -> jax.Array:
  """A stack's learned T5 bias table `[num_buckets, num_heads]` (float32, heads on the tensor
  axis), a param `name` of `module`; every layer of the stack reads the same table."""
  return sh.param(module, name, nn.initializers.normal(0.02), (None, sh.HEADS), (num_buckets, num_heads))
