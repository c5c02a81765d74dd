"""Tests of jaxformer.layers.dropout: Threefry-2x32 known answers, dropout statistics and
scaling, sharding invariance, counters past 2^32 elements, argument errors."""

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxformer.layers.dropout import Dropout, dropout, random_words, threefry_2x32

# Random123's published known-answer vectors for threefry2x32_20: (key, counter, output).
KATS = [
  ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
  ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
  ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


def _u32(*v):
  return tuple(np.uint32(w) for w in v)


@pytest.mark.parametrize("key, ctr, expected", KATS)
def test_threefry_known_answers(key, ctr, expected):
  ours = threefry_2x32(_u32(*key), *_u32(*ctr))
  assert tuple(int(w) for w in ours) == expected
  # JAX's threefry_2x32 hashes an even-sized count as halves (x0s, then x1s).
  theirs = jex_random.threefry_2x32(jnp.array(key, jnp.uint32), jnp.array(ctr, jnp.uint32))
  assert tuple(int(w) for w in theirs) == expected


def test_threefry_matches_jax_on_random_counters():
  rng = np.random.default_rng(0)
  key = rng.integers(0, 2**32, 2, dtype=np.uint32)
  x0, x1 = rng.integers(0, 2**32, (2, 1000), dtype=np.uint32)
  y0, y1 = jax.jit(threefry_2x32)((key[0], key[1]), x0, x1)
  theirs = np.asarray(jex_random.threefry_2x32(jnp.asarray(key), jnp.asarray(np.concatenate([x0, x1]))))
  np.testing.assert_array_equal(np.concatenate([y0, y1]), theirs)


def _x(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).uniform(1.0, 2.0, shape), jnp.float32)  # never 0


@pytest.mark.parametrize("shape", [(4, 6, 64), (5, 7, 33)], ids=["even", "odd"])
def test_keep_fraction_and_scaling(shape):
  rate = 0.3
  x = _x(shape)
  y = np.asarray(jax.jit(lambda x, k: dropout(x, rate, k))(x, jax.random.key(1)))
  assert y.dtype == np.float32 and y.shape == shape
  kept = y != 0
  n, p = kept.size, 1 - rate
  assert abs(kept.mean() - p) < 5 * np.sqrt(p * (1 - p) / n)
  np.testing.assert_array_equal(y[kept], np.asarray(x)[kept] * np.float32(1 / p))
  np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / p, rtol=2e-7)


def test_keeps_dtype_and_accepts_raw_keys():
  x = _x((3, 8)).astype(jnp.bfloat16)
  typed = dropout(x, 0.5, jax.random.key(3))
  raw = dropout(x, 0.5, jax.random.key_data(jax.random.key(3)))
  assert typed.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(typed, np.float32), np.asarray(raw, np.float32))
  rbg = dropout(x, 0.5, jax.random.key(3, impl="rbg"))  # 4 key words: the first two are used
  assert rbg.shape == x.shape


def test_rate_zero_is_identity_and_rate_one_zeros():
  x = _x((3, 5))
  assert dropout(x, 0.0, jax.random.key(0)) is x
  np.testing.assert_array_equal(dropout(x, 1.0, jax.random.key(0)), np.zeros((3, 5), np.float32))


def test_different_keys_give_different_masks():
  x = _x((8, 32))
  a, b = (np.asarray(dropout(x, 0.5, jax.random.key(s))) != 0 for s in (0, 1))
  assert (a != b).mean() > 0.3  # independent masks differ in about half the places


def test_no_correlation_within_hash_pairs_or_between_rows():
  words = np.asarray(random_words(jax.random.key(7), (256, 128)), np.float64)
  pairs = words.reshape(256, 64, 2)
  n = pairs[..., 0].size
  assert abs(np.corrcoef(pairs[..., 0].ravel(), pairs[..., 1].ravel())[0, 1]) < 5 / np.sqrt(n)
  rows = words[0::2].ravel(), words[1::2].ravel()
  assert abs(np.corrcoef(*rows)[0, 1]) < 5 / np.sqrt(rows[0].size)


@pytest.mark.parametrize(
  "mesh_shape, spec", [((8,), P("d", None)), ((4,), P(None, "d")), ((8,), P())], ids=["rows", "columns", "replicated"]
)
def test_mask_is_the_same_under_any_sharding(mesh_shape, spec):
  x = _x((16, 12))
  key = jax.random.key(5)
  fn = jax.jit(lambda x, k: dropout(x, 0.4, k))
  expected = np.asarray(fn(x, key))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[: mesh_shape[0]]), ("d",))
  sharded = jax.device_put(x, NamedSharding(mesh, spec))
  np.testing.assert_array_equal(np.asarray(fn(sharded, key)), expected)


def test_counters_past_two_to_the_32_elements():
  # 2^33 elements (and 2^31 rows of a 3-D array) trace and lower without allocating them.
  shape = (2**17, 2**16)
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  out = jax.eval_shape(lambda x, k: dropout(x, 0.1, k), x, jax.random.key(0))
  assert out.shape == shape and out.dtype == jnp.bfloat16
  jax.jit(lambda x, k: dropout(x, 0.1, k)).lower(x, jax.random.key(0))
  words = jax.eval_shape(lambda k: random_words(k, (2**15, 2**16, 4)), jax.random.key(0))
  assert words.shape == (2**15, 2**16, 4) and words.dtype == jnp.uint32
  with pytest.raises(ValueError, match="fewer than 2\\^32 rows"):
    jax.eval_shape(lambda k: random_words(k, (2**16, 2**16, 2)), jax.random.key(0))


def test_word_of_element_r_c_hashes_counter_r_and_half_c():
  # Counter (flat row, column // 2), half column % 2: two words, no flat 32-bit index.
  key = jax.random.key(11)
  k0, k1 = np.asarray(jax.random.key_data(key))
  words = np.asarray(random_words(key, (2, 3, 9)))
  rows, cols = np.meshgrid(np.arange(6, dtype=np.uint32), np.arange(9, dtype=np.uint32), indexing="ij")
  y = np.stack([np.asarray(w) for w in threefry_2x32((k0, k1), rows, cols // 2)])
  np.testing.assert_array_equal(words.reshape(6, 9), np.where(cols % 2 == 0, y[0], y[1]))


def test_errors():
  with pytest.raises(TypeError, match="floating-point"):
    dropout(jnp.ones((2, 3), jnp.int32), 0.1, jax.random.key(0))
  for rate in (-0.1, 1.5):
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
      dropout(jnp.ones((2, 3)), rate, jax.random.key(0))
  for key in (jax.random.split(jax.random.key(0)), 3, [1, 2]):
    with pytest.raises(TypeError, match="one jax.random.key"):
      dropout(jnp.ones((2, 3)), 0.1, key)


def test_float16_rate_near_one_keeps_finite_scaled_values():
  rate = 0.99999  # 1 / (1 - rate) = 1e5 overflows float16; x / (1 - rate) = 100 does not
  x = jnp.full((4000, 1000), 1e-3, jnp.float16)
  out = np.asarray(dropout(x, rate, jax.random.key(0)), np.float32)
  kept = out[out != 0]
  assert 0 < kept.size < 200 and np.all(np.isfinite(kept))
  np.testing.assert_allclose(kept, 1e-3 / (1 - rate), rtol=2e-3)


def test_module_is_identity_when_deterministic():
  x = _x((2, 5, 6))
  module = Dropout(0.5)
  np.testing.assert_array_equal(module.apply({}, x, deterministic=True), x)  # no "dropout" rng needed
  np.testing.assert_array_equal(Dropout(0.0).apply({}, x, deterministic=False), x)
  y = module.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
  assert 0 < (np.asarray(y) == 0).mean() < 1


def test_each_mask_is_hashed_once_however_deep_the_residual_stream():
  """XLA copies cheap elementwise producers into every consumer: without `_computed_once` the
  gradient of this residual stream of dropped-out layers compiled to 382 shift-lefts (each
  20-round hash has 20; fold_in's adds some), copies that grow with depth. Now 162."""
  layers, shape = 6, (4, 8, 16)

  def loss(w, x, key):
    for i in range(layers):
      x = x + dropout(jnp.tanh(x @ w[i]), 0.1, jax.random.fold_in(key, i))
    return (x**2).sum()

  w = jnp.full((layers, 16, 16), 0.1)
  compiled = jax.jit(jax.grad(loss)).lower(w, jnp.ones(shape), jax.random.key(0)).compile()
  shifts = compiled.as_text().count("shift-left(")
  assert 20 * layers <= shifts <= 2 * 20 * layers
