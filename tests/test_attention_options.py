"""Tests of the architecture options: RoPE, ALiBi, grouped-query heads, soft-capping,
sliding windows, blockwise attention, and every position scheme / option in the model
(causality and cached decoding; the long-context options' own tests are in test_long_context.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep
from test_layers import _normal, _random_params

from jaxformer.config import ConfigError, ModelConfig, config_from_dict
from jaxformer.inference import cache as kv
from jaxformer.layers import kv_cache as kvc
from jaxformer.layers.attention import MultiHeadAttention
from jaxformer.layers.blockwise import blockwise_attention
from jaxformer.layers.dot_product import dot_product_attention, fused_attention
from jaxformer.layers.positions import alibi_bias, alibi_slopes, apply_rope
from jaxformer.layers.scores import attention_mask, attention_scores
from jaxformer.models.transformer import BOS_ID, PAD_ID, EncoderDecoder
from jaxformer.runtime.startup import check_model_fits_mesh

B, T, S, N, H = 2, 13, 11, 4, 8  # batch, query length, key length, heads, head_dim


# --- RoPE, ALiBi, soft-cap -----------------------------------------------------------------


def test_rope_scores_depend_only_on_relative_position():
  q, k = _normal(0, (B, T, N, H)), _normal(1, (B, T, N, H))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))

  def scores(q_shift, k_shift):
    return np.asarray(attention_scores(apply_rope(q, pos + q_shift), apply_rope(k, pos + k_shift), None, None))

  base = scores(0, 0)
  np.testing.assert_allclose(scores(37, 37), base, atol=1e-4)  # same offset on both: same scores
  np.testing.assert_allclose(scores(1000, 1000), base, atol=1e-3)
  assert np.abs(scores(1, 0) - base).max() > 0.1  # a relative shift changes them
  assert np.abs(base - np.asarray(attention_scores(q, k, None, None))).max() > 0.1
  # Position 0 is the identity, and every rotation preserves norms.
  np.testing.assert_allclose(np.asarray(apply_rope(q, jnp.zeros((B, T), jnp.int32))), np.asarray(q), atol=1e-6)
  np.testing.assert_allclose(
    np.linalg.norm(np.asarray(apply_rope(q, pos + 5)), axis=-1), np.linalg.norm(np.asarray(q), axis=-1), rtol=1e-5
  )


def test_alibi_slopes_follow_the_paper():
  np.testing.assert_array_equal(alibi_slopes(8), [2.0**-i for i in range(1, 9)])
  np.testing.assert_allclose(alibi_slopes(16)[:2], [2.0**-0.5, 2.0**-1.0])
  # 6 heads: the 4-head slopes, then every other 8-head slope.
  np.testing.assert_array_equal(alibi_slopes(6), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3])
  bias = np.asarray(alibi_bias(jnp.asarray([0.5, 0.25]), jnp.asarray([[0, 1, 2]]), jnp.asarray([[0, 1, 2, 3]])))
  assert bias.shape == (1, 2, 3, 4)
  np.testing.assert_array_equal(bias[0, 0, 2], [-1.0, -0.5, 0.0, -0.5])
  np.testing.assert_array_equal(bias[0, 1, 0], [0.0, -0.25, -0.5, -0.75])


def test_softcap_bounds_scores():
  q, k = _normal(2, (B, T, N, H), 10.0), _normal(3, (B, S, N, H), 10.0)
  raw = np.asarray(attention_scores(q, k, None, None))
  capped = np.asarray(attention_scores(q, k, None, None, softcap=5.0))
  assert np.abs(raw).max() > 50.0
  assert np.abs(capped).max() <= 5.0  # tanh rounds to exactly 1 in float32 far out
  np.testing.assert_allclose(capped, 5.0 * np.tanh(raw / 5.0), atol=1e-5)


# --- the attention module: GQA and sliding windows -----------------------------------------


def _mha_apply(params, x, valid=None, **kw):
  return np.asarray(MultiHeadAttention(num_heads=N, head_dim=H, **kw).apply(params, x, None, valid, deterministic=True))


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads():
  x = _normal(4, (B, T, N * H))
  valid = jnp.asarray(np.arange(T)[None] < np.array([[T], [6]]))
  gqa = MultiHeadAttention(num_heads=N, head_dim=H, num_kv_heads=2, causal=True)
  params = _random_params(gqa, 5, x, None, valid, deterministic=True)
  p = params["params"]
  assert p["key"].shape == (N * H, 2, H) and p["query"].shape == (N * H, N, H)
  mha = {"params": dict(p, key=jnp.repeat(p["key"], 2, axis=1), value=jnp.repeat(p["value"], 2, axis=1))}
  y = _mha_apply(params, x, valid, num_kv_heads=2, causal=True)
  np.testing.assert_allclose(y, _mha_apply(mha, x, valid, causal=True), atol=1e-5)
  # num_kv_heads = num_heads is plain multi-head attention (same parameters, same output).
  np.testing.assert_array_equal(
    _mha_apply(mha, x, valid, num_kv_heads=N, causal=True), _mha_apply(mha, x, valid, causal=True)
  )


def test_kv_heads_must_split_over_the_tensor_axis():
  config = config_from_dict({}, ["model.num_heads=8", "model.num_kv_heads=2"])
  check_model_fits_mesh(config, fsdp=1, tensor=2)
  with pytest.raises(
    ConfigError, match=r"mesh.tensor=4 does not divide model.num_kv_heads=2; use mesh.tensor in \[1, 2\]"
  ):
    check_model_fits_mesh(config, fsdp=1, tensor=4)


def test_sliding_window():
  x = _normal(6, (B, T, N * H))
  params = _random_params(MultiHeadAttention(num_heads=N, head_dim=H), 7, x, None, deterministic=True)
  full = _mha_apply(params, x, causal=True)
  for w in (T, T + 5):  # a window covering the sequence is full causal attention
    np.testing.assert_allclose(_mha_apply(params, x, causal=True, sliding_window=w), full, atol=1e-6)
  # w = 3 differs, and only from query 3 on (queries 0..2 see all their past anyway).
  local = _mha_apply(params, x, causal=True, sliding_window=3)
  np.testing.assert_allclose(local[:, :3], full[:, :3], atol=1e-6)
  assert np.abs(local[:, 3:] - full[:, 3:]).max() > 1e-3
  # w = 1: each token attends to itself only, so the output is its own value projection.
  p = params["params"]
  own = np.einsum("btd,dnh,nhe->bte", x, p["value"], p["out"])
  np.testing.assert_allclose(_mha_apply(params, x, causal=True, sliding_window=1), own, atol=1e-5, rtol=1e-5)


# --- blockwise attention -------------------------------------------------------------------


def _valid(lengths, length):
  return jnp.asarray(np.arange(length)[None] < np.asarray(lengths)[:, None])


BLOCKWISE_CASES = {
  # cross-attention shape (T != S); row 1 has no valid key, so its rows are fully masked
  "padding": dict(kv_len=S, q_valid=[T, 9], kv_valid=[S, 0]),
  "causal": dict(kv_len=T, q_valid=[T, 6], kv_valid=[T, 6], causal=True),
  # blocks of 4 keys: the last one (key 16 and padding) lies after every query and is skipped;
  # row 1's padded queries (fully masked) still average all values
  "causal_keys_past_the_queries": dict(kv_len=T + 4, q_valid=[T, 6], kv_valid=[T + 4, T + 4], causal=True),
  "sliding_window": dict(kv_len=T, q_valid=[T, 8], kv_valid=[T, 8], causal=True, sliding_window=3),
  # queries at positions 8..20: the block of keys 0..3 is out of every query's window and skipped
  "sliding_window_keys_before_the_queries": dict(
    kv_len=T + 8, q_offset=8, q_valid=[T, 6], kv_valid=[T + 8, T + 8], causal=True, sliding_window=3
  ),
  "gqa_alibi_softcap": dict(
    kv_len=T, q_valid=[T, 7], kv_valid=[T, 7], causal=True, kv_heads=2, alibi=True, softcap=2.0
  ),
}


def _case_inputs(c: dict, seed: int):
  """(q, k, v, output cotangent, q positions, kv positions) of an attention case: normal draws from
  keys seed .. seed + 3, `c["kv_len"]` keys of `c.get("kv_heads", N)` heads."""
  kv_len, kv_heads = c["kv_len"], c.get("kv_heads", N)
  q = _normal(seed, (B, T, N, H))
  k, v = _normal(seed + 1, (B, kv_len, kv_heads, H)), _normal(seed + 2, (B, kv_len, kv_heads, H))
  q_pos = jnp.arange(T)[None] + c.get("q_offset", 0)
  return q, k, v, _normal(seed + 3, (B, T, N, H)), q_pos, jnp.arange(kv_len)[None]


@pytest.mark.parametrize("case", BLOCKWISE_CASES, ids=list(BLOCKWISE_CASES))
def test_blockwise_equals_dense_forward_and_gradients(case):
  c = BLOCKWISE_CASES[case]
  kv_len = c["kv_len"]
  q, k, v, d_out, q_pos, kv_pos = _case_inputs(c, 10)
  q_valid, kv_valid = _valid(c["q_valid"], T), _valid(c["kv_valid"], kv_len)
  causal, window, softcap = c.get("causal", False), c.get("sliding_window", 0), c.get("softcap", 0.0)
  slopes = jnp.asarray(alibi_slopes(N)) if c.get("alibi") else None

  def dense(q, k, v):
    mask = attention_mask(q_pos, kv_pos, q_valid, kv_valid, causal, window)
    bias = None if slopes is None else alibi_bias(slopes, q_pos, kv_pos)
    return dot_product_attention(q, k, v, mask, bias=bias, softcap=softcap)

  def blockwise(q, k, v):  # block 4: 13 and 11 keys leave a partly padded last block
    return blockwise_attention(
      q,
      k,
      v,
      q_positions=q_pos,
      kv_positions=kv_pos,
      q_valid=q_valid,
      kv_valid=kv_valid,
      causal=causal,
      sliding_window=window,
      position_bias=None if slopes is None else (alibi_bias, slopes),
      softcap=softcap,
      block_size=4,
    )

  _assert_same_outputs_and_grads(dense, blockwise, q, k, v, d_out)


def test_blocks_masked_by_position_alone_are_recognised():
  """`block_is_masked`: causal (keys after the last query), the sliding window on either side
  (not with global tokens, which see across it); padding keys (past S or invalid) and padding
  queries are left out, and a side of padding only counts as masked."""
  from jaxformer.layers.blockwise import _Spec, block_is_masked

  def masked(keys, queries, k_ok=None, q_ok=None, causal=True, window=0, global_tokens=0):
    spec = _Spec(causal, window, 0.0, len(keys), None, global_tokens, ())
    k_ok = np.ones(len(keys), bool) if k_ok is None else np.asarray(k_ok)
    q_ok = np.ones(len(queries), bool) if q_ok is None else np.asarray(q_ok)
    args = (jnp.asarray([keys]), jnp.asarray([k_ok]), jnp.asarray([queries]), jnp.asarray([q_ok]))
    return bool(block_is_masked(spec, *args))

  assert masked([8, 9], [3, 7]) and not masked([7, 8], [3, 7])
  assert not masked([7, 99], [3, 7], k_ok=[True, False]) and masked([99, 8], [3, 7], k_ok=[False, True])
  assert masked([8, 9], [3, 7, 12], q_ok=[True, True, False]) and not masked([8, 9], [3, 7, 12])
  assert masked([0, 1], [4, 6], k_ok=[False, False]) and masked([0, 1], [4, 6], q_ok=[False, False])
  assert masked([0, 1], [4, 6], causal=False, window=3) and not masked([1, 2], [4, 6], causal=False, window=3)
  assert masked([9, 10], [4, 6], causal=False, window=3) and not masked([8, 9], [4, 6], causal=False, window=3)
  assert masked([0, 1], [4, 6, 0], q_ok=[True, True, False], causal=False, window=3)
  assert not masked([0, 1], [4, 6], causal=False, window=3, global_tokens=1)


def _assert_same_outputs_and_grads(reference_fn, fn, q, k, v, d_out):
  """`fn(q, k, v)` and its q/k/v gradients for cotangent `d_out` equal `reference_fn`'s (1e-5),
  each of them non-trivial."""

  @jax.jit
  def outputs_and_grads(q, k, v, d_out):
    results = []
    for f in (reference_fn, fn):
      out, vjp = jax.vjp(f, q, k, v)
      results.append((out, *vjp(d_out)))
    return results

  reference, got = outputs_and_grads(q, k, v, d_out)
  for name, x, x_ref in zip(("out", "dq", "dk", "dv"), got, reference):
    assert np.abs(np.asarray(x_ref)).max() > 1e-2, name
    np.testing.assert_allclose(np.asarray(x), np.asarray(x_ref), atol=1e-5, rtol=1e-5, err_msg=name)


# jax.nn.dot_product_attention places its masks by index, so only cases whose queries start at position 0.
FUSED_CASES = {n: c for n, c in BLOCKWISE_CASES.items() if n != "gqa_alibi_softcap" and not c.get("q_offset")}
FUSED_CASES["gqa_alibi"] = dict(kv_len=T, q_valid=[T, 7], kv_valid=[T, 7], causal=True, kv_heads=2, alibi=True)


@pytest.mark.parametrize("case", FUSED_CASES, ids=list(FUSED_CASES))
def test_fused_equals_dense_forward_and_gradients(case):
  """jax.nn.dot_product_attention (XLA on CPU) against ours: padding with a fully masked row,
  causal (by mask and by `is_causal`), sliding window, grouped-query heads with ALiBi."""
  c = FUSED_CASES[case]
  kv_len = c["kv_len"]
  q, k, v, d_out, q_pos, kv_pos = _case_inputs(c, 20)
  causal, window = c.get("causal", False), c.get("sliding_window", 0)
  mask = attention_mask(q_pos, kv_pos, _valid(c["q_valid"], T), _valid(c["kv_valid"], kv_len), causal, window)
  bias = alibi_bias(jnp.asarray(alibi_slopes(N)), q_pos, kv_pos) if c.get("alibi") else None

  _assert_same_outputs_and_grads(
    lambda q, k, v: dot_product_attention(q, k, v, mask, bias=bias),
    lambda q, k, v: fused_attention(q, k, v, mask, bias=bias, is_causal=causal),
    q,
    k,
    v,
    d_out,
  )


def test_fused_refuses_dropout_and_softcap():
  with pytest.raises(ConfigError, match="model.attention=fused does not support attention dropout"):
    config_from_dict({"model": {"attention": "fused", "attention_dropout_rate": 0.1}})
  with pytest.raises(ConfigError, match="model.attention=fused has no score soft-cap"):
    config_from_dict({"model": {"attention": "fused", "attn_logit_softcap": 5.0}})


def _grad_temp_bytes(attention, length):
  """XLA's temporary buffer size for the gradient of `attention` at `length` tokens (compile only)."""
  x = jax.ShapeDtypeStruct((1, length, 1, 8), jnp.float32)
  grad = jax.jit(jax.grad(lambda q, k, v: attention(q, k, v).sum(), argnums=(0, 1, 2)))
  return grad.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_gradient_memory_grows_linearly():
  def blockwise(q, k, v):
    pos = jnp.arange(q.shape[1])[None]
    return blockwise_attention(q, k, v, q_positions=pos, kv_positions=pos, causal=True, block_size=256)

  def dense(q, k, v):
    pos = jnp.arange(q.shape[1])[None]
    return dot_product_attention(q, k, v, attention_mask(pos, pos, None, None, True, 0))

  lengths = (1024, 2048, 4096, 8192)
  temps = [_grad_temp_bytes(blockwise, n) for n in lengths]
  for small, large in zip(temps, temps[1:]):
    assert large / small < 2.2, temps  # doubling the length at most ~doubles the memory
  # Causal: the queries go in blocks too, so what grows is q, k, v and the output, not a
  # [T, block] temporary per key block (8x the length: 1.7x the memory, 8x with whole-length queries).
  assert temps[-1] < 3 * temps[0], temps
  # The check discriminates: dense attention's [T, T] scores grow 4x per doubling.
  dense_1k, dense_2k = (_grad_temp_bytes(dense, n) for n in lengths[:2])
  assert dense_2k / dense_1k > 3.5 and dense_2k > 4 * temps[1], (dense_1k, dense_2k, temps)


# --- every option in the model: causality and cached decoding -------------------------------

VOCAB, SRC_LEN, TGT_LEN, PREFILL, CHANGED_FROM = 37, 9, 7, 4, 3
BASE = dict(
  vocab_size=VOCAB,
  d_model=16,
  num_heads=4,
  d_ff=24,
  num_encoder_layers=1,
  num_decoder_layers=1,
  dropout_rate=0.0,
  max_length=16,
  attention_block_size=4,
)
# Each position scheme with each attention kind; the other options spread over them.
MODEL_CASES = {
  "sinusoidal-dense": dict(),
  "sinusoidal-blockwise": dict(attention="blockwise", norm="rmsnorm", pre_norm=True, ffn="swiglu"),
  "learned-dense": dict(position="learned", ffn="gelu", tie_embeddings=False, num_kv_heads=1),
  "learned-blockwise": dict(
    position="learned", attention="blockwise", ffn="geglu", num_kv_heads=2, attn_logit_softcap=3.0
  ),
  "rope-dense": dict(position="rope", num_kv_heads=2, sliding_window=3, norm="rmsnorm", pre_norm=True),
  "rope-blockwise": dict(position="rope", attention="blockwise", sliding_window=3, num_kv_heads=1, ffn="swiglu"),
  "alibi-dense": dict(position="alibi", attn_logit_softcap=3.0, sliding_window=4, ffn="geglu"),
  "alibi-blockwise": dict(position="alibi", attention="blockwise", num_kv_heads=2, pre_norm=True),
  "none-dense": dict(position="none", sliding_window=2, tie_embeddings=False),
  "none-blockwise": dict(position="none", attention="blockwise", norm="rmsnorm", attn_logit_softcap=3.0),
  # T5 bias, RoPE scalings, global tokens and Linformer (the encoder's; the decoder stays dense).
  "t5-dense": dict(position="t5", relative_buckets=6, relative_max_distance=8, sliding_window=3, global_tokens=1),
  "t5-blockwise": dict(
    position="t5", attention="blockwise", relative_buckets=6, relative_max_distance=8, num_kv_heads=2
  ),
  "rope_linear-dense": dict(
    position="rope", rope_scaling="linear", rope_scaling_factor=2.0, sliding_window=2, global_tokens=2
  ),
  "rope_yarn-blockwise": dict(
    position="rope",
    attention="blockwise",
    rope_scaling="yarn",
    rope_scaling_factor=4.0,
    sliding_window=3,
    global_tokens=1,
  ),
  "rope_ntk-linformer": dict(
    position="rope", attention="linformer", linformer_k=5, rope_scaling="ntk", rope_scaling_factor=2.0
  ),
  "rope-fused": dict(position="rope", attention="fused", num_kv_heads=2, sliding_window=3, pre_norm=True),
  # The published families' options: biases, head_dim, norm epsilon, unscaled embeddings, Llama 3's RoPE.
  "rope_llama3-biases": dict(
    position="rope",
    rope_scaling="llama3",
    rope_scaling_factor=8.0,
    rope_trained_length=4,
    rope_theta=500000.0,
    attention_bias="qkv",
    mlp_bias=False,
    embedding_scale=False,
    attention_head_dim=6,
    num_kv_heads=2,
    norm="rmsnorm",
    norm_epsilon=1e-5,
    pre_norm=True,
    ffn="swiglu",
  ),
  "learned-gpt2": dict(
    position="learned",
    attention_bias="all",
    ffn="gelu_tanh",
    embedding_scale=False,
    norm_epsilon=1e-5,
    pre_norm=True,
    attention="blockwise",
  ),
}


def _float32_logit_error(config: ModelConfig, params) -> np.ndarray:
  """A first-order bound on |float32 logit - exact logit| for one evaluation of the model,
  float `[vocab]` (the cached and the full forward are two such evaluations, in different
  orders, so they differ by at most twice it, on any machine and under any load).

  The logit of token v is z_v = sum_d y_d w_dv over the final hidden state y (the output of a
  norm with scale g and bias b, so |y| <= max|g| sqrt(d_model) + |b|) and the output weights
  w_v (the tied embedding row, or the `output_proj` column); by Cauchy-Schwarz M_v = |y| |w_v|
  bounds |z_v| and the sum of |y_d w_dv|. A float32 reduction of length K errs by at most
  gamma_K = K u / (1 - K u) times the sum of its absolute terms (u = 2^-24; Higham,
  "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1). Every reduction on
  the way to the logits adds its length to K: per attention the q/k/v projection (d_model),
  the scores (head_dim), the softmax normaliser and the weighted sum over at most max_length
  keys (the cache), the output projection (d_model); per FFN d_model + d_ff; per norm d_model
  (mean, variance); then the logits (d_model). Assumed: the norms keep each stage's relative
  error from growing on its way to y, i.e. the upstream errors enter z_v with weight <= 1."""
  d, h, s = config.d_model, config.head_dim, config.max_length
  attention, ffn = d + h + 2 * s + d, d + config.d_ff
  k = (
    config.num_encoder_layers * (attention + ffn + 2 * d)
    + config.num_decoder_layers * (2 * attention + ffn + 3 * d)
    + d
  )
  u = 2.0**-24
  p = params["params"]
  norm = p["decoder_norm"] if config.pre_norm else p[f"decoder_{config.num_decoder_layers - 1}"]["ffn_sublayer"]["norm"]
  y = np.abs(np.asarray(norm["scale"])).max() * np.sqrt(d) + np.linalg.norm(np.asarray(norm.get("bias", 0.0)))
  w = np.asarray(p["embed"]["embedding"]).T if config.tie_embeddings else np.asarray(p["output_proj"])  # [D, V]
  return k * u / (1 - k * u) * y * np.linalg.norm(w, axis=0)


def _model_batch():
  rng = np.random.default_rng(0)
  src = rng.integers(4, VOCAB, (B, SRC_LEN))
  dec = rng.integers(4, VOCAB, (B, TGT_LEN))
  dec[:, 0] = BOS_ID  # decoder inputs: the cached prefill feeds BOS first
  src[1, 5:] = PAD_ID
  dec[1, 5:] = PAD_ID
  later = (np.arange(TGT_LEN)[None] >= CHANGED_FROM) & (dec != PAD_ID)
  perturbed = np.where(later, (dec - 3) % (VOCAB - 4) + 4, dec)  # other real tokens from CHANGED_FROM on
  assert (perturbed[later] != dec[later]).all()
  return tuple(jnp.asarray(a, jnp.int32) for a in (src, dec, perturbed))


@pytest.mark.parametrize(
  "case", sweep(MODEL_CASES, {"alibi-dense", "learned-gpt2", "rope_llama3-biases", "rope_ntk-linformer"})
)
def test_option_is_causal_and_cached_decoding_matches(case):
  config = ModelConfig(**BASE, **MODEL_CASES[case])
  config.validate()
  model = EncoderDecoder(config)
  src, dec, perturbed = _model_batch()
  params = _random_params(model, 20, src, dec)

  @jax.jit
  def run(params, src, dec, perturbed):
    both = jnp.concatenate([src, src])  # one batch: the original and the perturbed targets
    full = model.apply(
      params, model.apply(params, both, method="encode"), both, jnp.concatenate([dec, perturbed]), method="decode"
    )
    p = params["params"]
    first, cache = kv.prefill(model, p, kv.contiguous_cache(model, p, B, SRC_LEN), src)  # encodes, feeds BOS
    chunk, cache = kv.extend(model, p, cache, dec[:, 1:PREFILL])  # several tokens at once

    def step(cache, i):
      token = jax.lax.dynamic_index_in_dim(dec, i, axis=1, keepdims=False)  # [B]
      logits, cache = kv.step(model, p, cache, token)
      return cache, logits

    cache, steps = jax.lax.scan(step, cache, jnp.arange(PREFILL, TGT_LEN))
    cached = jnp.concatenate([first[:, None], chunk, jnp.moveaxis(steps, 0, 1)], axis=1)
    return full[:B], full[B:], cached, cache

  full, changed, cached, cache = run(params, src, dec, perturbed)
  full, changed, cached = np.asarray(full), np.asarray(changed), np.asarray(cached)
  assert full.shape == (B, TGT_LEN, VOCAB) and np.isfinite(full).all()
  # Causality: tokens from CHANGED_FROM on never change the logits before them.
  np.testing.assert_array_equal(changed[:, :CHANGED_FROM], full[:, :CHANGED_FROM])
  assert np.abs(changed[:, CHANGED_FROM:] - full[:, CHANGED_FROM:]).max() > 1e-3
  # Cached decoding (the prefill feeds BOS, a chunk of several tokens, then one per step) equals the full
  # forward up to float32 rounding; a decoding bug (a wrong slot, mask or position) moves
  # logits by 1e-2 and more, far above the bound (about 4e-4 here).
  real = np.asarray(dec) != PAD_ID
  bound = 2 * np.broadcast_to(_float32_logit_error(config, params), cached.shape)
  excess = np.abs(cached - full)[real] / bound[real]
  assert excess.max() <= 1.0, (excess.max(), np.abs(cached - full)[real].max())
  self_cache = cache.layers["decoder_0"]["self_attention"]
  assert kvc.join_segments(self_cache["key"]).shape == (B, config.kv_heads, config.max_length, config.head_dim)
  np.testing.assert_array_equal(cache.state.lengths, real.sum(axis=1))  # PAD tokens are not cached
