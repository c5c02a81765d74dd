"""Sequence packing in the models: with segment ids and per-segment positions, every example
of a packed row gets the logits it gets alone in its own (padded) row, for each model kind,
position scheme and attention implementation, scanned or rematerialised stacks included."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep

from jaxformer.config import config_from_dict
from jaxformer.inference import cache as kv
from jaxformer.layers.blockwise import blockwise_attention
from jaxformer.layers.dot_product import dot_product_attention
from jaxformer.layers.scores import attention_mask
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.models.encoder_only import EncoderOnly
from jaxformer.models.transformer import BOS_ID, PAD_ID, EncoderDecoder, segment_positions, shift_right

VOCAB, LENGTH, TOL = 37, 13, 1e-5
BASE = dict(
  vocab_size=VOCAB,
  d_model=16,
  num_heads=2,
  d_ff=24,
  num_encoder_layers=2,
  num_decoder_layers=2,
  dropout_rate=0.0,
  attention_block_size=4,
)  # max_length: the default (covers data.max_length)
MODELS = {"encoder_decoder": EncoderDecoder, "decoder_only": DecoderOnly, "encoder_only": EncoderOnly}
# Each kind with every position scheme; each scheme with dense and blockwise attention.
CASES = {
  "ed-sinusoidal-dense": ("encoder_decoder", dict()),
  "ed-learned-blockwise-remat": ("encoder_decoder", dict(position="learned", attention="blockwise", remat="full")),
  "ed-rope-dense-scan": ("encoder_decoder", dict(position="rope", scan_layers=True, num_kv_heads=1)),
  "ed-alibi-blockwise-scan-remat": (
    "encoder_decoder",
    dict(position="alibi", attention="blockwise", scan_layers=True, remat="minimal", pre_norm=True),
  ),
  "do-sinusoidal-blockwise": ("decoder_only", dict(attention="blockwise", tie_embeddings=False)),
  "do-learned-dense-scan": ("decoder_only", dict(position="learned", scan_layers=True)),
  "do-rope-blockwise-window-remat": (
    "decoder_only",
    dict(position="rope", attention="blockwise", sliding_window=3, remat="save_dots"),
  ),
  "do-alibi-dense-window": ("decoder_only", dict(position="alibi", sliding_window=2, attn_logit_softcap=3.0)),
  "eo-sinusoidal-dense-remat": ("encoder_only", dict(remat="full", norm="rmsnorm")),
  "eo-learned-blockwise": ("encoder_only", dict(position="learned", attention="blockwise")),
  "eo-rope-blockwise-scan": ("encoder_only", dict(position="rope", attention="blockwise", scan_layers=True)),
  "eo-alibi-dense": ("encoder_only", dict(position="alibi", ffn="swiglu")),
}
# Rows of packed example lengths (the rest of a row is padding): 3 + 1 pad, and a full row.
SRC_ROWS, TGT_ROWS = ((5, 3, 4), (7, 6)), ((4, 6, 2), (8, 5))


def _config(kind, **options):
  config = dataclasses.replace(config_from_dict({"model": {**BASE, **options}}).model, kind=kind)
  config.validate()
  return config


def _random_params(model, *args, seed=0, scale=0.3, **kwargs):
  """N(0, scale^2) params (norm scales 1 + noise) with the model's structure, from eval_shape."""
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: model.init(k, *args, **kwargs), jax.random.key(0)))["params"]
  rng = np.random.default_rng(seed)

  def fill(path, s):
    x = scale * rng.standard_normal(s.shape) + jax.tree_util.keystr(path).endswith("['scale']")
    return jnp.asarray(x, jnp.float32)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def _pack(rows, seed):
  """Random examples (ids >= 4) of the given lengths, packed and alone.

  Returns:
    packed: (tokens, segment_ids, positions), int32 `[len(rows), LENGTH]` each, built by hand.
    alone: int32 `[num_examples, LENGTH]`, each example in its own row, padded.
    where: (packed row, start, length) of each example.
  """
  rng = np.random.default_rng(seed)
  tokens, segments, positions = (np.zeros((len(rows), LENGTH), np.int32) for _ in range(3))
  alone, where = [], []
  for r, lengths in enumerate(rows):
    start = 0
    for s, n in enumerate(lengths):
      example = rng.integers(4, VOCAB, n)
      tokens[r, start : start + n], segments[r, start : start + n] = example, s + 1
      positions[r, start : start + n] = np.arange(n)
      alone.append(np.pad(example, (0, LENGTH - n)))
      where.append((r, start, n))
      start += n
  return tuple(map(jnp.asarray, (tokens, segments, positions))), jnp.asarray(np.stack(alone), jnp.int32), where


def _assert_examples_match(packed, alone, where):
  """Each example's logits in its packed row equal its logits alone, at every real position."""
  packed, alone = np.asarray(packed), np.asarray(alone)
  assert np.isfinite(packed).all()
  for i, (r, start, n) in enumerate(where):
    np.testing.assert_allclose(packed[r, start : start + n], alone[i, :n], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("case", sweep(CASES, {"do-learned-dense-scan", "eo-sinusoidal-dense-remat"}))
def test_packed_examples_equal_unpacked(case):
  kind, options = CASES[case]
  model = MODELS[kind](_config(kind, **options))
  (tokens, segments, positions), alone, where = _pack(TGT_ROWS, seed=1)
  if kind == "encoder_decoder":
    (src, src_seg, src_pos), src_alone, _ = _pack(SRC_ROWS, seed=2)
    params = _random_params(model, src, tokens)

    @jax.jit
    def run(params):
      packed = model.apply(
        {"params": params},
        src,
        tokens,
        inputs_segment_ids=src_seg,
        inputs_positions=src_pos,
        targets_segment_ids=segments,
        targets_positions=positions,
      )
      return packed, model.apply({"params": params}, src_alone, alone), model.apply({"params": params}, src, tokens)
  else:
    params = _random_params(model, tokens)

    @jax.jit
    def run(params):
      packed = model.apply({"params": params}, tokens, segment_ids=segments, positions=positions)
      return packed, model.apply({"params": params}, alone), model.apply({"params": params}, tokens)

  packed, unpacked, leaky = run(params)
  _assert_examples_match(packed, unpacked, where)
  # Without segment ids the examples would see each other: the packing is what isolates them.
  r, start, n = where[1]
  assert np.abs(np.asarray(leaky)[r, start : start + n] - np.asarray(unpacked)[1, :n]).max() > 1e-3


@pytest.mark.slow
def test_encoder_decoder_gradients_of_packed_batch_equal_unpacked():
  """The packed loss (a sum over tokens) has the unpacked batch's gradient, through remat and
  the blockwise attention's custom VJP."""
  model = EncoderDecoder(_config("encoder_decoder", position="rope", attention="blockwise", remat="full"))
  (tokens, segments, positions), alone, _ = _pack(TGT_ROWS, seed=3)
  (src, src_seg, src_pos), src_alone, _ = _pack(SRC_ROWS, seed=4)
  params = _random_params(model, src, tokens, seed=5)

  def loss(params, src, tgt, **packing):
    logits = model.apply({"params": params}, src, tgt, **packing)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(tgt != PAD_ID, nll, 0.0))

  grad = jax.jit(jax.value_and_grad(loss))
  packed_loss, packed = grad(
    params,
    src,
    tokens,
    inputs_segment_ids=src_seg,
    inputs_positions=src_pos,
    targets_segment_ids=segments,
    targets_positions=positions,
  )
  alone_loss, unpacked = grad(params, src_alone, alone)
  np.testing.assert_allclose(float(packed_loss), float(alone_loss), rtol=TOL)
  for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(unpacked)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=1e-4)


def test_blockwise_attention_with_segments_matches_dense_values_and_gradients():
  b, t, n, h = 2, 11, 2, 4
  q, k, v = (jax.random.normal(jax.random.key(i), (b, t, n, h)) for i in range(3))
  seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0], [1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]], jnp.int32)
  pos = segment_positions(seg)
  valid = seg > 0

  def dense(q, k, v):
    mask = attention_mask(pos, pos, valid, valid, True, 3, seg, seg)
    return dot_product_attention(q, k, v, mask)

  def blockwise(q, k, v):
    return blockwise_attention(
      q,
      k,
      v,
      q_positions=pos,
      kv_positions=pos,
      q_valid=valid,
      kv_valid=valid,
      causal=True,
      sliding_window=3,
      block_size=4,
      q_segment_ids=seg,
      kv_segment_ids=seg,
    )

  def loss(f):
    return jax.jit(jax.value_and_grad(lambda *x: jnp.sum(jnp.sin(f(*x)) * valid[..., None, None]), argnums=(0, 1, 2)))

  (dense_loss, dense_grads), (block_loss, block_grads) = loss(dense)(q, k, v), loss(blockwise)(q, k, v)
  np.testing.assert_allclose(float(block_loss), float(dense_loss), rtol=TOL)
  for a, b_ in zip(block_grads, dense_grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=TOL)
  with pytest.raises(ValueError, match="both"):
    attention_mask(pos, pos, None, None, False, 0, seg, None)


def test_shift_right_per_segment_and_segment_positions():
  targets = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 0], [12, 13, 14, 15, 16, 17, 18, 19]], jnp.int32)
  segments = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 0], [1, 1, 1, 1, 2, 2, 2, 2]], jnp.int32)
  np.testing.assert_array_equal(
    np.asarray(shift_right(targets, segment_ids=segments)),
    [[BOS_ID, 5, 6, BOS_ID, 8, BOS_ID, 10, PAD_ID], [BOS_ID, 12, 13, 14, BOS_ID, 16, 17, 18]],
  )
  # Without segment ids: the plain shift (tokens cross the example boundaries).
  np.testing.assert_array_equal(
    np.asarray(shift_right(targets)), [[BOS_ID, 5, 6, 7, 8, 9, 10, PAD_ID], [BOS_ID, 12, 13, 14, 15, 16, 17, 18]]
  )
  np.testing.assert_array_equal(
    np.asarray(segment_positions(segments)), [[0, 1, 2, 0, 1, 0, 1, 0], [0, 1, 2, 3, 0, 1, 2, 3]]
  )


def test_default_positions_follow_segments():
  """Positions left out are derived from the segment ids."""
  model = DecoderOnly(_config("decoder_only", position="learned"))
  (tokens, segments, positions), _, _ = _pack(TGT_ROWS, seed=6)
  params = {"params": _random_params(model, tokens)}
  np.testing.assert_array_equal(
    np.asarray(model.apply(params, tokens, segment_ids=segments)),
    np.asarray(model.apply(params, tokens, segment_ids=segments, positions=positions)),
  )


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_positions_reach_self_attention(position):
  """RoPE and ALiBi read the given positions, not the token index: a shift of all positions
  changes nothing (both are relative), a stretch changes the logits."""
  model = EncoderOnly(_config("encoder_only", position=position, num_encoder_layers=1))
  tokens = jnp.asarray(np.random.default_rng(8).integers(4, VOCAB, (2, LENGTH)), jnp.int32)
  params = {"params": _random_params(model, tokens)}
  index = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), tokens.shape)
  forward = jax.jit(lambda positions: model.apply(params, tokens, positions=positions))
  base = np.asarray(forward(index))
  np.testing.assert_allclose(np.asarray(forward(index + 7)), base, atol=TOL, rtol=TOL)
  assert np.abs(np.asarray(forward(2 * index)) - base).max() > 1e-3


def test_kv_cache_decoding_matches_full_forward_and_rejects_segments():
  """The cached path (no segment arguments) is unchanged: a chunk of 4 tokens, then
  one-token steps give the full forward's logits; segment ids or positions are refused."""
  model = DecoderOnly(_config("decoder_only", position="rope", attention="blockwise", sliding_window=4))
  tokens = jnp.asarray(np.random.default_rng(7).integers(4, VOCAB, (2, 9)), jnp.int32)
  params = _random_params(model, tokens)
  full = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, tokens)
  extend = jax.jit(lambda cache, x: kv.extend(model, params, cache, x))
  cache = kv.contiguous_cache(model, params, 2, 4)
  logits, cache = extend(cache, tokens[:, :4])
  outputs = [logits]
  for i in range(4, tokens.shape[1]):
    logits, cache = extend(cache, tokens[:, i : i + 1])
    outputs.append(logits)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outputs, axis=1)), np.asarray(full), atol=TOL, rtol=TOL)
  np.testing.assert_array_equal(cache.state.lengths, [9, 9])
  for packing in ({"segment_ids": jnp.ones((2, 1), jnp.int32)}, {"positions": jnp.full((2, 1), 9, jnp.int32)}):
    with pytest.raises(ValueError, match="cache_state"):
      model.apply(
        {"params": params, "cache": cache.layers}, tokens[:, :1], cache_state=cache.state, mutable=["cache"], **packing
      )
