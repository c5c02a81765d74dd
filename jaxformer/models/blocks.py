"""Encoder and decoder blocks (paper section 3.1): sublayer -> dropout -> residual -> norm
(post-LN, as in the paper) or norm -> sublayer -> dropout -> residual (pre-LN).

The norm (`model.norm`), FFN (`model.ffn`; a mixture of experts with `model.num_experts`) and
attention options come from the config.
RoPE / ALiBi / T5 act in self-attention only (cross-attention has no position bias); causal
masking, the sliding window and its global tokens act in causal self-attention only;
Linformer replaces non-causal self-attention only (the encoder's). With `model.position=t5`
the blocks get their stack's bias table `[relative_buckets, num_heads]` as `bias_table`
(one table per stack, shared by its layers); None otherwise.

With `config.scan_layers` a block is the body of `nn.scan` and returns `(output, None)`
(the scan carry and no per-layer output) instead of the output alone.

Dropout: the last argument, `rng`, is the layer's dropout key (see `models.layout.layer_rngs`);
each dropout site of the block draws from `fold_in(rng, site)` with a fixed site number, so
the masks are the same whether the stack is unrolled or scanned. None (deterministic, or a
block called on its own) draws from the module's "dropout" stream instead.

Packed rows (several examples per row) pass segment ids, int `[batch, length]` (1, 2, ...
per example, 0 on padding: attention stays inside a segment), and per-segment positions
for self-attention, int `[batch, length]` (RoPE / ALiBi / causal and window masks). They
are positional arguments after `decode` (None = unpacked), so `nn.remat`'s static argnums
and `nn.scan`'s broadcast arguments treat them like the masks.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.config import ModelConfig
from jaxformer.layers.attention import MultiHeadAttention
from jaxformer.layers.dropout import Dropout
from jaxformer.layers.feed_forward import FeedForward
from jaxformer.layers.kv_cache import CacheState
from jaxformer.layers.lora import lora_spec
from jaxformer.layers.moe import MixtureOfExperts
from jaxformer.layers.norm import make_norm
from jaxformer.layers.positions import RopeScaling

BLOCK_AXES = (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_EMBED)


class Residual(nn.Module):
  """One residual sublayer with its norm and dropout; `fn` maps normalized x to the update."""

  config: ModelConfig

  @nn.compact
  def __call__(
    self, x: jax.Array, fn: Callable[[jax.Array], jax.Array], deterministic: bool, rng: jax.Array | None = None
  ) -> jax.Array:
    """`x + dropout(fn(norm(x)))` (pre-norm) or `norm(x + dropout(fn(x)))` (post-norm, the paper's);
    `[batch, length, d_model]` -> same."""
    dtype = jnp.dtype(self.config.dtype)
    norm = make_norm(self.config.norm, dtype, name="norm", epsilon=self.config.norm_epsilon)
    drop = Dropout(self.config.dropout_rate)
    if self.config.pre_norm:
      return x + drop(fn(norm(x)), deterministic=deterministic, rng=rng)
    return norm(x + drop(fn(x), deterministic=deterministic, rng=rng))


def _site(rng: jax.Array | None, site: int) -> jax.Array | None:
  """The key of dropout site number `site` of a block whose key is `rng` (None stays None)."""
  return None if rng is None else jax.random.fold_in(rng, site)


def _attention(config: ModelConfig, name: str, is_cross: bool = False, causal: bool = False):
  implementation = config.attention
  if implementation == "linformer" and (causal or is_cross):
    implementation = "dense"  # Linformer is non-causal self-attention; the decoder stays dense
  rope = RopeScaling(
    config.rope_scaling,
    config.rope_scaling_factor,
    config.rope_trained_length or round(config.max_length / config.rope_scaling_factor),
    config.rope_theta,
    config.rope_low_freq_factor,
    config.rope_high_freq_factor,
  )
  return MultiHeadAttention(
    num_heads=config.num_heads,
    head_dim=config.head_dim,
    dropout_rate=config.attention_dropout_rate,
    dtype=jnp.dtype(config.dtype),
    is_cross=is_cross,
    num_kv_heads=config.kv_heads,
    causal=causal,
    sliding_window=config.sliding_window if causal else 0,
    position=config.position,
    softcap=config.attn_logit_softcap,
    implementation=implementation,
    block_size=config.attention_block_size,
    global_tokens=config.global_tokens,
    rope_scaling=rope,
    relative_buckets=config.relative_buckets,
    relative_max_distance=config.relative_max_distance,
    linformer_k=config.linformer_k,
    max_length=config.max_length,
    bias=config.attention_bias,
    lora=lora_spec(config),
    name=name,
  )


def _ffn(config: ModelConfig, valid: jax.Array | None) -> Callable[[jax.Array], jax.Array]:
  """The block's FFN, or with `model.num_experts` its mixture of experts, which routes only the
  real tokens (`valid`)."""
  dtype = jnp.dtype(config.dtype)
  if not config.num_experts:
    return FeedForward(
      config.d_ff, dtype=dtype, activation=config.ffn, use_bias=config.mlp_bias, lora=lora_spec(config), name="ffn"
    )
  moe = MixtureOfExperts(
    config.num_experts,
    config.experts_per_token,
    config.d_ff,
    config.expert_capacity_factor,
    dtype,
    config.ffn,
    name="ffn",
  )
  return lambda h: moe(h, valid)


def _block_output(config: ModelConfig, x: jax.Array):
  x = sh.constrain(x, BLOCK_AXES)
  return (x, None) if config.scan_layers else x


class EncoderBlock(nn.Module):
  """Self-attention + FFN. `[batch, length, d_model]` -> same; `valid` bool `[batch, length]`
  marks real (non-padding) tokens, or None; `segment_ids` and `positions` int
  `[batch, length]` describe packed rows, or None; `rng` is the layer's dropout key or None.

  With `causal=True` this is also the decoder-only (GPT) block: causal self-attention with
  the sliding window, and `decode=True` uses its KV cache as `cache_state` describes.
  """

  config: ModelConfig
  causal: bool = False
  STATIC_ARGNUMS = (3, 4)  # `deterministic`, `decode` (self is 0), for nn.remat
  ROW_ARGNUMS = (2, 5, 6)  # `valid`, `segment_ids`, `positions`: per batch row (a pipeline carries them)

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    valid: jax.Array | None,
    deterministic: bool,
    decode: bool = False,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    cache_state: CacheState | None = None,
    bias_table: jax.Array | None = None,
    rng: jax.Array | None = None,
  ) -> jax.Array:
    """One block over `x` `[batch, length, d_model]`; see the class docstring for the arguments."""
    attn = _attention(self.config, "self_attention", causal=self.causal)
    ffn = _ffn(self.config, valid)
    x = Residual(self.config, name="attention_sublayer")(
      x,
      lambda h: attn(
        h,
        None,
        valid,
        deterministic=deterministic,
        decode=decode,
        q_segment_ids=segment_ids,
        positions=positions,
        dropout_rng=_site(rng, 0),
        cache_state=cache_state,
        bias_table=bias_table,
      ),
      deterministic,
      _site(rng, 1),
    )
    x = Residual(self.config, name="ffn_sublayer")(x, ffn, deterministic, _site(rng, 2))
    return _block_output(self.config, x)


class DecoderBlock(nn.Module):
  """Masked self-attention + cross-attention over the encoder output + FFN.

  `y` `[batch, tgt_len, d_model]`; `encoded` `[batch, src_len, d_model]` (None at decode
  steps after prefill); `tgt_valid` bool `[batch, tgt_len]` and `src_valid` bool
  `[batch, src_len]` mark real tokens (None = all). Self-attention is causal.
  Packed rows: `tgt_segment_ids` int `[batch, tgt_len]` and `src_segment_ids` int
  `[batch, src_len]` (target segment k attends to source segment k only) and the targets'
  per-segment `positions` int `[batch, tgt_len]`; None = unpacked. `cache_state`: the KV
  cache's rows when `decode` (`layers.kv_cache.CacheState`). `rng`: the layer's dropout key or None.
  """

  config: ModelConfig
  STATIC_ARGNUMS = (5, 6)  # `deterministic`, `decode` (self is 0), for nn.remat
  ROW_ARGNUMS = (2, 3, 4, 7, 8, 9)  # `encoded`, the masks, segment ids, `positions`: per batch row

  @nn.compact
  def __call__(
    self,
    y,
    encoded,
    tgt_valid,
    src_valid,
    deterministic: bool,
    decode: bool = False,
    tgt_segment_ids=None,
    src_segment_ids=None,
    positions=None,
    cache_state=None,
    bias_table=None,
    rng=None,
  ):
    """One block over `y` `[batch, tgt_len, d_model]`; see the class docstring for the arguments."""
    cfg = self.config
    self_attn = _attention(cfg, "self_attention", causal=True)
    cross_attn = _attention(cfg, "cross_attention", is_cross=True)
    ffn = _ffn(cfg, tgt_valid)
    y = Residual(cfg, name="self_attention_sublayer")(
      y,
      lambda h: self_attn(
        h,
        None,
        tgt_valid,
        deterministic=deterministic,
        decode=decode,
        q_segment_ids=tgt_segment_ids,
        positions=positions,
        dropout_rng=_site(rng, 0),
        cache_state=cache_state,
        bias_table=bias_table,
      ),
      deterministic,
      _site(rng, 1),
    )
    y = Residual(cfg, name="cross_attention_sublayer")(
      y,
      lambda h: cross_attn(
        h,
        encoded,
        tgt_valid,
        src_valid,
        deterministic=deterministic,
        decode=decode,
        q_segment_ids=tgt_segment_ids,
        kv_segment_ids=src_segment_ids,
        dropout_rng=_site(rng, 2),
        cache_state=cache_state,
      ),
      deterministic,
      _site(rng, 3),
    )
    y = Residual(cfg, name="ffn_sublayer")(y, ffn, deterministic, _site(rng, 4))
    return _block_output(cfg, y)
