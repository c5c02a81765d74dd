"""A decode loop that grows its KV cache in phases (`search.decode_loop` with `cache_fill`,
`cache.growth_phases`, `cache.resize`) gives the same tokens as one loop over the full cache,
for greedy, beam and sampling, on an encoder-decoder and a decoder-only model (scanned layers:
the batch on axis 1), with rows that stop early."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import ModelConfig
from jaxformer.inference import cache as kv
from jaxformer.inference.decode import SearchOptions, cache_batch_axis, cache_fill, decode_with, start
from jaxformer.inference.search import EOS_ID, beam_search_core, greedy_core, sample_core, source_row_keys
from jaxformer.layers.kv_cache import join_segments, split_segments
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.models.transformer import PAD_ID, EncoderDecoder

V, OUT = 29, 36   # a small vocabulary, so EOS (1 in 29) stops some rows early


def test_growth_phases_halve_down_to_the_fill_and_the_minimum():
  assert kv.MIN_PHASE == 8
  assert kv.growth_phases(32, 1) == (8, 16, 32)
  assert kv.growth_phases(70, 1) == (9, 18, 35, 70)   # halves round up
  assert kv.growth_phases(70, 20) == (35, 70)         # 18 would not hold the 20 cached tokens
  assert kv.growth_phases(30, 1) == (8, 15, 30)
  assert kv.growth_phases(15, 1) == (8, 15)
  assert kv.growth_phases(14, 1) == (14,)             # no phase below 8 tokens


@pytest.mark.parametrize("batch_axis", [0, 1])
def test_resize_moves_every_beam_slot_and_keeps_cross_attention(batch_axis):
  """Grouped beam storage `[.., sentences, heads, beams * capacity, head_dim]`: growing puts
  slot m's position p at m * new + p with zeros after it; cutting back restores the cache."""
  sentences, heads, beams, capacity, h = 2, 3, 4, 5, 2
  lead = (7,) if batch_axis else ()
  rng = np.random.default_rng(0)
  self_kv = jnp.asarray(rng.standard_normal(lead + (sentences, heads, beams * capacity, h)), jnp.float32)
  cross = jnp.asarray(rng.standard_normal(lead + (sentences, heads, 6, h)), jnp.float32)
  origin = jnp.asarray(rng.integers(0, beams, (sentences * beams, capacity)), jnp.int32)
  state = kv.CacheState(lengths=jnp.full((sentences * beams,), 3, jnp.int32), beam_origin=origin,
                        capacity=capacity, beam_size=beams)
  axis = batch_axis + 2
  cache = kv.KVCache({"self_attention": {"key": split_segments(self_kv, beams, axis)},
                      "cross_attention": {"key": (cross,)}}, state)

  grown = kv.resize(cache, 16, batch_axis)   # one segment -> two (0-7, 8-15)
  assert grown.state.capacity == 16
  assert [x.shape[axis] for x in grown.layers["self_attention"]["key"]] == [beams * 8, beams * 8]
  got = np.asarray(join_segments(grown.layers["self_attention"]["key"], beams, axis))
  old = np.asarray(self_kv)
  for m in range(beams):
    np.testing.assert_array_equal(got[..., m * 16:m * 16 + capacity, :], old[..., m * capacity:(m + 1) * capacity, :])
    assert not got[..., m * 16 + capacity:(m + 1) * 16, :].any()
  np.testing.assert_array_equal(grown.layers["cross_attention"]["key"][0], cross)
  np.testing.assert_array_equal(np.asarray(grown.state.beam_origin)[:, :capacity], origin)
  assert not np.asarray(grown.state.beam_origin)[:, capacity:].any()

  back = kv.resize(grown, capacity, batch_axis)
  np.testing.assert_array_equal(join_segments(back.layers["self_attention"]["key"], beams, axis), self_kv)
  np.testing.assert_array_equal(back.state.beam_origin, origin)
  with pytest.raises(ValueError, match="contiguous"):
    kv.resize(kv.KVCache({}, kv.CacheState(lengths=state.lengths, page_table=jnp.zeros((8, 2), jnp.int32))), 4)


def _model(kind):
  if kind == "encoder-decoder":
    cfg = ModelConfig(vocab_size=V, d_model=16, num_heads=4, d_ff=24, num_encoder_layers=1, num_decoder_layers=2,
                      dropout_rate=0.0, max_length=48)
    model, inputs = EncoderDecoder(cfg), np.random.default_rng(1).integers(4, V, (3, 7))
    inputs[1, 4:] = PAD_ID
  else:
    cfg = ModelConfig(vocab_size=V, d_model=16, num_heads=4, num_kv_heads=2, d_ff=24, num_encoder_layers=0,
                      num_decoder_layers=2, dropout_rate=0.0, max_length=48, position="rope", scan_layers=True)
    model, inputs = DecoderOnly(cfg), np.random.default_rng(1).integers(4, V, (3, 5))
    inputs[:, 0] = 1                                                     # BOS
    inputs[2, 3:] = PAD_ID
  inputs = jnp.asarray(inputs, jnp.int32)
  params = jax.jit(lambda key: model.init(key, *((inputs, inputs) if kind == "encoder-decoder" else (inputs,)))
                   ["params"])(jax.random.key(0))
  return model, params, inputs


def _decode(model, params, inputs, strategy, fill):
  """Tokens (and beam scores) with EOS forced as token 20 of row 0 and token 8 of row 1 (stops
  in different phases); row 2 runs to the end unless the model ends it."""
  stop_at = jnp.asarray([20, 8, -1])

  def run(params, inputs):
    logits, cache, model_step = start(model, params, inputs, OUT)

    def step(tokens, cache, i):
      logits, cache = model_step(tokens, cache, i)
      rows_stop = jnp.repeat(stop_at, tokens.shape[0] // stop_at.shape[0])
      force = (jnp.arange(V) == EOS_ID)[None] & (rows_stop == i)[:, None]
      return jnp.where(force, 50.0, logits), cache
    opts = dict(max_decode_len=OUT, cache_batch_axis=cache_batch_axis(model), cache_fill=fill)
    if strategy == "greedy":
      return greedy_core(step, logits, cache, **opts)
    if strategy == "beam":
      return beam_search_core(step, logits, cache, beam_size=3, **opts)
    return sample_core(step, logits, cache, source_row_keys(jax.random.key(5), inputs), temperature=1.5, **opts)
  return jax.tree.map(np.asarray, jax.jit(run)(params, inputs))


@pytest.mark.slow   # test_grow_cache_option_reaches_the_decode_loop is the fast end-to-end check
@pytest.mark.parametrize("kind, strategy", [
    ("encoder-decoder", "beam"),
    ("encoder-decoder", "greedy"),
    ("decoder-only", "beam"),
    ("decoder-only", "greedy"),
    ("decoder-only", "sample"),
])
def test_growing_cache_gives_the_tokens_of_the_full_cache(kind, strategy):
  model, params, inputs = _model(kind)
  fill = cache_fill(model, inputs)
  capacity = OUT + (0 if model.ENCODES_SOURCE else inputs.shape[1])
  assert len(kv.growth_phases(capacity, fill)) == 3                     # the case really grows
  want = _decode(model, params, inputs, strategy, 0)
  got = _decode(model, params, inputs, strategy, fill)
  tokens = got[0] if strategy == "beam" else got
  np.testing.assert_array_equal(tokens, want[0] if strategy == "beam" else want)
  if strategy == "beam":   # scores: the same up to float rounding (a shorter masked sum)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
  assert (tokens[:2] == EOS_ID).any(axis=1).all() and not (tokens[2] == PAD_ID).any()
  assert (tokens[1, 9:] == PAD_ID).all()


def test_grow_cache_option_reaches_the_decode_loop():
  """`SearchOptions(grow_cache=True)` (the `--grow-cache` flag) decodes with more than one
  phase, counted as while loops in the compiled decode, and gives the same tokens."""
  model, params, inputs = _model("encoder-decoder")

  def lowered(grow):
    options = SearchOptions(beam_size=2, grow_cache=grow, extra_tokens=OUT - inputs.shape[1])
    fn = jax.jit(lambda p, x: decode_with(model, p, x, OUT, options))
    return fn, fn.lower(params, inputs).as_text()
  (plain, plain_text), (grown, grown_text) = lowered(False), lowered(True)
  assert grown_text.count("stablehlo.while") > plain_text.count("stablehlo.while")
  np.testing.assert_array_equal(grown(params, inputs), plain(params, inputs))
