"""Multi-head scaled dot-product attention (paper section 3.2) with masks and a KV cache.

Masks are boolean, True where a query may attend to a key, broadcastable to
`[batch, num_heads, q_length, kv_length]`. Masked logits get a large finite negative
value (not -inf) so a fully masked row gives a uniform softmax rather than NaN.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh

_NEG = -1e9  # fits float32/bfloat16; logits are float32 when masked


def padding_mask(q_valid: jax.Array, kv_valid: jax.Array) -> jax.Array:
  """bool `[batch, 1, q_len, kv_len]` from bool `[batch, q_len]` and `[batch, kv_len]` validity."""
  return q_valid[:, None, :, None] & kv_valid[:, None, None, :]


def causal_mask(length: int) -> jax.Array:
  """bool `[1, 1, length, length]`: query i may see keys j <= i."""
  return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                          dropout_rng: jax.Array | None = None, dropout_rate: float = 0.0) -> jax.Array:
  """softmax(q k^T / sqrt(head_dim)) v, softmax in float32 (paper eq. 1).

  Args:
    q: `[batch, q_len, num_heads, head_dim]`.
    k, v: `[batch, kv_len, num_heads, head_dim]`.
    mask: bool, broadcastable to `[batch, num_heads, q_len, kv_len]`, or None.
    dropout_rng: key for dropout on the attention weights; None disables it.
  Returns:
    `[batch, q_len, num_heads, head_dim]` in q's dtype.
  """
  scale = q.shape[-1] ** -0.5
  logits = jnp.einsum("btnh,bsnh->bnts", q * jnp.asarray(scale, q.dtype), k).astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, _NEG)
  weights = jax.nn.softmax(logits, axis=-1)
  if dropout_rng is not None and dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
    weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  return jnp.einsum("bnts,bsnh->btnh", weights.astype(v.dtype), v)


def _project(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """`[batch, length, d_model]` x `[d_model, num_heads, head_dim]` -> `[batch, length, num_heads, head_dim]`
  as one 2-D matmul (XLA's CPU backward pass of the 3-D einsum adds transposes)."""
  b, t, d = x.shape
  _, n, h = kernel.shape
  return (x.reshape(b * t, d) @ kernel.reshape(d, n * h)).reshape(b, t, n, h)


def _proj_init(in_axis, out_axis):
  # Xavier-uniform over the flattened fan-in / fan-out of a multi-axis kernel.
  return nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=in_axis, out_axis=out_axis)


class MultiHeadAttention(nn.Module):
  """Q/K/V projections `[d_model, num_heads, head_dim]` (column-split over heads on the
  tensor axis), attention, and the output projection `[num_heads, head_dim, d_model]`
  (row-split), so each tensor shard owns whole heads.

  Call with `x` `[batch, q_len, d_model]` and `kv` `[batch, kv_len, d_model]` (None for
  self-attention); returns `[batch, q_len, d_model]`.

  With `decode=True` the module keeps a cache collection:
    * self-attention: `cached_key`/`cached_value` `[batch, max_length, num_heads, head_dim]`
      and `cache_index`; each call writes its q_len new keys at `cache_index` (a prefill
      writes several, a decode step one) and attends to all filled slots up to itself.
    * cross-attention (`kv` given once at prefill, None afterwards): the projected
      encoder keys/values are computed once and reused at every decode step.
  """
  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32
  is_cross: bool = False
  max_length: int = 0  # decode cache size for self-attention, tokens

  def _kernel(self, name: str, shape, axes, in_axis, out_axis):
    return self.param(name, sh.param_with_axes(_proj_init(in_axis, out_axis), axes), shape).astype(self.dtype)

  @nn.compact
  def __call__(self, x: jax.Array, kv: jax.Array | None, mask: jax.Array | None, *,
               deterministic: bool, decode: bool = False) -> jax.Array:
    d_model = x.shape[-1]
    n, h = self.num_heads, self.head_dim
    in_axes = (sh.EMBED, sh.HEADS, sh.KV)
    wq = self._kernel("query", (d_model, n, h), in_axes, 0, (1, 2))
    wk = self._kernel("key", (d_model, n, h), in_axes, 0, (1, 2))
    wv = self._kernel("value", (d_model, n, h), in_axes, 0, (1, 2))
    wo = self._kernel("out", (n, h, d_model), (sh.HEADS, sh.KV, sh.EMBED), (0, 1), 2)
    head_axes = (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_HEADS, sh.ACT_KV)

    x = x.astype(self.dtype)
    q = sh.constrain(_project(x, wq), head_axes)  # [B, T, N, H]
    if self.is_cross:
      k, v = self._cross_kv(kv, wk, wv, decode)
    else:
      k, v = _project(x, wk), _project(x, wv)  # [B, S, N, H]
      if decode:
        k, v, mask = self._update_self_cache(k, v, mask)
    k, v = sh.constrain(k, head_axes), sh.constrain(v, head_axes)

    dropout_rng = None
    if not deterministic and self.dropout_rate > 0.0:
      dropout_rng = self.make_rng("dropout")
    out = dot_product_attention(q, k, v, mask, dropout_rng, self.dropout_rate)  # [B, T, N, H]
    b, t = out.shape[:2]
    return (out.reshape(b * t, n * h) @ wo.reshape(n * h, d_model)).reshape(b, t, d_model)

  def _cross_kv(self, kv, wk, wv, decode):
    if not decode:
      return jnp.einsum("bsd,dnh->bsnh", kv.astype(self.dtype), wk), jnp.einsum(
          "bsd,dnh->bsnh", kv.astype(self.dtype), wv)
    if kv is None:  # decode step: reuse the keys/values computed at prefill
      if not self.has_variable("cache", "cross_key"):
        raise ValueError("cross-attention decode step before prefill: pass the encoder output first")
      return self.get_variable("cache", "cross_key"), self.get_variable("cache", "cross_value")
    k = jnp.einsum("bsd,dnh->bsnh", kv.astype(self.dtype), wk)
    v = jnp.einsum("bsd,dnh->bsnh", kv.astype(self.dtype), wv)
    self.put_variable("cache", "cross_key", k)
    self.put_variable("cache", "cross_value", v)
    return k, v

  def _update_self_cache(self, k, v, mask):
    """Writes the new keys/values at `cache_index` and masks slots that are not yet filled
    or that lie after the query (causality); `mask` may add padding constraints."""
    batch, q_len, n, h = k.shape
    if self.max_length <= 0:
      raise ValueError("MultiHeadAttention(decode=True) needs max_length > 0 for its cache")
    cached_k = self.variable("cache", "cached_key", jnp.zeros, (batch, self.max_length, n, h), k.dtype)
    cached_v = self.variable("cache", "cached_value", jnp.zeros, (batch, self.max_length, n, h), v.dtype)
    index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    start = index.value
    cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k.astype(cached_k.value.dtype), (0, start, 0, 0))
    cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v.astype(cached_v.value.dtype), (0, start, 0, 0))
    index.value = start + q_len
    q_pos = start + jnp.arange(q_len)                              # [T]
    k_pos = jnp.arange(self.max_length)                            # [S_max]
    cache_mask = (k_pos[None, :] <= q_pos[:, None])[None, None]    # [1, 1, T, S_max]
    if mask is not None:
      cache_mask = cache_mask & mask
    return cached_k.value, cached_v.value, cache_mask
