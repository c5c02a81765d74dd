"""Tests of the long-context options: T5 relative position bias, RoPE scaling, global tokens on
top of the sliding window, Linformer attention, and all of them on a tensor=2 mesh. (Causality
and cached decoding of each in the encoder-decoder are in test_attention_options.py's model
cases; here the decoder-only model's.)"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep
from test_layers import _normal, _random_params
from test_mesh_equivalence import _run

from jaxformer.config import ConfigError, config_from_dict
from jaxformer.inference import cache as kv
from jaxformer.layers.attention import MultiHeadAttention
from jaxformer.layers.blockwise import blockwise_attention
from jaxformer.layers.dot_product import dot_product_attention
from jaxformer.layers.positions import RopeScaling, T5Bias, apply_rope, dynamic_base, rope_frequencies, t5_buckets
from jaxformer.layers.scores import attention_mask, position_mask
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.models.encoder_only import EncoderOnly
from jaxformer.models.transformer import PAD_ID

B, T, N, H = 2, 13, 4, 8


# --- T5 relative position bias ---------------------------------------------------------------


def test_t5_buckets_match_hand_computed_values():
  buckets = jax.jit(t5_buckets, static_argnums=(1, 2, 3))
  # Bidirectional, 32 buckets up to 128: 16 per direction, 8 exact; key after the query: + 16.
  # Distance 12: 8 + floor(log(12/8) / log(128/8) * 8) = 8 + floor(1.17) = 9; 40: 8 + floor(4.64) = 12;
  # 20 after: 16 + 8 + floor(log(20/8) / log(16) * 8) = 24 + floor(2.64) = 26; >= 128: the last bucket.
  relative = jnp.asarray([0, -3, 3, -7, 7, -12, -40, 20, -128, -1000, 1000])
  np.testing.assert_array_equal(buckets(relative, True, 32, 128), [0, 3, 19, 7, 23, 9, 12, 26, 15, 15, 31])
  # Causal, 32 buckets up to 128: future keys -> 0, 16 exact; 32 back: 16 + floor(log(2) / log(8) * 16) = 21;
  # 100 back: 16 + floor(log(6.25) / log(8) * 16) = 16 + floor(14.1) = 30.
  relative = jnp.asarray([5, 0, -5, -15, -32, -100, -128, -5000])
  np.testing.assert_array_equal(buckets(relative, False, 32, 128), [0, 0, 5, 15, 21, 30, 31, 31])


def test_t5_scores_depend_only_on_relative_position():
  x = _normal(0, (B, T, N * H))
  attn = MultiHeadAttention(num_heads=N, head_dim=H, position="t5", relative_buckets=8, relative_max_distance=16)
  table = _normal(1, (8, N))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  params = _random_params(attn, 2, x, None, deterministic=True, positions=pos, bias_table=table)

  @jax.jit
  def outputs(table):  # shifted by 0 and by 37, and without the bias
    def out(shift, table=table):
      return attn.apply(params, x, None, deterministic=True, positions=pos + shift, bias_table=table)

    return out(0), out(37), out(0, jnp.zeros_like(table)), T5Bias(8, 16)(table, pos[:1], pos[:1])

  base, shifted, unbiased, bias = map(np.asarray, outputs(table))
  np.testing.assert_allclose(shifted, base, atol=1e-5)  # same offsets, same output
  assert np.abs(unbiased - base).max() > 1e-2  # the bias acts
  buckets = np.asarray(t5_buckets(jnp.arange(-T + 1, T), True, 8, 16))
  for d in range(-T + 1, T):  # the bias [1, N, T, T] is constant along every diagonal: the row of its bucket
    diagonal = np.diagonal(bias[0], offset=d, axis1=1, axis2=2)  # [N, T - |d|]
    np.testing.assert_array_equal(
      diagonal, np.repeat(np.asarray(table)[buckets[d + T - 1]][:, None], diagonal.shape[1], axis=1)
    )


GLOBAL_CASES = {
  "bidirectional-t5": dict(causal=False, window=0, global_tokens=0),
  "causal-window-global-t5": dict(causal=True, window=3, global_tokens=2),
}


@pytest.mark.parametrize("case", GLOBAL_CASES, ids=list(GLOBAL_CASES))
def test_blockwise_equals_dense_with_t5_bias_and_global_tokens(case):
  c = GLOBAL_CASES[case]
  q, k, v, d_out = (_normal(i, (B, T, N, H)) for i in range(10, 14))
  table = _normal(14, (8, N))
  pos = jnp.arange(T)[None]
  valid = jnp.asarray(np.arange(T)[None] < np.array([[T], [8]]))
  t5 = T5Bias(8, 16, bidirectional=not c["causal"])

  def dense(q, k, v, table):
    mask = attention_mask(pos, pos, valid, valid, c["causal"], c["window"], global_tokens=c["global_tokens"])
    return dot_product_attention(q, k, v, mask, bias=t5(table, pos, pos))

  def blockwise(q, k, v, table):
    return blockwise_attention(
      q,
      k,
      v,
      q_positions=pos,
      kv_positions=pos,
      q_valid=valid,
      kv_valid=valid,
      causal=c["causal"],
      sliding_window=c["window"],
      global_tokens=c["global_tokens"],
      position_bias=(t5, table),
      block_size=4,
    )

  @jax.jit
  def outputs_and_grads(q, k, v, table):
    results = []
    for fn in (dense, blockwise):
      out, vjp = jax.vjp(fn, q, k, v, table)
      results.append((out, *vjp(d_out)))
    return results

  reference, ours = outputs_and_grads(q, k, v, table)
  for name, x_b, x_d in zip(("out", "dq", "dk", "dv", "dtable"), ours, reference):
    assert np.abs(np.asarray(x_d)).max() > 1e-2, name
    np.testing.assert_allclose(np.asarray(x_b), np.asarray(x_d), atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize(
  "options",
  sweep(
    [
      dict(position="t5", relative_buckets=6, relative_max_distance=8, sliding_window=3, global_tokens=2),
      dict(
        position="rope", rope_scaling="yarn", rope_scaling_factor=4.0, attention="blockwise", attention_block_size=4
      ),
    ],
    {"t5-global"},
    ids=["t5-global", "yarn"],
  ),
)
def test_decoder_only_cached_decoding_equals_full_forward(options):
  """The decoder-only model (its stack's shared T5 table, or YaRN-scaled RoPE): a prefill of 5
  tokens, then one token per step, gives the full forward's logits; the first 5 are causal."""
  config = config_from_dict(
    {
      "model": dict(
        kind="decoder_only",
        vocab_size=37,
        d_model=16,
        num_heads=4,
        d_ff=24,
        num_decoder_layers=2,
        dropout_rate=0.0,
        max_length=16,
        **options,
      ),
      "data": {"max_length": 16},
    }
  ).model
  model = DecoderOnly(config)
  tokens = jnp.asarray(np.random.default_rng(6).integers(4, 37, (B, 9)), jnp.int32)
  params = _random_params(model, 7, tokens)["params"]

  @jax.jit
  def run(params, tokens):
    full = model.apply({"params": params}, tokens)
    first, cache = kv.prefill(model, params, kv.contiguous_cache(model, params, B, 5), tokens[:, :5])
    steps = []
    for i in range(5, 9):
      logits, cache = kv.step(model, params, cache, tokens[:, i])
      steps.append(logits)
    return full, jnp.stack([first, *steps], axis=1), model.apply({"params": params}, tokens[:, :5])

  full, cached, prefix = map(np.asarray, run(params, tokens))
  np.testing.assert_allclose(cached, full[:, 4:], atol=1e-4, rtol=1e-5)  # a wrong slot or mask moves them by > 1e-2
  np.testing.assert_allclose(prefix, full[:, :5], atol=2e-5, rtol=1e-5)
  assert np.abs(full[:, 4:]).std() > 0.1


# --- RoPE scaling ------------------------------------------------------------------------------


def test_rope_scaling_frequencies():
  theta, mscale = rope_frequencies(16)
  np.testing.assert_allclose(theta, 10000.0 ** (-np.arange(8) / 8), rtol=1e-6)
  assert mscale == 1.0
  linear, _ = rope_frequencies(16, RopeScaling("linear", 4.0))
  np.testing.assert_allclose(linear, theta / 4, rtol=1e-6)
  # NTK-aware: the highest frequency is kept and the lowest divided by exactly the factor.
  ntk, _ = rope_frequencies(16, RopeScaling("ntk", 4.0))
  np.testing.assert_allclose([ntk[0], ntk[-1]], [theta[0], theta[-1] / 4], rtol=1e-5)
  assert (np.diff(ntk / theta) < 0).all()
  # YaRN over a 1024-token context: frequencies turning more than 32 times are kept, less than once interpolated.
  yarn, mscale = rope_frequencies(16, RopeScaling("yarn", 4.0, 1024))
  turns = 1024 * theta / (2 * np.pi)
  np.testing.assert_allclose(yarn[turns > 32], theta[turns > 32], rtol=1e-6)
  np.testing.assert_allclose(yarn[turns < 1], theta[turns < 1] / 4, rtol=1e-6)
  assert (turns > 32).any() and (turns < 1).any() and mscale == pytest.approx(0.1 * math.log(4) + 1)
  # Linear interpolation of position 2p is position p unscaled.
  x = _normal(3, (B, T, N, 16))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  np.testing.assert_allclose(
    np.asarray(apply_rope(x, 2 * pos, scaling=RopeScaling("linear", 2.0))), np.asarray(apply_rope(x, pos)), atol=1e-5
  )


def test_dynamic_rope_base_is_per_row():
  # Base b * (s L'/L - (s - 1))^(H/(H-2)) from each row's own length L' (trained L = 8, factor s = 2).
  scaling = RopeScaling("dynamic", 2.0, 8)
  pos = jnp.asarray([np.arange(12), np.minimum(np.arange(12), 5)])  # L' = 12 and 6
  base = np.asarray(dynamic_base(scaling, 16, pos))
  np.testing.assert_allclose(base, [10000.0 * (2 * 12 / 8 - 1) ** (16 / 14), 10000.0], rtol=1e-5)
  x = _normal(4, (2, 12, N, 16))
  both = np.asarray(apply_rope(x, pos, scaling))
  for r in range(2):  # a row alone gives the same rotation as beside the other
    np.testing.assert_allclose(both[r], np.asarray(apply_rope(x[r : r + 1], pos[r : r + 1], scaling))[0], atol=1e-6)


# --- global tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_global_tokens_mask_matches_a_hand_built_one(causal):
  length, window, g = 7, 2, 2
  want = np.zeros((length, length), bool)
  for i in range(length):
    for j in range(length):
      want[i, j] = (abs(i - j) < window or i < g or j < g) and (j <= i or not causal)
  pos = jnp.arange(length)[None]
  np.testing.assert_array_equal(np.asarray(position_mask(pos, pos, causal, window, g))[0], want)
  # Per-row positions (packed segments restart at 0): global is by position, not by index.
  seg_pos = jnp.asarray([[0, 1, 2, 0, 1, 2, 3]])
  got = np.asarray(position_mask(seg_pos, seg_pos, causal, 1, 1))[0]
  assert got[5, 3] and got[3, 6] != causal and not got[5, 1]  # position 0 of row index 3 is global


# --- Linformer -----------------------------------------------------------------------------------

LIN = dict(
  vocab_size=37,
  d_model=16,
  num_heads=4,
  d_ff=24,
  num_encoder_layers=1,
  dropout_rate=0.0,
  max_length=16,
  attention="linformer",
  linformer_k=5,
  kind="encoder_only",
  position="learned",
)


@pytest.fixture(scope="module")
def linformer_model():
  config = config_from_dict({"model": LIN, "data": {"max_length": 16}}).model
  model = EncoderOnly(config)
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, 37, (B, 11)), jnp.int32)
  return model, _random_params(model, 4, tokens), tokens


def test_linformer_shapes_and_padding(linformer_model):
  model, params, tokens = linformer_model
  p = params["params"]["layer_0"]["self_attention"]
  assert p["key_projection"].shape == p["value_projection"].shape == (16, 5)
  logits = np.asarray(model.apply(params, tokens))
  assert logits.shape == (B, 11, 37) and np.isfinite(logits).all()
  # Appending padding changes nothing at the real positions; changing a token changes them all.
  padded = np.asarray(model.apply(params, jnp.pad(tokens, ((0, 0), (0, 5)), constant_values=PAD_ID)))
  np.testing.assert_allclose(padded[:, :11], logits, atol=1e-5)
  changed = np.asarray(model.apply(params, tokens.at[:, 10].set(4 + (tokens[:, 10] - 3) % 33)))
  assert np.abs(changed[:, 0] - logits[:, 0]).max() > 1e-3  # non-causal: the first position sees the last


def test_linformer_errors():
  x = _normal(5, (1, 6, 16))
  for kw in (dict(causal=True), dict(decode=True)):
    attn = MultiHeadAttention(
      num_heads=2, head_dim=8, implementation="linformer", max_length=8, causal=kw.get("causal", False)
    )
    with pytest.raises(ConfigError, match="linformer is for non-causal self-attention without a KV cache"):
      attn.init(jax.random.key(0), x, None, deterministic=True, decode=kw.get("decode", False))
  with pytest.raises(ConfigError, match="linformer is non-causal"):
    config_from_dict({"model": dict(LIN, kind="decoder_only")})
  with pytest.raises(ConfigError, match="cannot keep packed examples apart; set data.packing=false"):
    config_from_dict({"model": LIN, "data": {"max_length": 16, "packing": True}})


def _temp_bytes(attention: MultiHeadAttention, length: int) -> int:
  """XLA's temporary buffer size for the input gradient of `attention` at `length` tokens (compile only)."""
  x = jax.ShapeDtypeStruct((1, length, 16), jnp.float32)
  params = jax.eval_shape(
    lambda: attention.init(jax.random.key(0), jnp.zeros((1, length, 16)), None, deterministic=True)
  )
  grad = jax.jit(jax.grad(lambda p, x: attention.apply(p, x, None, deterministic=True).sum(), argnums=1))
  return grad.lower(params, x).compile().memory_analysis().temp_size_in_bytes


def test_linformer_gradient_memory_grows_linearly():
  linformer = MultiHeadAttention(num_heads=2, head_dim=8, implementation="linformer", linformer_k=64, max_length=8192)
  temps = [_temp_bytes(linformer, n) for n in (1024, 2048, 4096, 8192)]
  for small, large in zip(temps, temps[1:]):
    assert large / small < 2.2, temps
  dense_1k, dense_2k = (_temp_bytes(dataclasses.replace(linformer, implementation="dense"), n) for n in (1024, 2048))
  assert dense_2k / dense_1k > 2.2 and dense_2k > 4 * temps[1], (dense_1k, dense_2k, temps)  # dense: [T, T] scores


# --- config errors and the sharded mesh -----------------------------------------------------------


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["model.rope_scaling=yarn"], "model.rope_scaling=yarn rescales RoPE frequencies; it needs model.position=rope"),
    (
      ["model.position=rope", "model.rope_scaling=linear", "model.rope_scaling_factor=0.5"],
      "model.rope_scaling_factor must be a finite number >= 1",
    ),
    (["model.global_tokens=2"], "model.global_tokens=2 acts on top of a sliding window"),
    (["model.relative_buckets=7"], "model.relative_buckets must be an even number >= 4"),
    (["model.attention=linformer", "model.position=t5"], "model.position=t5 biases scores by token distance"),
  ],
)
def test_option_errors_are_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message):
    config_from_dict({}, overrides)


SHARDED_OPTIONS = {
  "t5-blockwise-global": (
    "model.position=t5",
    "model.relative_buckets=8",
    "model.relative_max_distance=16",
    "model.attention=blockwise",
    "model.attention_block_size=4",
    "model.sliding_window=3",
    "model.global_tokens=2",
  ),
  "yarn-linformer": (
    "model.position=rope",
    "model.rope_scaling=yarn",
    "model.rope_scaling_factor=4",
    "model.attention=linformer",
    "model.linformer_k=8",
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("options", SHARDED_OPTIONS, ids=list(SHARDED_OPTIONS))
def test_options_train_the_same_on_a_tensor2_mesh(options):
  overrides = SHARDED_OPTIONS[options]
  ref_losses, ref_state = _run((1, 1, 1), 0.0, overrides=overrides)
  losses, state = _run((1, 1, 2), 0.0, overrides=overrides)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert all(np.isfinite(ref_losses))
  for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(ref_state.params))):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
