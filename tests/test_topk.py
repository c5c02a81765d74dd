"""jaxformer.inference.topk: argmax and top-k from reductions equal `jnp.argmax` / `lax.top_k`,
ties (lowest id first), -inf and padding of a vocabulary that is not a multiple of the block,
through both block levels (k = 16 at 8,000 ids: 1,024 kept ids, then 128)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.inference import topk


def _logits(rows, vocab, seed):
  """Random float32 `[rows, vocab]` with repeated values (ties), -inf entries, one constant row
  and one row whose maximum sits in two blocks."""
  rng = np.random.default_rng(seed)
  x = rng.integers(-40, 40, (rows, vocab)).astype(np.float32) / 4  # coarse grid: many ties
  x[0] = 1.5  # every id ties
  x[1, :: max(vocab // 7, 1)] = -np.inf
  x[2, [3, vocab - 1]] = 100.0  # the max in the first and last block
  return jnp.asarray(x)


@pytest.mark.parametrize("vocab", [8000, 520, 130, 64, 37])
@pytest.mark.parametrize("k", [1, 2, 8, 16, 20])
def test_top_k_equals_lax_top_k(vocab, k):
  if k > vocab:
    pytest.skip("k > vocab")
  logits = _logits(6, vocab, seed=vocab + k)
  values, ids = jax.jit(topk.top_k, static_argnums=1)(logits, k)
  want_values, want_ids = jax.lax.top_k(logits, k)
  np.testing.assert_array_equal(values, want_values)
  np.testing.assert_array_equal(ids, want_ids)
  assert ids.dtype == jnp.int32


@pytest.mark.parametrize("vocab", [8000, 100])
def test_argmax_equals_jnp_argmax_on_any_leading_shape(vocab):
  logits = _logits(12, vocab, seed=vocab).reshape(3, 4, vocab)
  got = jax.jit(topk.argmax)(logits)
  np.testing.assert_array_equal(got, jnp.argmax(logits, axis=-1))
  assert got.shape == (3, 4) and got.dtype == jnp.int32
  assert int(got[0, 0]) == 0  # a constant row: the lowest id


def test_top_k_refuses_k_outside_the_vocabulary():
  with pytest.raises(ValueError, match="1 <= k <= vocab"):
    topk.top_k(jnp.zeros((2, 5)), 6)


def test_rows_with_fewer_finite_logits_than_k_and_nan_rows():
  """-inf entries come back in id order after the finite ones, each id once; NaN ranks first
  (both as in lax.top_k / jnp.argmax)."""
  x = np.full((4, 8000), -np.inf, np.float32)
  x[0, :10] = np.arange(10)  # 10 finite values
  x[1, 5] = 5.0  # one finite value
  x[2, [7, 4000]] = np.nan  # NaNs among -inf
  x[3] = np.arange(8000) / 8000
  x[3, [9, 6000]] = np.nan  # NaNs among numbers
  x = jnp.asarray(x)
  values, ids = jax.jit(topk.top_k, static_argnums=1)(x, 12)
  want_values, want_ids = jax.lax.top_k(x, 12)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_array_equal(values, want_values)  # NaN == NaN in assert_array_equal
  np.testing.assert_array_equal(jax.jit(topk.argmax)(x), jnp.argmax(x, axis=-1))


@pytest.mark.parametrize("vocab, k", [(8000, 8), (130, 2), (37, 20), (8000, 1)])
def test_top_k_log_probs_equals_log_softmax_at_lax_top_k(vocab, k):
  """Ids as lax.top_k (ties, -inf entries, the fallback path when k > MAX_K or few blocks);
  values = jax.nn.log_softmax at those ids."""
  logits = _logits(6, vocab, seed=3 * vocab + k)
  logp, ids = jax.jit(topk.top_k_log_probs, static_argnums=1)(logits, k)
  want_ids = jax.lax.top_k(logits, k)[1]
  np.testing.assert_array_equal(ids, want_ids)
  want = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), want_ids, axis=1)
  np.testing.assert_allclose(logp, want, rtol=1e-6, atol=1e-5)
  assert logp.dtype == jnp.float32 and ids.dtype == jnp.int32


@pytest.mark.parametrize("vocab, k", [(8000, 8), (37, 20)])
def test_top_k_log_probs_keeps_precision_for_huge_logits(vocab, k):
  """Both paths (blocks, and XLA's top-k for k > MAX_K) shift by the top logit before the
  normaliser: a row of equal 1e30 logits gives -log(vocab), not 1e30 - 1e30 + ... = 0."""
  logp, _ = topk.top_k_log_probs(jnp.full((2, vocab), 1e30, jnp.float32), k)
  np.testing.assert_allclose(logp, -np.log(vocab), rtol=1e-6)
