"""Scaled dot-product attention as functions (paper section 3.2.1, eq. 1): the dense form,
softmax(q k^T / sqrt(head_dim) + bias) v with the softmax in float32, split into its weights and
their weighted sum; the fused form through `jax.nn.dot_product_attention`; and `attention`, which
runs the dense, blockwise (`layers.blockwise`), splash (`layers.splash`) or fused implementation
that `AttentionOptions` names. `layers.attention.MultiHeadAttention` projects into and out of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.layers.blockwise import blockwise_attention
from jaxformer.layers.context_parallel import gather_length
from jaxformer.layers.dropout import dropout
from jaxformer.layers.scores import attention_mask, attention_scores, repeat_kv


def dot_product_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array | None,
  dropout_rng: jax.Array | None = None,
  dropout_rate: float = 0.0,
  *,
  bias: jax.Array | None = None,
  softcap: float = 0.0,
) -> jax.Array:
  """softmax(q k^T / sqrt(head_dim) + bias) v, softmax in float32 (paper eq. 1).

  Args:
    q: `[batch, q_len, num_heads, head_dim]`.
    k, v: `[batch, kv_len, num_kv_heads, head_dim]`, num_kv_heads dividing num_heads.
    mask: bool, broadcastable to `[batch, num_heads, q_len, kv_len]`, or None.
    dropout_rng: key for dropout on the attention weights; None disables it.
    bias, softcap: see `scores.attention_scores`.

  Returns:
    `[batch, q_len, num_heads, head_dim]` in q's dtype.
  """
  return attend(attention_weights(q, k, mask, bias=bias, softcap=softcap), v, dropout_rng, dropout_rate)


def attention_weights(
  q: jax.Array, k: jax.Array, mask: jax.Array | None, *, bias: jax.Array | None = None, softcap: float = 0.0
) -> jax.Array:
  """softmax(q k^T / sqrt(head_dim) + bias) over the keys: float32 `[batch, num_heads, q_len, kv_len]`,
  each row summing to 1 (shapes and arguments as in `dot_product_attention`)."""
  return jax.nn.softmax(attention_scores(q, k, bias, mask, softcap), axis=-1)


def attend(
  weights: jax.Array, v: jax.Array, dropout_rng: jax.Array | None = None, dropout_rate: float = 0.0
) -> jax.Array:
  """The weighted sum of values: `weights` `[batch, num_heads, q_len, kv_len]` (dropped out when
  `dropout_rng` is a key) times `v` `[batch, kv_len, num_kv_heads, head_dim]` ->
  `[batch, q_len, num_heads, head_dim]` in v's dtype."""
  if dropout_rng is not None and dropout_rate > 0.0:
    weights = dropout(weights, dropout_rate, dropout_rng)  # rows (b, n, t), columns s
  return jnp.einsum("bnts,bsnh->btnh", weights.astype(v.dtype), repeat_kv(v, weights.shape[1]))


def fused_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array | None,
  *,
  bias: jax.Array | None = None,
  is_causal: bool = False,
) -> jax.Array:
  """`dot_product_attention` (no dropout, no soft-cap) through `jax.nn.dot_product_attention`.

  On a GPU with bfloat16/float16 inputs it asks for cuDNN's fused flash attention
  (`implementation="cudnn"`: JAX's default, None, still means XLA); elsewhere (CPU, TPU,
  float32) JAX's XLA implementation, which keeps the logits and softmax in float32 and gives
  masked logits a large finite negative value, as ours does. Grouped-query heads go in as they
  are. Shapes as `dot_product_attention`; `bias` float broadcastable to
  `[batch, num_heads, q_len, kv_len]`; `is_causal` may be set only when the mask already holds the
  causal mask by token index (it lets cuDNN skip the masked blocks).
  """
  cudnn = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
  if cudnn and bias is not None:
    bias = bias.astype(q.dtype)  # cuDNN takes the bias in the inputs' dtype
  return jax.nn.dot_product_attention(
    q, k, v, bias=bias, mask=mask, is_causal=is_causal, implementation="cudnn" if cudnn else None
  )


class AttentionOptions(NamedTuple):
  """How `attention` attends (static): the implementation, masks, soft-cap, block size, bias function,
  whether the mask is causal by token index (`fused_attention`'s hint) and the dropout rate."""

  implementation: str
  causal: bool
  sliding_window: int
  global_tokens: int
  softcap: float
  block_size: int
  bias_fn: Callable | None
  causal_by_index: bool
  dropout_rate: float


def attention(opts: AttentionOptions, arrays, bias_params, gather_axes: tuple[str, ...] = (), dropout_rng=None):
  """(output `[B, T, N, H]`, dense weights float32 `[B, N, T, S]` or None) of dense, blockwise or fused
  attention; `arrays` = (q, k, v, q_pos, kv_pos, q_valid, kv_valid, q_segment_ids, kv_segment_ids) as in
  `blockwise_attention`. `gather_axes`: the keys' side is this device's shard of a sequence split over
  these mesh axes (inside `context_parallel.over_length`), gathered before attending."""
  q, k, v, q_pos, kv_pos, q_valid, kv_valid, q_seg, kv_seg = arrays
  if opts.implementation == "blockwise":
    bias = (opts.bias_fn, bias_params) if opts.bias_fn is not None else None
    return blockwise_attention(
      q,
      k,
      v,
      q_positions=q_pos,
      kv_positions=kv_pos,
      q_valid=q_valid,
      kv_valid=kv_valid,
      causal=opts.causal,
      sliding_window=opts.sliding_window,
      position_bias=bias,
      softcap=opts.softcap,
      block_size=opts.block_size,
      q_segment_ids=q_seg,
      kv_segment_ids=kv_seg,
      global_tokens=opts.global_tokens,
      gather_axes=gather_axes,
    ), None
  if opts.implementation == "splash":
    # Imported here: the Pallas TPU kernels cost every process 0.3 s to import; only splash models need them.
    from jaxformer.layers.splash import splash_attention

    return splash_attention(
      q,
      k,
      v,
      q_valid,
      kv_valid,
      q_seg,
      kv_seg,
      causal=opts.causal,
      softcap=opts.softcap,
      sliding_window=opts.sliding_window,
      block_size=opts.block_size,
      gather_axes=gather_axes,
    ), None
  k, v, kv_pos, kv_valid, kv_seg = (gather_length(x, gather_axes) for x in (k, v, kv_pos, kv_valid, kv_seg))
  mask = attention_mask(
    q_pos, kv_pos, q_valid, kv_valid, opts.causal, opts.sliding_window, q_seg, kv_seg, opts.global_tokens
  )
  bias = opts.bias_fn(bias_params, q_pos, kv_pos) if opts.bias_fn is not None else None
  if opts.implementation == "fused":
    return fused_attention(q, k, v, mask, bias=bias, is_causal=opts.causal_by_index and not gather_axes), None
  weights = attention_weights(q, k, mask, bias=bias, softcap=opts.softcap)  # [B, N, T, S]
  return attend(weights, v, dropout_rng, opts.dropout_rate), weights
