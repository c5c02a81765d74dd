"""Tests of jaxformer.layers: attention, positions, LayerNorm / RMSNorm, feed-forward variants."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import ModelConfig
from jaxformer.layers.attention import MultiHeadAttention
from jaxformer.layers.dot_product import dot_product_attention
from jaxformer.layers.embedding import sinusoidal_positions
from jaxformer.layers.feed_forward import FeedForward
from jaxformer.layers.norm import LayerNorm, RMSNorm, make_norm
from jaxformer.layers.scores import attention_mask
from jaxformer.models.blocks import EncoderBlock

B, T, S, N, H = 3, 7, 11, 2, 8  # batch, query length, key length, heads, head_dim
D_MODEL = N * H


def _normal(seed, shape, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _qkv(seed=0):
  return _normal(seed, (B, T, N, H)), _normal(seed + 100, (B, S, N, H)), _normal(seed + 200, (B, S, N, H))


def _random_params(module, seed, *args, **kwargs):
  """Params of `module` with N(0, 0.5^2) entries (shapes from eval_shape; numpy values, so no
  random-number compile). LayerNorm scales get 1 + noise."""
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: module.init(k, *args, **kwargs), jax.random.key(0)))
  rng = np.random.default_rng(seed)

  def fill(path, x):
    v = 0.5 * rng.standard_normal(x.shape)
    if jax.tree_util.keystr(path).endswith("['scale']"):
      v = v + 1.0
    return jnp.asarray(v, jnp.float32)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def _reference_attention(q, k, v, kv_valid):
  """Plain numpy softmax attention over the valid keys only (padded keys dropped)."""
  q, k, v = map(np.asarray, (q, k, v))
  out = np.zeros(q.shape, np.float64)
  for b in range(q.shape[0]):
    idx = np.flatnonzero(kv_valid[b])
    for n in range(q.shape[2]):
      logits = q[b, :, n] @ k[b, idx, n].T / math.sqrt(q.shape[-1])  # [T, S_valid]
      w = np.exp(logits - logits.max(-1, keepdims=True))
      w /= w.sum(-1, keepdims=True)
      out[b, :, n] = w @ v[b, idx, n]
  return out


# --- dot_product_attention -----------------------------------------------------------------


def test_attention_matches_reference_without_mask():
  q, k, v = _qkv()
  out = dot_product_attention(q, k, v, None)
  assert out.shape == (B, T, N, H)
  ref = _reference_attention(q, k, v, np.ones((B, S), bool))
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


def test_padded_keys_get_zero_weight():
  q, k, v = _qkv(1)
  lengths = np.array([S, 5, 1])
  kv_valid = np.arange(S)[None, :] < lengths[:, None]  # [B, S]
  q_valid = np.ones((B, T), bool)
  mask = attention_mask(None, None, jnp.asarray(q_valid), jnp.asarray(kv_valid), causal=False, sliding_window=0)
  out = np.asarray(dot_product_attention(q, k, v, mask))

  # Replace the padded keys/values with large garbage: the output must not move at all.
  pad = jnp.asarray(~kv_valid)[:, :, None, None]
  k2 = jnp.where(pad, _normal(98, k.shape, 100.0), k)
  v2 = jnp.where(pad, _normal(99, v.shape, 1e4), v)
  out2 = np.asarray(dot_product_attention(q, k2, v2, mask))
  np.testing.assert_array_equal(out, out2)
  # And it equals attention over the valid keys only.
  np.testing.assert_allclose(out, _reference_attention(q, k, v, kv_valid), atol=1e-5, rtol=1e-5)
  # Row with one valid key: the output is exactly that key's value.
  np.testing.assert_allclose(out[2], np.broadcast_to(np.asarray(v)[2, 0], (T, N, H)), atol=1e-6)


def test_fully_masked_row_is_finite():
  q, k, v = _qkv(2)
  q_valid = np.ones((B, T), bool)
  q_valid[0, 3:] = False  # those query rows see nothing
  kv_valid = np.ones((B, S), bool)
  kv_valid[1] = False  # batch row 1: no valid key at all
  mask = attention_mask(None, None, jnp.asarray(q_valid), jnp.asarray(kv_valid), causal=False, sliding_window=0)
  out = np.asarray(dot_product_attention(q, k, v, mask))
  assert np.all(np.isfinite(out))
  # Fully masked rows degrade to a uniform average of the values (documented behaviour).
  np.testing.assert_allclose(out[1], np.broadcast_to(np.asarray(v)[1].mean(0), (T, N, H)), atol=1e-5)
  np.testing.assert_allclose(out[0, 3:], np.broadcast_to(np.asarray(v)[0].mean(0), (T - 3, N, H)), atol=1e-5)
  # Unmasked rows are unaffected.
  ref = _reference_attention(q, k, v, np.ones((B, S), bool))
  np.testing.assert_allclose(out[0, :3], ref[0, :3], atol=1e-5)
  np.testing.assert_allclose(out[2], ref[2], atol=1e-5)


# --- permutation equivariance --------------------------------------------------------------


def test_multi_head_attention_is_permutation_equivariant():
  mha = MultiHeadAttention(num_heads=N, head_dim=H)
  x = _normal(3, (2, S, D_MODEL))
  params = _random_params(mha, 4, x, None, None, deterministic=True)
  perm = np.random.default_rng(0).permutation(S)
  assert not np.array_equal(perm, np.arange(S))
  y = np.asarray(mha.apply(params, x, None, None, deterministic=True))
  y_perm = np.asarray(mha.apply(params, x[:, perm], None, None, deterministic=True))
  np.testing.assert_allclose(y_perm, y[:, perm], atol=1e-5, rtol=1e-5)
  assert np.abs(y).max() > 1e-3  # non-trivial output


def test_encoder_block_is_permutation_equivariant():
  cfg = ModelConfig(
    vocab_size=37,
    d_model=D_MODEL,
    num_heads=N,
    d_ff=24,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_length=16,
  )
  block = EncoderBlock(cfg)
  x = _normal(5, (2, S, D_MODEL))
  valid = jnp.ones((2, S), bool)
  params = _random_params(block, 6, x, valid, True)
  perm = np.random.default_rng(1).permutation(S)
  y = np.asarray(block.apply(params, x, valid, True))
  y_perm = np.asarray(block.apply(params, x[:, perm], valid, True))
  np.testing.assert_allclose(y_perm, y[:, perm], atol=1e-5, rtol=1e-5)
  # Also without validity: same result as all-valid.
  np.testing.assert_allclose(np.asarray(block.apply(params, x, None, True)), y, atol=1e-6)


# --- sinusoidal positions ------------------------------------------------------------------


def test_sinusoidal_positions_match_paper_formula():
  d = 10
  positions = np.array([[0, 1, 2, 7], [50, 3, 99, 511]])
  pe = np.asarray(sinusoidal_positions(jnp.asarray(positions), d, 512))
  assert pe.shape == (2, 4, d) and pe.dtype == np.float32
  for b in range(positions.shape[0]):
    for t in range(positions.shape[1]):
      pos = int(positions[b, t])
      for i in range(d // 2):
        angle = pos / 10000.0 ** (2 * i / d)
        assert abs(pe[b, t, 2 * i] - math.sin(angle)) < 1e-4, (pos, i)
        assert abs(pe[b, t, 2 * i + 1] - math.cos(angle)) < 1e-4, (pos, i)


def test_sinusoidal_positions_past_max_length_follow_the_formula():
  """A sequence longer than the model's max_length (a library call with a long source) gets
  the formula's encodings, as before the table, not the table's last row."""
  positions = jnp.arange(40)[None]
  pe = np.asarray(sinusoidal_positions(positions, 8, 24))
  angles = np.arange(40)[:, None] / 10000.0 ** (np.arange(0, 8, 2) / 8)
  np.testing.assert_allclose(pe[0, :, 0::2], np.sin(angles), atol=1e-5)
  np.testing.assert_allclose(pe[0, :, 1::2], np.cos(angles), atol=1e-5)


def test_sinusoidal_positions_rejects_odd_width():
  with pytest.raises(ValueError):
    sinusoidal_positions(jnp.zeros((1, 3), jnp.int32), 7, 8)


# --- LayerNorm -----------------------------------------------------------------------------


def test_layer_norm_normalizes_rows():
  x = 3.0 + _normal(7, (4, 5, 12), 5.0)
  ln = LayerNorm()
  params = {"params": {"scale": jnp.ones(12), "bias": jnp.zeros(12)}}
  # The initializer gives exactly these: scale 1, bias 0.
  init = jax.jit(ln.init)(jax.random.key(0), x)["params"]
  np.testing.assert_array_equal(nn.meta.unbox(init)["scale"], 1.0)
  np.testing.assert_array_equal(nn.meta.unbox(init)["bias"], 0.0)
  y = np.asarray(ln.apply(params, x))
  np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(y.var(-1), 1.0, atol=1e-4)  # epsilon 1e-6 vs variance ~25


def test_params_are_made_once_at_init_and_an_applied_shape_is_checked():
  from flax.errors import ScopeParamShapeError

  from jaxformer import sharding as sh

  calls = []

  def init(key, shape, dtype=jnp.float32):
    calls.append(shape)
    return jnp.full(shape, 2.0, dtype)

  class Scaled(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x * sh.param(self, "w", init, (sh.EMBED,), (x.shape[-1],))

  x = jnp.ones((2, 3))
  params = Scaled().init(jax.random.key(0), x)
  assert calls == [(3,)] and nn.get_partition_spec(params)["params"]["w"] == jax.sharding.PartitionSpec("embed")
  np.testing.assert_array_equal(Scaled().apply(nn.meta.unbox(params), x), 2.0)
  assert calls == [(3,)]  # applying neither calls nor traces the initializer
  with pytest.raises(ScopeParamShapeError, match=r'"w".*expected.*\(3,\).*has shape \(4,\)'):
    Scaled().apply({"params": {"w": jnp.ones(4)}}, x)

  class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x * sh.param(self, "w", init, (sh.EMBED,), (3,)) * sh.param(self, "w", init, (sh.EMBED,), (3,))

  with pytest.raises(ValueError, match='Duplicate use of scope name: "w"'):
    Twice().init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='Duplicate use of scope name: "w"'):
    Twice().apply(nn.meta.unbox(params), x)


def test_layer_norm_scale_and_bias():
  x = _normal(8, (3, 6))
  ln = LayerNorm(epsilon=1e-6)
  scale = np.linspace(0.5, 2.0, 6).astype(np.float32)
  bias = np.arange(6, dtype=np.float32) - 2.0
  params = {"params": {"scale": jnp.asarray(scale), "bias": jnp.asarray(bias)}}
  y = np.asarray(ln.apply(params, x))
  xn = np.asarray(x, np.float64)
  ref = (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, keepdims=True) + 1e-6) * scale + bias
  np.testing.assert_allclose(y, ref, atol=1e-5)


def test_layer_norm_bfloat16_uses_float32_statistics():
  # Rows with a large mean and small spread: bfloat16 sums would round the mean badly.
  base = np.array([512.0, 516.0, 520.0, 524.0, 528.0, 532.0, 536.0, 540.0], np.float32)
  x32 = np.stack([base, 4.0 * base[::-1], -base])
  x = jnp.asarray(x32, jnp.bfloat16)
  assert np.array_equal(np.asarray(x, np.float32), x32)  # exactly representable inputs
  ln = LayerNorm(dtype=jnp.bfloat16)
  params = {"params": {"scale": jnp.ones(8), "bias": jnp.zeros(8)}}
  y = ln.apply(params, x)
  assert y.dtype == jnp.bfloat16
  ref = (x32 - x32.mean(-1, keepdims=True)) / np.sqrt(x32.var(-1, keepdims=True) + 1e-6)
  # Output equals the float32 result rounded to bfloat16 (relative error <= 2^-8).
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2**-8, atol=1e-6)
  np.testing.assert_allclose(np.asarray(y, np.float32).mean(-1), 0.0, atol=2e-2)

  # The check above is discriminative: statistics computed in bfloat16 are far off.
  xb = x
  mean_b = jnp.mean(xb, axis=-1, keepdims=True, dtype=jnp.bfloat16)
  var_b = jnp.mean(jnp.square(xb - mean_b), axis=-1, keepdims=True, dtype=jnp.bfloat16)
  y_b = np.asarray((xb - mean_b) * jax.lax.rsqrt(var_b + jnp.bfloat16(1e-6)), np.float32)
  assert np.abs(y_b - ref).max() > 0.05


def test_rms_norm_matches_hand_computation():
  x = 2.0 + _normal(11, (3, 5, 12), 3.0)
  scale = np.linspace(0.5, 2.0, 12).astype(np.float32)
  y = np.asarray(RMSNorm().apply({"params": {"scale": jnp.asarray(scale)}}, x))
  xn = np.asarray(x, np.float64)
  ref = xn / np.sqrt(np.mean(xn**2, axis=-1, keepdims=True) + 1e-6) * scale
  np.testing.assert_allclose(y, ref, rtol=1e-5)
  assert abs(y.mean()) > 0.1  # not centred, unlike LayerNorm
  assert isinstance(make_norm("rmsnorm", jnp.float32), RMSNorm)
  with pytest.raises(ValueError, match="use one of layernorm, rmsnorm"):
    make_norm("batchnorm", jnp.float32)


# --- FeedForward ---------------------------------------------------------------------------


def test_feed_forward_matches_hand_computation():
  ffn = FeedForward(d_ff=24)
  x = _normal(9, (2, S, D_MODEL))
  params = _random_params(ffn, 10, x)["params"]  # non-zero biases: both bias terms matter
  assert params["wi"].shape == (D_MODEL, 24) and params["wo"].shape == (24, D_MODEL)
  y = np.asarray(ffn.apply({"params": params}, x))
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  xn = np.asarray(x, np.float64)
  h = np.maximum(0.0, xn @ p["wi"] + p["bi"])
  assert 0 < (h == 0).mean() < 1  # ReLU actually clips something
  ref = h @ p["wo"] + p["bo"]
  np.testing.assert_allclose(y, ref, atol=1e-5, rtol=1e-5)


def _gelu(h):
  return 0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0)))


@pytest.mark.parametrize(
  "activation, act, gated",
  [("gelu", _gelu, False), ("swiglu", lambda h: h / (1.0 + np.exp(-h)), True), ("geglu", _gelu, True)],
)
def test_feed_forward_variants_match_hand_computation(activation, act, gated):
  ffn = FeedForward(d_ff=24, activation=activation)
  x = _normal(12, (2, S, D_MODEL))
  params = _random_params(ffn, 13, x)["params"]
  assert ("wi_gate" in params) == gated and ("bi_gate" in params) == gated
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  xn = np.asarray(x, np.float64)
  h = xn @ p["wi"] + p["bi"]
  h = act(xn @ p["wi_gate"] + p["bi_gate"]) * h if gated else act(h)
  y = np.asarray(ffn.apply({"params": params}, x))
  np.testing.assert_allclose(y, h @ p["wo"] + p["bo"], atol=1e-5, rtol=1e-5)


def test_vocab_major_logits_equal_tokens_first():
  """`Embed.attend(vocab_major=True)` (decode steps of few tokens) gives the tokens-first logits."""
  from jaxformer.layers.embedding import Embed

  embed = Embed(vocab_size=37, d_model=16)
  x = jax.random.normal(jax.random.PRNGKey(1), (3, 2, 16))
  params = embed.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
  rows = embed.apply(params, x, method="attend")
  cols = embed.apply(params, x, True, method="attend")
  assert cols.shape == rows.shape == (3, 2, 37) and cols.dtype == jnp.float32
  np.testing.assert_allclose(cols, rows, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rows, np.einsum("btd,vd->btv", x, jax.tree.leaves(params)[0]), rtol=1e-5, atol=1e-5)
