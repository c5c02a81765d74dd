"""Multi-head scaled dot-product attention (paper section 3.2) with masks and a KV cache,
plus grouped-query heads, RoPE (with context-extension scaling) / ALiBi / T5 bias, score
soft-capping, sliding windows with global tokens, a memory-linear blockwise implementation, a
fused one (`jax.nn.dot_product_attention`) and Linformer's low-rank keys/values. The attention
functions themselves (dense, fused, and the dispatch over implementations) are in
`layers.dot_product`; this module projects into and out of them and keeps the cache.

Masks are boolean, True where a query may attend to a key, broadcastable to
`[batch, num_heads, q_length, kv_length]`. Masked logits get a large finite negative
value (not -inf) so a fully masked row gives a uniform softmax rather than NaN.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxformer import sharding as sh
from jaxformer.errors import ConfigError
from jaxformer.layers import dot_product as dp
from jaxformer.layers import int8, remat
from jaxformer.layers import kv_cache as kvc
from jaxformer.layers.context_parallel import context_axes, over_length
from jaxformer.layers.lora import LoraSpec, add_adapter
from jaxformer.layers.positions import RopeScaling, T5Bias, alibi_bias, alibi_slopes, apply_rope
from jaxformer.layers.token_sum import add_bias


def _project(x: jax.Array, w: jax.Array) -> jax.Array:
  """`[batch, length, d_model]` x `[d_model, num_heads, head_dim]` -> `[batch, length, num_heads, head_dim]`
  as one matmul over the flattened tokens: XLA:CPU runs the 2-D form's weight gradient
  without a transposed copy of the activations. `w` may be an int8 `QuantizedArray` (`layers.int8`)."""
  b, t, d = x.shape
  if int8.is_quantized(w):
    return int8.matmul(x.reshape(b * t, d), w, 1, x.dtype).reshape(b, t, *w.shape[1:])
  return jnp.einsum("md,dnh->mnh", x.reshape(b * t, d), w).reshape(b, t, *w.shape[1:])  # [B, T, N, H]


def _proj_init(in_axis, out_axis):
  # Xavier-uniform over the flattened fan-in / fan-out of a multi-axis kernel.
  return nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=in_axis, out_axis=out_axis)


class MultiHeadAttention(nn.Module):
  """Q projection `[d_model, num_heads, head_dim]`, K/V projections `[d_model, num_kv_heads,
  head_dim]` (column-split over heads on the tensor axis), attention, and the output
  projection `[num_heads, head_dim, d_model]` (row-split), so each tensor shard owns whole heads.

  Call with `x` `[batch, q_len, d_model]`, `kv` `[batch, kv_len, d_model]` (None for
  self-attention) and bool padding validity `q_valid` `[batch, q_len]` / `kv_valid`
  `[batch, kv_len]` (None = all valid; self-attention uses `q_valid` for its keys too);
  returns `[batch, q_len, d_model]`. `causal`, `sliding_window`, `global_tokens` and
  `position` (rope | alibi | t5; any other value adds nothing here) act in self-attention
  only: cross-attention has no position bias. With `position="t5"` the call gets the stack's
  learned table `bias_table` `[relative_buckets, num_heads]` (`positions.t5_table`); the
  buckets are bidirectional unless `causal`.

  `implementation="linformer"` (Wang et al. 2020, section 4) projects the keys and values
  along the sequence with learned `[max_length, linformer_k]` matrices E and F (shared by
  the heads) before attending, so scores are `[T, linformer_k]`: linear in the length.
  Padded keys are zeroed before the projection, so padding changes nothing.

  Packed rows (several examples in one row) pass int `q_segment_ids` `[batch, q_len]` and,
  for cross-attention, `kv_segment_ids` `[batch, kv_len]`: 1, 2, ... for the examples of
  a row, 0 on padding; a query attends only to keys with its own segment id
  (self-attention uses `q_segment_ids` for its keys too). Self-attention `positions`,
  int `[batch, q_len]` (restarting at 0 in each segment), drive RoPE, ALiBi, T5 and the
  causal / sliding-window / global-token masks; None = token indices 0..q_len-1. When decoding the
  positions are the cache slots and neither argument may be given. `dropout_rng` is the
  key of the attention-weight dropout (None: drawn from the "dropout" stream). Dense attention
  without the cache sows its weights, float32 `[batch, num_heads, q_len, kv_len]`, as
  `intermediates/attention_weights` when that collection is mutable (for plots).

  Context parallelism: traced under a mesh whose axes split `act_length` (`mesh.context` > 1)
  into parts that divide both lengths (`context_parallel.context_axes`), dense, blockwise and
  fused attention run per device on its shard of the queries over the all-gathered keys/values
  (`layers.context_parallel`), equal to unsplit attention; there dense attention neither sows
  its weights nor takes attention dropout. Linformer and the cached path are left to jit's
  automatic partitioning.

  With `decode=True` the module reads and writes the KV cache (`layers.kv_cache`): the
  "cache" collection holds this layer's `key`/`value` storage and `cache_state` says which
  rows hold how many tokens. Self-attention writes the new tokens' keys/values (RoPE-rotated)
  at positions `cache_state.lengths[b]`, ... (a prefill writes several, a decode step one;
  padding tokens are not written) and attends to the row's cached keys under the causal /
  sliding-window / global-token mask and position bias. Cross-attention (`kv`, the encoder
  output, given once at prefill, None afterwards) stores the projected encoder keys/values and
  reuses them at every step.

  `bias`: none (the paper's), qkv (biases on the query/key/value projections, Qwen2) or all (also
  on the output projection: GPT-2, BERT, Marian); params `query_bias` `[num_heads, head_dim]`,
  `key_bias`/`value_bias` `[num_kv_heads, head_dim]`, `out_bias` `[d_model]`.

  Raises:
    ValueError: blockwise or fused attention with dropout (any attention, with context parallelism),
      fused with a soft-cap; decode without `cache_state`; a cross-attention decode step before the
      prefill; decode with segment ids or positions; position t5 without `bias_table`.
    ConfigError: linformer attention that is causal, decodes with the cache, or gets segment ids.
  """

  num_heads: int
  head_dim: int
  dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32
  is_cross: bool = False
  num_kv_heads: int = 0  # grouped-query key/value heads; 0 = num_heads
  causal: bool = False
  sliding_window: int = 0  # tokens; 0 = unlimited
  position: str = "none"  # rope | alibi | t5 act here; sinusoidal / learned / none are added outside
  softcap: float = 0.0  # attention score soft-cap c (c * tanh(s / c)); 0 = off
  implementation: str = "dense"  # dense | blockwise | linformer | fused | splash (layers/splash.py)
  block_size: int = 128  # blockwise: keys per block
  global_tokens: int = 0  # with a sliding window: positions < G see and are seen by all
  rope_scaling: RopeScaling = RopeScaling()  # rope: context-extension scaling
  relative_buckets: int = 32  # t5: buckets of the bias table
  relative_max_distance: int = 128  # t5: distance of the last bucket, tokens
  linformer_k: int = 64  # linformer: projected key/value rows
  max_length: int = 0  # linformer: longest sequence (rows of E and F)
  bias: str = "none"  # none | qkv | all: which projections have biases
  lora: LoraSpec | None = None  # LoRA adapters beside the query/key/value/out kernels (layers/lora.py)

  def _kernel(self, name: str, shape, axes, in_axis, out_axis):
    w = sh.param(self, name, _proj_init(in_axis, out_axis), axes, shape)
    return w if int8.is_quantized(w) else w.astype(self.dtype)  # int8 kernels: decoding (`layers.int8`)

  def _heads(self, x: jax.Array, w: jax.Array, name: str) -> jax.Array:
    """`_project(x, w)` `[batch, length, heads, head_dim]` plus the `name` projection's LoRA update
    when `lora` targets it and its bias `[heads, head_dim]` when `bias` is qkv or all."""
    y = add_adapter(self, self.lora, name, name, x, _project(x, w), (sh.EMBED,), (sh.HEADS, sh.KV), self.dtype)
    if self.bias == "none":
      return y
    b = sh.param(self, f"{name}_bias", nn.initializers.zeros, (sh.HEADS, sh.KV), w.shape[1:])
    return add_bias(y, b.astype(self.dtype))

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    kv: jax.Array | None,
    q_valid: jax.Array | None = None,
    kv_valid: jax.Array | None = None,
    *,
    deterministic: bool,
    decode: bool = False,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
    cache_state: kvc.CacheState | None = None,
    bias_table: jax.Array | None = None,
  ) -> jax.Array:
    """Attention of `x` over `kv` (or itself); see the class docstring for the arguments.

    Returns:
      `[batch, q_len, d_model]` in `dtype`.

    Raises:
      ConfigError: linformer attention that is causal, cross or cached.
      ValueError: `decode=True` with segment ids or positions, or without `cache_state`.
    """
    if self.implementation == "linformer" and not self.is_cross and (self.causal or decode):
      raise ConfigError(
        "model.attention=linformer is for non-causal self-attention without a KV cache (encoder, "
        "encoder-only); use model.attention=dense or blockwise for causal or cached decoding"
      )
    if decode and (q_segment_ids is not None or kv_segment_ids is not None or positions is not None):
      raise ValueError("attention with decode=True takes no segment ids or positions: it uses the cache slots")
    if decode and cache_state is None:
      raise ValueError("attention with decode=True needs a cache_state (see jaxformer.inference)")
    d_model = x.shape[-1]
    n, kh, h = self.num_heads, self.num_kv_heads or self.num_heads, self.head_dim
    in_axes = (sh.EMBED, sh.HEADS, sh.KV)
    wq = self._kernel("query", (d_model, n, h), in_axes, 0, (1, 2))
    wk = self._kernel("key", (d_model, kh, h), in_axes, 0, (1, 2))
    wv = self._kernel("value", (d_model, kh, h), in_axes, 0, (1, 2))
    wo = self._kernel("out", (n, h, d_model), (sh.HEADS, sh.KV, sh.EMBED), (0, 1), 2)
    head_axes = (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_HEADS, sh.ACT_KV)

    x = x.astype(self.dtype)
    q = sh.constrain(self._heads(x, wq, "query"), head_axes)  # [B, T, N, H]
    q = checkpoint_name(q, remat.QUERY)  # tags for the named remat policies
    bias = self._position_bias(bias_table)
    if decode:
      out = self._cached(x, q, kv, q_valid, wk, wv, bias, cache_state)
    else:
      out = self._uncached(
        x, q, kv, q_valid, kv_valid, wk, wv, bias, deterministic, q_segment_ids, kv_segment_ids, positions, dropout_rng
      )
    out = checkpoint_name(out, remat.ATTENTION_OUT)
    b, t = out.shape[:2]  # out: [B, T, N, H]
    # One contracting axis (heads x head_dim): with two, XLA:CPU transposed the cached decode
    # step's attention output and the weight to head_dim-major every step.
    if int8.is_quantized(wo):
      y = int8.matmul(out.reshape(b * t, n * h), wo, 2, self.dtype).reshape(b, t, d_model)
    else:
      y = jnp.dot(out.reshape(b * t, n * h), wo.reshape(n * h, d_model)).reshape(b, t, d_model)
    y = add_adapter(self, self.lora, "out", "out", out, y, (sh.HEADS, sh.KV), (sh.EMBED,), self.dtype)
    if self.bias == "all":
      y = add_bias(y, sh.param(self, "out_bias", nn.initializers.zeros, (sh.EMBED,), (d_model,)).astype(self.dtype))
    return y

  def _position_bias(self, bias_table):
    """The self-attention score bias as `positions.PositionBias`, or None."""
    if self.is_cross or self.position not in ("alibi", "t5"):
      return None
    if self.position == "alibi":
      return alibi_bias, jnp.asarray(alibi_slopes(self.num_heads))
    if bias_table is None:
      raise ValueError("attention with position=t5 needs the stack's bias_table (positions.t5_table)")
    return T5Bias(self.relative_buckets, self.relative_max_distance, not self.causal), bias_table

  def _uncached(
    self,
    x,
    q,
    kv,
    q_valid,
    kv_valid,
    wk,
    wv,
    bias,
    deterministic,
    q_segment_ids,
    kv_segment_ids,
    positions,
    dropout_rng,
  ):
    head_axes = (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_HEADS, sh.ACT_KV)
    q_pos = jnp.arange(x.shape[1])[None]  # [1, T]
    causal, window = False, 0
    if self.is_cross:
      kv = kv.astype(self.dtype)
      k, v = self._heads(kv, wk, "key"), self._heads(kv, wv, "value")  # [B, S, K, H]
      kv_pos = jnp.arange(k.shape[1])[None]  # [1, S]
    else:
      causal, window = self.causal, self.sliding_window
      k, v = self._heads(x, wk, "key"), self._heads(x, wv, "value")  # [B, S, K, H]
      if positions is not None:
        q_pos = positions  # [B, T]
      kv_valid, kv_pos, kv_segment_ids = q_valid, q_pos, q_segment_ids
      if self.position == "rope":
        q, k = apply_rope(q, q_pos, scaling=self.rope_scaling), apply_rope(k, kv_pos, scaling=self.rope_scaling)
    k = checkpoint_name(sh.constrain(k, head_axes), remat.KEY)
    v = checkpoint_name(sh.constrain(v, head_axes), remat.VALUE)
    dropout = not deterministic and self.dropout_rate > 0.0
    if self.implementation == "blockwise" and dropout:
      raise ValueError("blockwise attention has no attention dropout; use dropout_rate=0 or dense attention")
    if self.implementation == "fused" and (dropout or self.softcap):
      raise ValueError("fused attention has no attention dropout or soft-cap; use dense attention for them")
    if not dropout:
      dropout_rng = None
    elif dropout_rng is None:
      dropout_rng = self.make_rng("dropout")
    if self.implementation == "linformer" and not self.is_cross:
      if q_segment_ids is not None:
        raise ConfigError(
          "model.attention=linformer mixes all positions of a row, so it cannot keep packed "
          "examples apart; set data.packing=false"
        )
      k, v = self._linformer_project(k, v, kv_valid)
      return dp.dot_product_attention(q, k, v, None, dropout_rng, self.dropout_rate, softcap=self.softcap)
    bias_fn, bias_params = bias if bias is not None else (None, None)
    opts = dp.AttentionOptions(
      self.implementation,
      causal,
      window,
      self.global_tokens,
      self.softcap,
      self.block_size,
      bias_fn,
      causal and positions is None,
      self.dropout_rate,
    )
    arrays = (q, k, v, q_pos, kv_pos, q_valid, kv_valid, q_segment_ids, kv_segment_ids)
    axes = context_axes(q.shape[1], k.shape[1])
    if axes:  # context parallelism: each device attends with its queries over the gathered keys
      if dropout:
        raise ValueError(
          "attention dropout does not run on a context-split sequence; set "
          "model.attention_dropout_rate=0 or mesh.context=1"
        )
      return over_length(lambda a, p: dp.attention(opts, a, p, axes)[0], axes, arrays, bias_params)
    out, weights = dp.attention(opts, arrays, bias_params, (), dropout_rng)
    if weights is not None:
      # Kept only when the caller makes "intermediates" mutable (`inference.attention_maps`); else a no-op.
      self.sow("intermediates", "attention_weights", weights)
    return out

  def _linformer_project(self, k, v, kv_valid):
    """Keys and values `[batch, S, K, H]` -> `[batch, linformer_k, K, H]`: E^T k and F^T v over
    the first S rows of E, F `[max_length, linformer_k]` (Wang et al. 2020, eq. 7), padded keys zeroed."""
    length = k.shape[1]
    if length > self.max_length:
      raise ValueError(
        f"linformer attention got {length} tokens; its projections cover model.max_length={self.max_length}"
      )
    init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=0, out_axis=1)
    shape = (self.max_length, self.linformer_k)
    e, f = (
      sh.param(self, name, init, (None, None), shape).astype(self.dtype)[:length]
      for name in ("key_projection", "value_projection")
    )
    if kv_valid is not None:
      keep = kv_valid[:, :, None, None].astype(k.dtype)
      k, v = k * keep, v * keep
    return jnp.einsum("bskh,sr->brkh", k, e), jnp.einsum("bskh,sr->brkh", v, f)  # [B, R, K, H]

  def _storage(
    self, name: str, state: kvc.CacheState, rows: int, tokens: int, kh: int, h: int, dtype, segmented: bool = True
  ):
    return self.variable("cache", name, kvc.empty_storage, state, rows, tokens, kh, h, dtype, segmented)

  def _cached(self, x, q, kv, q_valid, wk, wv, bias, state: kvc.CacheState):
    """Attention through the KV cache (see the class docstring); dense over the cached keys."""
    batch, t = x.shape[:2]
    kh, h = wk.shape[1], wk.shape[2]
    q_pos = state.lengths[:, None] + jnp.arange(t)[None]  # [B, T]
    if self.is_cross:
      if kv is None and not self.has_variable("cache", "key"):
        raise ValueError("cross-attention decode step before prefill: pass the encoder output first")
      if kv is not None:  # prefill: project the encoder output once and keep it
        kv = kv.astype(self.dtype)
        k, v = self._heads(kv, wk, "key"), self._heads(kv, wv, "value")  # [B, S, K, H]
        src_len = k.shape[1]
        src_pos = jnp.broadcast_to(jnp.arange(src_len)[None], (batch, src_len))
        src_valid = src_pos < state.source_lengths[:, None]
        for name, new in (("key", k), ("value", v)):
          store = self._storage(name, state, batch, src_len, kh, h, k.dtype, segmented=False)
          store.value = kvc.write(store.value, new, src_pos, src_valid, state.source_page_table, state.page_size)
      k_all = kvc.read(self.get_variable("cache", "key"), state.source_page_table)
      v_all = kvc.read(self.get_variable("cache", "value"), state.source_page_table)
      if state.beam_size > 1:
        return kvc.beam_attention(q, k_all, v_all, state, None, softcap=self.softcap)
      return kvc.cached_attention(q, k_all, v_all, q_pos, state.source_lengths, causal=False, softcap=self.softcap)
    k, v = self._heads(x, wk, "key"), self._heads(x, wv, "value")  # [B, T, K, H]
    if self.position == "rope":
      q, k = apply_rope(q, q_pos, scaling=self.rope_scaling), apply_rope(k, q_pos, scaling=self.rope_scaling)
    valid = jnp.ones((batch, t), bool) if q_valid is None else q_valid
    opts = dict(
      causal=self.causal,
      sliding_window=self.sliding_window,
      global_tokens=self.global_tokens,
      position_bias=bias,
      softcap=self.softcap,
    )
    if state.beam_size > 1:
      stored = []
      for name, new in (("key", k), ("value", v)):
        store = self.variable("cache", name)
        store.value = kvc.write_beams(store.value, new, state, valid)
        stored.append(store.value)
      return kvc.beam_attention(q, *stored, state, valid, **opts)
    stored = []
    for name, new in (("key", k), ("value", v)):
      store = self._storage(name, state, batch, state.capacity, kh, h, k.dtype)
      store.value = kvc.write(store.value, new, q_pos, valid, state.page_table, state.page_size)
      stored.append(kvc.read(store.value, state.page_table))
    kv_lengths = state.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)
    return kvc.cached_attention(q, *stored, q_pos, kv_lengths, **opts)
