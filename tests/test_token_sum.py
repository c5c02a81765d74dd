"""layers.token_sum: the custom backward passes of biases and norm scales equal autodiff of the
plain expressions, in float32 and bfloat16, and `token_sum` is the sum over the leading axes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.layers.token_sum import add_bias, scale_only, scale_shift, token_sum


def _normal(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def test_token_sum_is_the_sum_over_the_leading_axes():
  a = _normal(0, (3, 5, 2, 4))
  np.testing.assert_allclose(token_sum(a, (2, 4), jnp.float32), a.sum(axis=(0, 1)), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(token_sum(a, (4,), jnp.float32), a.sum(axis=(0, 1, 2)), rtol=1e-6, atol=1e-6)
  assert token_sum(a.astype(jnp.bfloat16), (4,), jnp.bfloat16).dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"trailing axes of \(3, 5, 2, 4\) are not \(5,\)"):
    token_sum(a, (5,), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_equal_autodiff_of_the_plain_expressions(dtype):
  """Each op against its plain expression under one random downstream function: values and the
  gradients of every input (a bias of `[heads, head_dim]` too, as attention's)."""
  x, w = _normal(1, (2, 7, 3, 4), dtype), _normal(2, (2, 7, 3, 4))
  bias, scale, shift = _normal(3, (3, 4), dtype), _normal(4, (4,)), _normal(5, (4,))
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  y32 = x.astype(jnp.float32)
  cases = [
    (add_bias, lambda a, b: a + b, (x, bias)),
    (scale_shift, lambda a, s, b: a * s + b, (y32, scale, shift)),
    (scale_only, lambda a, s: a * s, (y32, scale)),
  ]

  def loss(f, *a):
    return jnp.sum(jnp.sin(f(*a).astype(jnp.float32)) * w)

  for ours, plain, args in cases:
    argnums = tuple(range(1, len(args) + 1))
    got = jax.jit(jax.value_and_grad(loss, argnums), static_argnums=0)(ours, *args)
    want = jax.jit(jax.value_and_grad(loss, argnums), static_argnums=0)(plain, *args)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, r, a in zip(got[1], want[1], args):
      assert g.dtype == a.dtype and g.shape == a.shape
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), **tol)
