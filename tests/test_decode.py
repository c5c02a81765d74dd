"""Tests of jaxformer.decode: the KV cache and greedy decoding."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import ModelConfig
from jaxformer.decode import greedy_decode, init_cache
from jaxformer.models.transformer import BOS_ID, PAD_ID, EncoderDecoder

VOCAB = 37
SRC_LEN = 11
OUT_LEN = 12        # tokens generated per row; <= CONFIG.max_length (the cache size)
NO_EOS = -1         # an eos_id no token equals: rows never stop early

CONFIG = ModelConfig(vocab_size=VOCAB, d_model=16, num_heads=2, d_ff=24, num_encoder_layers=1,
                     num_decoder_layers=2, dropout_rate=0.0, max_length=16, tie_embeddings=False)
MODEL = EncoderDecoder(CONFIG)


def _sources():
  """Four sources of different lengths (11, 6, 9, 3), PAD padded to SRC_LEN."""
  rng = np.random.default_rng(0)
  src = rng.integers(4, VOCAB, (4, SRC_LEN)).astype(np.int32)
  for row, n in enumerate((11, 6, 9, 3)):
    src[row, n:] = PAD_ID
  return src


@pytest.fixture(scope="module")
def params():
  """Random params (structure from eval_shape, values from numpy: no init compile).

  Random Transformers tend to emit one token forever under greedy search; to get varied
  outputs the embeddings and output projection get N(0, 1) entries (the token and position
  drive the prediction), cross-attention N(0, 0.3^2), and every other leaf N(0, 0.1^2)
  (LayerNorm scales 1 + that), which still moves the logits far more than the tolerances.
  The output columns of PAD, 1, BOS and EOS are zeroed so greedy search does not emit them
  by chance (the EOS tests use a stand-in eos_id)."""
  src = jnp.asarray(_sources())
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: MODEL.init(k, src, src), jax.random.key(0)))["params"]
  rng = np.random.default_rng(1)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    if "embedding" in name or "output_proj" in name:
      std = 1.0
    elif "['cross_attention']" in name:
      std = 0.3   # so that the source visibly steers the output
    else:
      std = 0.1
    x = std * rng.standard_normal(s.shape)
    if name.endswith("['scale']"):
      x = x + 1.0
    if "output_proj" in name:
      x[:, :4] = 0.0
    return jnp.asarray(x, jnp.float32)
  return jax.tree_util.tree_map_with_path(fill, shapes)


@pytest.fixture(scope="module")
def fns():
  encode = jax.jit(lambda p, s: MODEL.apply({"params": p}, s, method="encode"))
  full_decode = jax.jit(lambda p, e, s, d: MODEL.apply({"params": p}, e, s, d, method="decode"))

  @jax.jit
  def prefill(p, cache, encoded, src, bos):
    return MODEL.apply({"params": p, "cache": cache}, encoded, src, bos, decode=True,
                       mutable=["cache"], method="decode")

  @jax.jit
  def step(p, cache, src, token, position):
    positions = jnp.full((src.shape[0], 1), position, jnp.int32)
    return MODEL.apply({"params": p, "cache": cache}, None, src, token, positions=positions,
                       decode=True, mutable=["cache"], method="decode")

  greedy = jax.jit(lambda p, s, eos: greedy_decode(MODEL, p, s, OUT_LEN, eos))
  return dict(encode=encode, full_decode=full_decode, prefill=prefill, step=step, greedy=greedy)


def _naive_greedy(params, fns, src, max_len, eos_id):
  """Greedy search that recomputes the whole prefix without a cache at every step.

  The decoder input buffer has a fixed length (one compile); positions after the current
  one hold PAD, which the causal mask hides from position i anyway."""
  batch = src.shape[0]
  encoded = fns["encode"](params, jnp.asarray(src))
  dec_in = np.full((batch, OUT_LEN), PAD_ID, np.int32)
  dec_in[:, 0] = BOS_ID
  out = np.full((batch, max_len), PAD_ID, np.int32)
  finished = np.zeros(batch, bool)
  for i in range(max_len):
    logits = np.asarray(fns["full_decode"](params, encoded, jnp.asarray(src), jnp.asarray(dec_in)))
    token = np.where(finished, PAD_ID, logits[:, i].argmax(-1))
    out[:, i] = token
    finished |= token == eos_id
    if i + 1 < OUT_LEN:
      dec_in[:, i + 1] = token
  return out


@pytest.fixture(scope="module")
def free_run(params, fns):
  """Greedy outputs of the four sources with no early stop (all OUT_LEN tokens)."""
  return np.asarray(fns["greedy"](params, jnp.asarray(_sources()), NO_EOS))


def test_init_cache_shapes():
  cache = init_cache(MODEL, 3, SRC_LEN)
  layer = cache["decoder_0"]["self_attention"]
  head_dim = CONFIG.d_model // CONFIG.num_heads
  assert layer["cached_key"].shape == (3, CONFIG.max_length, CONFIG.num_heads, head_dim)
  assert layer["cached_value"].shape == (3, CONFIG.max_length, CONFIG.num_heads, head_dim)
  assert int(layer["cache_index"]) == 0
  cross = cache["decoder_1"]["cross_attention"]
  assert cross["cross_key"].shape == (3, SRC_LEN, CONFIG.num_heads, head_dim)
  assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(cache))


def test_cached_decoding_matches_full_forward(params, fns):
  src = jnp.asarray(_sources())
  batch = src.shape[0]
  rng = np.random.default_rng(2)
  dec_in = rng.integers(4, VOCAB, (batch, OUT_LEN)).astype(np.int32)
  dec_in[:, 0] = BOS_ID

  encoded = fns["encode"](params, src)
  full = np.asarray(fns["full_decode"](params, encoded, src, jnp.asarray(dec_in)))   # [B, T, V]
  assert full.std() > 0.5 and len(np.unique(full.argmax(-1))) > 3  # non-degenerate logits

  cache = init_cache(MODEL, batch, SRC_LEN)
  logits, mutated = fns["prefill"](params, cache, encoded, src, jnp.asarray(dec_in[:, :1]))
  cache = mutated["cache"]
  assert int(cache["decoder_0"]["self_attention"]["cache_index"]) == 1
  np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, 0], atol=1e-5, rtol=1e-5)
  for i in range(1, OUT_LEN):
    logits, mutated = fns["step"](params, cache, src, jnp.asarray(dec_in[:, i:i + 1]), i)
    cache = mutated["cache"]
    assert logits.shape == (batch, 1, VOCAB)
    np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, i], atol=1e-5, rtol=1e-5, err_msg=f"step {i}")
  assert int(cache["decoder_1"]["self_attention"]["cache_index"]) == OUT_LEN

  # The full pass over just a prefix (no later tokens present at all) gives the same logits.
  prefix = 5
  short = np.asarray(fns["full_decode"](params, encoded, src, jnp.asarray(dec_in[:, :prefix])))
  np.testing.assert_allclose(short, full[:, :prefix], atol=1e-5, rtol=1e-5)


def test_cross_attention_step_before_prefill_raises(params):
  src = jnp.asarray(_sources())
  cache = init_cache(MODEL, 4, SRC_LEN)
  # A cache without the cross-attention keys/values that a prefill would have stored.
  cache = {k: {n: d for n, d in layer.items() if n != "cross_attention"} for k, layer in cache.items()}
  step = jax.jit(lambda p, c: MODEL.apply({"params": p, "cache": c}, None, src, jnp.full((4, 1), 5, jnp.int32),
                                         decode=True, mutable=["cache"], method="decode"))
  with pytest.raises(ValueError, match="prefill"):
    step(params, cache)


def test_greedy_equals_naive_greedy(params, fns, free_run):
  src = _sources()
  naive = _naive_greedy(params, fns, src, OUT_LEN, NO_EOS)
  assert free_run.shape == (4, OUT_LEN) and free_run.dtype == np.int32
  np.testing.assert_array_equal(free_run, naive)
  # Preconditions that make the comparison meaningful: varied tokens, no PAD generated.
  assert all(len(np.unique(row)) >= 3 for row in free_run)
  assert len({tuple(row) for row in free_run}) == 4
  assert not np.any(free_run == PAD_ID)


def test_greedy_with_eos_equals_naive_greedy(params, fns, free_run):
  eos = _eos_for_test(free_run)
  src = _sources()
  out = np.asarray(fns["greedy"](params, jnp.asarray(src), eos))
  np.testing.assert_array_equal(out, _naive_greedy(params, fns, src, OUT_LEN, eos))


def _eos_for_test(free_run):
  """A token that as many rows as possible emit before their last step, but not all of them."""
  best, best_hits = None, 0
  for token in range(4, VOCAB):
    hits = sum(bool((row[:-1] == token).any()) for row in free_run)
    if best_hits < hits < len(free_run):
      best, best_hits = token, hits
  if best is None:
    pytest.fail("no suitable stand-in EOS token in the free-running outputs")
  return best


def test_eos_stops_a_row_while_others_continue(params, fns, free_run):
  eos = _eos_for_test(free_run)
  out = np.asarray(fns["greedy"](params, jnp.asarray(_sources()), eos))
  assert out.shape == free_run.shape
  stopped = []
  for row, free in zip(out, free_run):
    hits = np.flatnonzero(free == eos)
    if hits.size:
      end = hits[0] + 1                  # up to and including the first EOS
      np.testing.assert_array_equal(row[:end], free[:end])
      np.testing.assert_array_equal(row[end:], PAD_ID)
      stopped.append(end)
    else:                                 # never emits EOS: decodes the full length unchanged
      np.testing.assert_array_equal(row, free)
      assert np.all(row != PAD_ID)
  assert 1 <= len(stopped) < len(out) and min(stopped) < OUT_LEN


def test_all_rows_stopping_ends_with_pad(params, fns, free_run):
  """When every row has emitted EOS the loop stops; all later slots stay PAD."""
  common = [t for t in range(4, VOCAB) if all((row[:-2] == t).any() for row in free_run)]
  assert common, "no token that every free-running row emits"
  eos = common[0]
  out = np.asarray(fns["greedy"](params, jnp.asarray(_sources()), eos))
  ends = []
  for row, free in zip(out, free_run):
    end = np.flatnonzero(free == eos)[0] + 1
    np.testing.assert_array_equal(row[:end], free[:end])
    np.testing.assert_array_equal(row[end:], PAD_ID)
    ends.append(end)
  assert max(ends) < OUT_LEN


def test_max_decode_len_is_respected(params, fns, free_run):
  src = jnp.asarray(_sources())
  short = np.asarray(jax.jit(lambda p, s: greedy_decode(MODEL, p, s, 4, NO_EOS))(params, src))
  assert short.shape == (4, 4)
  np.testing.assert_array_equal(short, free_run[:, :4])
  assert free_run.shape == (4, OUT_LEN)


def test_batch_composition_does_not_change_output(params, fns, free_run):
  src = _sources()
  # Row 2 (9 tokens) decoded alone, without any padding column, equals its decoding in the
  # batch, next to a longer (11) and shorter (6, 3) sources that pad it to 11.
  alone = np.asarray(fns["greedy"](params, jnp.asarray(src[2:3, :9]), NO_EOS))
  assert alone.shape == (1, OUT_LEN)
  np.testing.assert_array_equal(alone[0], free_run[2])
  # Reordering the batch reorders the outputs and changes nothing else.
  order = [3, 2, 0, 1]
  mixed = np.asarray(fns["greedy"](params, jnp.asarray(src[order]), NO_EOS))
  np.testing.assert_array_equal(mixed, free_run[order])
