"""Encoder and decoder blocks (paper section 3.1): sublayer -> dropout -> residual -> LayerNorm
(post-LN, as in the paper) or LayerNorm -> sublayer -> dropout -> residual (pre-LN)."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.config import ModelConfig
from jaxformer.layers.attention import MultiHeadAttention
from jaxformer.layers.feed_forward import FeedForward
from jaxformer.layers.norm import LayerNorm

BLOCK_AXES = (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_EMBED)


class Residual(nn.Module):
  """One residual sublayer with its LayerNorm and dropout; `fn` maps normalized x to the update."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, fn: Callable[[jax.Array], jax.Array], deterministic: bool) -> jax.Array:
    dtype = jnp.dtype(self.config.dtype)
    norm = LayerNorm(dtype=dtype, name="norm")
    drop = nn.Dropout(self.config.dropout_rate)
    if self.config.pre_norm:
      return x + drop(fn(norm(x)), deterministic=deterministic)
    return norm(x + drop(fn(x), deterministic=deterministic))


def _attention(config: ModelConfig, name: str, is_cross: bool = False, max_length: int = 0):
  return MultiHeadAttention(num_heads=config.num_heads, head_dim=config.head_dim,
                            dropout_rate=config.attention_dropout_rate, dtype=jnp.dtype(config.dtype),
                            is_cross=is_cross, max_length=max_length, name=name)


class EncoderBlock(nn.Module):
  """Self-attention + FFN. `[batch, src_len, d_model]` -> same; `mask` `[batch, 1, S, S]`.

  With a causal mask this is also the decoder-only (GPT) block; `decode=True` then uses
  the self-attention KV cache (`mask` None: the cache builds the causal mask).
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None, deterministic: bool, decode: bool = False) -> jax.Array:
    attn = _attention(self.config, "self_attention", max_length=self.config.max_length)
    ffn = FeedForward(self.config.d_ff, dtype=jnp.dtype(self.config.dtype), name="ffn")
    x = Residual(self.config, name="attention_sublayer")(
        x, lambda h: attn(h, None, mask, deterministic=deterministic, decode=decode), deterministic)
    x = Residual(self.config, name="ffn_sublayer")(x, ffn, deterministic)
    return sh.constrain(x, BLOCK_AXES)


class DecoderBlock(nn.Module):
  """Masked self-attention + cross-attention over the encoder output + FFN.

  `y` `[batch, tgt_len, d_model]`; `encoded` `[batch, src_len, d_model]` (None at decode
  steps after prefill); `self_mask` `[batch, 1, T, T]` (causal & padding) or None when
  decoding (the cache builds the causal mask); `cross_mask` `[batch, 1, T, S]`.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, y, encoded, self_mask, cross_mask, deterministic: bool, decode: bool = False):
    cfg = self.config
    self_attn = _attention(cfg, "self_attention", max_length=cfg.max_length)
    cross_attn = _attention(cfg, "cross_attention", is_cross=True)
    ffn = FeedForward(cfg.d_ff, dtype=jnp.dtype(cfg.dtype), name="ffn")
    y = Residual(cfg, name="self_attention_sublayer")(
        y, lambda h: self_attn(h, None, self_mask, deterministic=deterministic, decode=decode), deterministic)
    y = Residual(cfg, name="cross_attention_sublayer")(
        y, lambda h: cross_attn(h, encoded, cross_mask, deterministic=deterministic, decode=decode),
        deterministic)
    y = Residual(cfg, name="ffn_sublayer")(y, ffn, deterministic)
    return sh.constrain(y, BLOCK_AXES)
