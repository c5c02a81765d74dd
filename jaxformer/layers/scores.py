"""Attention scores and masks shared by dense and blockwise attention.

Masks are boolean, True where a query may attend to a key. Masked scores get a large
finite negative value (not -inf) so a fully masked row gives a uniform softmax rather
than NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e9  # fits float32/bfloat16; scores are float32 when masked


def position_mask(
  q_positions: jax.Array, kv_positions: jax.Array, causal: bool, sliding_window: int, global_tokens: int = 0
) -> jax.Array | None:
  """Causal / sliding-window mask on positions, bool `[batch, T, S]`, or None if unmasked.

  Args:
    q_positions: int `[batch, T]`; kv_positions: int `[batch, S]` (batch may be 1).
    causal: a query sees keys at positions <= its own.
    sliding_window: w > 0 limits each query to keys less than w positions away (with
      `causal`, the w most recent tokens including itself); 0 = no limit.
    global_tokens: G > 0 (with a window): positions < G are global (Longformer, Beltagy et al.
      2020, section 3.1): they see every key and every query sees them; the causal mask still
      applies on top.
  """
  if not (causal or sliding_window):
    return None
  mask = None
  offset = q_positions[:, :, None] - kv_positions[:, None, :]  # [B, T, S]
  if sliding_window:
    mask = jnp.abs(offset) < sliding_window
    if global_tokens:
      mask = mask | (q_positions[:, :, None] < global_tokens) | (kv_positions[:, None, :] < global_tokens)
  if causal:
    mask = offset >= 0 if mask is None else mask & (offset >= 0)
  return mask


def attention_mask(
  q_positions: jax.Array,
  kv_positions: jax.Array,
  q_valid: jax.Array | None,
  kv_valid: jax.Array | None,
  causal: bool,
  sliding_window: int,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  global_tokens: int = 0,
) -> jax.Array | None:
  """Padding, segment, causal, sliding-window and global-token mask, bool `[batch, 1, T, S]`,
  or None if unmasked.

  Args:
    q_positions: int `[batch, T]`; kv_positions: int `[batch, S]` (batch may be 1).
    q_valid, kv_valid: bool `[batch, T]` / `[batch, S]` padding validity, or None.
    causal, sliding_window, global_tokens: as in `position_mask`.
    q_segment_ids, kv_segment_ids: int `[batch, T]` / `[batch, S]` packed-example ids (1, 2,
      ... per example of a row, 0 on padding), both or neither: a query sees only keys of
      its own segment. None = one example per row.

  Raises:
    ValueError: only one of the segment ids given.
  """
  mask = None

  def conj(a, b):
    return b if a is None else a & b

  if q_valid is not None:
    mask = q_valid[:, None, :, None]
  if kv_valid is not None:
    mask = conj(mask, kv_valid[:, None, None, :])
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("attention_mask needs both q_segment_ids and kv_segment_ids, or neither")
  if q_segment_ids is not None:
    mask = conj(mask, q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
  positional = position_mask(q_positions, kv_positions, causal, sliding_window, global_tokens)
  if positional is not None:
    mask = conj(mask, positional[:, None])
  return mask


def attention_scores(
  q: jax.Array, k: jax.Array, bias: jax.Array | None, mask: jax.Array | None, softcap: float = 0.0
) -> jax.Array:
  """float32 scores `[batch, num_heads, T, S]` = mask(softcap(q k^T / sqrt(head_dim)) + bias).

  Args:
    q: `[batch, T, num_heads, head_dim]`; k: `[batch, S, num_kv_heads, head_dim]`,
      num_kv_heads dividing num_heads (grouped-query: see `repeat_kv`).
    bias: float, broadcastable to `[batch, num_heads, T, S]` (ALiBi, T5), or None.
    mask: bool, broadcastable to `[batch, num_heads, T, S]`, or None.
    softcap: c > 0 maps content scores to c * tanh(score / c) (Gemma 2), so they lie in
      (-c, c); applied before the position bias. 0 = off.
  """
  k = repeat_kv(k, q.shape[2])
  scale = q.shape[-1] ** -0.5
  scores = jnp.einsum("btnh,bsnh->bnts", q * jnp.asarray(scale, q.dtype), k).astype(jnp.float32)
  if softcap > 0:
    scores = softcap * jnp.tanh(scores / softcap)
  if bias is not None:
    scores = scores + bias
  if mask is not None:
    scores = jnp.where(mask, scores, NEG)
  return scores


def repeat_kv(x: jax.Array, num_heads: int) -> jax.Array:
  """Grouped-query attention: `[batch, S, num_kv_heads, head_dim]` -> `[batch, S, num_heads, head_dim]`,
  key/value head j serving query heads j*G .. j*G + G - 1 (G = num_heads / num_kv_heads)."""
  if x.shape[2] == num_heads:
    return x
  return jnp.repeat(x, num_heads // x.shape[2], axis=2)
