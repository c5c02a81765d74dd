"""Tests of jaxformer.models: the encoder-decoder Transformer."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxformer.config import ModelConfig
from jaxformer.models.transformer import BOS_ID, PAD_ID, EncoderDecoder, shift_right

VOCAB = 37
SRC_LEN, TGT_LEN = 11, 9


def _config(**kw):
  base = dict(
    vocab_size=VOCAB,
    d_model=16,
    num_heads=2,
    d_ff=24,
    num_encoder_layers=2,
    num_decoder_layers=2,
    dropout_rate=0.0,
    max_length=32,
  )
  base.update(kw)
  return ModelConfig(**base)


def _batch(seed=0, batch=3):
  rng = np.random.default_rng(seed)
  src = rng.integers(4, VOCAB, (batch, SRC_LEN))
  tgt = rng.integers(4, VOCAB, (batch, TGT_LEN))
  src_len = np.array([SRC_LEN, 6, 3])[:batch]
  tgt_len = np.array([TGT_LEN, 5, 7])[:batch]
  src[np.arange(SRC_LEN)[None] >= src_len[:, None]] = PAD_ID
  tgt[np.arange(TGT_LEN)[None] >= tgt_len[:, None]] = PAD_ID
  return jnp.asarray(src, jnp.int32), jnp.asarray(tgt, jnp.int32)


def _random_params(model, src, tgt, seed=0, scale=0.3):
  """Random float32 params with the model's structure (from eval_shape: no init compile):
  N(0, scale^2) everywhere, LayerNorm scales 1 + N(0, scale^2), so biases and norms are
  non-trivial and logits non-degenerate."""
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: model.init(k, src, tgt), jax.random.key(0)))["params"]
  rng = np.random.default_rng(seed)

  def fill(path, s):
    x = scale * rng.standard_normal(s.shape)
    if jax.tree_util.keystr(path).endswith("['scale']"):
      x = x + 1.0
    return jnp.asarray(x, jnp.float32)

  return jax.tree_util.tree_map_with_path(fill, shapes)


@pytest.fixture(scope="module")
def model_and_params():
  model = EncoderDecoder(_config())
  src, tgt = _batch()
  return model, _random_params(model, src, tgt)


@pytest.fixture(scope="module")
def jitted(model_and_params):
  model, params = model_and_params
  forward = jax.jit(lambda p, s, t: model.apply({"params": p}, s, t))
  encode = jax.jit(lambda p, s: model.apply({"params": p}, s, method="encode"))
  decode = jax.jit(lambda p, e, s, d: model.apply({"params": p}, e, s, d, method="decode"))
  return forward, encode, decode


def test_shift_right():
  targets = jnp.array([[5, 6, 7, 3], [8, 3, 0, 0]])
  np.testing.assert_array_equal(np.asarray(shift_right(targets)), [[BOS_ID, 5, 6, 7], [BOS_ID, 8, 0, 0]])


def test_forward_shape_and_finite(model_and_params, jitted):
  _, params = model_and_params
  forward, _, _ = jitted
  src, tgt = _batch()
  logits = forward(params, src, tgt)
  assert logits.shape == (3, TGT_LEN, VOCAB) and logits.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(logits)))
  assert np.asarray(logits).std() > 0.1


@pytest.mark.parametrize("i", [0, 3, 6])
def test_decoder_is_causal(model_and_params, jitted, i):
  _, params = model_and_params
  _, encode, decode = jitted
  src, _ = _batch()
  rng = np.random.default_rng(10 + i)
  dec_in = rng.integers(4, VOCAB, (3, TGT_LEN))
  dec_in[:, 0] = BOS_ID
  changed = dec_in.copy()
  later = dec_in[:, i + 1 :]
  changed[:, i + 1 :] = (later - 4 + rng.integers(1, VOCAB - 4, later.shape)) % (VOCAB - 4) + 4  # != later
  assert np.all(changed[:, i + 1 :] != dec_in[:, i + 1 :])
  enc = encode(params, src)
  a = np.asarray(decode(params, enc, src, jnp.asarray(dec_in, jnp.int32)))
  b = np.asarray(decode(params, enc, src, jnp.asarray(changed, jnp.int32)))
  np.testing.assert_allclose(a[:, : i + 1], b[:, : i + 1], atol=1e-5, rtol=1e-5)
  assert np.abs(a[:, i + 1 :] - b[:, i + 1 :]).max() > 1e-3


def test_teacher_forcing_is_causal(model_and_params, jitted):
  """__call__ shifts targets right: changing targets after position i changes decoder inputs
  after i + 1, so logits at positions <= i + 1 stay the same (the logit at i + 1 predicts
  target i + 1 from targets <= i)."""
  _, params = model_and_params
  forward, _, _ = jitted
  src, _ = _batch()
  rng = np.random.default_rng(3)
  tgt = rng.integers(4, VOCAB, (3, TGT_LEN))
  i = 4
  changed = tgt.copy()
  changed[:, i + 1 :] = np.where(tgt[:, i + 1 :] == 4, 5, 4)
  a = np.asarray(forward(params, src, jnp.asarray(tgt, jnp.int32)))
  b = np.asarray(forward(params, src, jnp.asarray(changed, jnp.int32)))
  np.testing.assert_allclose(a[:, : i + 2], b[:, : i + 2], atol=1e-5, rtol=1e-5)
  assert np.abs(a[:, i + 2 :] - b[:, i + 2 :]).max() > 1e-3


def test_source_padding_invariance(model_and_params, jitted):
  _, params = model_and_params
  forward, _, _ = jitted
  src, tgt = _batch()
  logits = np.asarray(forward(params, src, tgt))
  # Compared at real target positions: a padded target position's query sees no valid key
  # (fully masked row -> uniform weights over all source positions), and its logits are
  # ignored by the loss.
  valid = np.asarray(tgt) != PAD_ID
  for extra in (1, 5):
    padded = jnp.pad(src, ((0, 0), (0, extra)), constant_values=PAD_ID)
    np.testing.assert_allclose(np.asarray(forward(params, padded, tgt))[valid], logits[valid], atol=1e-5, rtol=1e-5)
  # Sanity: the source matters (a real token change moves the logits).
  other = src.at[0, 0].set(jnp.where(src[0, 0] == 4, 5, 4))
  assert not np.allclose(np.asarray(forward(params, other, tgt))[0], logits[0], atol=1e-3)


def test_target_padding_does_not_change_real_positions(model_and_params, jitted):
  _, params = model_and_params
  forward, _, _ = jitted
  src, tgt = _batch()
  logits = np.asarray(forward(params, src, tgt))
  padded = np.asarray(forward(params, src, jnp.pad(tgt, ((0, 0), (0, 4)))))
  valid = np.asarray(tgt) != PAD_ID
  np.testing.assert_allclose(padded[:, :TGT_LEN][valid], logits[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("share", [True, False])
def test_param_logical_axes(share):
  model = EncoderDecoder(_config(tie_embeddings=share, pre_norm=not share))
  src, tgt = _batch()
  boxed = jax.eval_shape(lambda k: model.init(k, src, tgt), jax.random.key(0))["params"]
  specs = nn.get_partition_spec(boxed)
  shapes = nn.meta.unbox(boxed)
  flat_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
  flat_shapes = dict(jax.tree_util.tree_flatten_with_path(shapes)[0])
  assert len(flat_specs) == len(flat_shapes) > 20
  known = {"vocab", "embed", "heads", "kv", "mlp"}
  for path, spec in flat_specs:
    assert isinstance(spec, PartitionSpec), path
    shape = flat_shapes[path].shape
    assert len(spec) == len(shape), (path, spec, shape)
    assert all(isinstance(name, str) and name in known for name in spec), (path, spec)
  names = {jax.tree_util.keystr(p) for p, _ in flat_specs}
  if share:
    assert any("'embed'" in n for n in names)
  else:
    assert any("source_embed" in n for n in names) and any("target_embed" in n for n in names)
    assert any("output_proj" in n for n in names)


def test_unshared_embeddings_and_pre_norm(model_and_params, jitted):
  src, tgt = _batch()
  model = EncoderDecoder(_config(tie_embeddings=False))
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: model.init(k, src, tgt), jax.random.key(0)))["params"]
  assert {"source_embed", "target_embed", "output_proj"} <= set(shapes)
  assert "embed" not in shapes
  assert shapes["output_proj"].shape == (16, VOCAB)
  assert shapes["source_embed"]["embedding"].shape == (VOCAB, 16)
  assert shapes["target_embed"]["embedding"].shape == (VOCAB, 16)
  params = _random_params(model, src, tgt, seed=5)
  apply = jax.jit(lambda p: model.apply({"params": p}, src, tgt))
  logits = np.asarray(apply(params))
  assert logits.shape == (3, TGT_LEN, VOCAB) and np.all(np.isfinite(logits))
  assert logits.std() > 0.1
  # The logits use output_proj, not the target embedding: zeroing output_proj zeroes them.
  zeroed = dict(params, output_proj=jnp.zeros_like(params["output_proj"]))
  np.testing.assert_array_equal(np.asarray(apply(zeroed)), 0.0)
  # The target table feeds the decoder: changing it moves the logits.
  moved = dict(params, target_embed={"embedding": params["target_embed"]["embedding"] + 1.0})
  assert np.abs(np.asarray(apply(moved)) - logits).max() > 1e-3

  # pre-norm adds final norms; with otherwise identical params it gives different logits.
  _, post_params = model_and_params
  forward, _, _ = jitted
  pre_model = EncoderDecoder(_config(pre_norm=True))
  pre_shapes = nn.meta.unbox(jax.eval_shape(lambda k: pre_model.init(k, src, tgt), jax.random.key(0)))["params"]
  assert set(pre_shapes) - set(post_params) == {"encoder_norm", "decoder_norm"}
  pre_params = dict(
    post_params,
    encoder_norm={"scale": jnp.ones(16), "bias": jnp.zeros(16)},
    decoder_norm={"scale": jnp.ones(16), "bias": jnp.zeros(16)},
  )
  assert jax.tree.structure(pre_params) == jax.tree.structure(pre_shapes)
  post = np.asarray(forward(post_params, src, tgt))
  pre = np.asarray(jax.jit(lambda p: pre_model.apply({"params": p}, src, tgt))(pre_params))
  assert pre.shape == post.shape and np.all(np.isfinite(pre))
  assert np.abs(pre - post).max() > 1e-2


def test_dropout_is_active_only_when_not_deterministic():
  model = EncoderDecoder(_config(dropout_rate=0.3, num_encoder_layers=1, num_decoder_layers=1))
  src, tgt = _batch()
  params = _random_params(model, src, tgt, seed=6)
  det = jax.jit(lambda p: model.apply({"params": p}, src, tgt))
  rand = jax.jit(lambda p, k: model.apply({"params": p}, src, tgt, deterministic=False, rngs={"dropout": k}))
  d1, d2 = np.asarray(det(params)), np.asarray(det(params))
  np.testing.assert_array_equal(d1, d2)
  r1 = np.asarray(rand(params, jax.random.key(1)))
  r1b = np.asarray(rand(params, jax.random.key(1)))
  r2 = np.asarray(rand(params, jax.random.key(2)))
  np.testing.assert_array_equal(r1, r1b)
  assert np.abs(r1 - d1).max() > 1e-3 and np.abs(r1 - r2).max() > 1e-3
