"""Layer normalization (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019), both with
float32 statistics."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.layers.token_sum import scale_only, scale_shift


def _standardize_fwd(x: jax.Array, epsilon: float):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  centered = x - mean
  inv_std = jax.lax.rsqrt(jnp.mean(jnp.square(centered), axis=-1, keepdims=True) + epsilon)
  y = centered * inv_std
  return y, (y, inv_std)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def standardize(x: jax.Array, epsilon: float) -> jax.Array:
  """(x - mean) / sqrt(var + epsilon) over the last axis of float32 `x`.

  The hand-written backward pass, dx = inv_std * (g - mean(g) - y * mean(g * y)), keeps
  the two row reductions separate from the elementwise work; XLA's CPU fusion of the
  autodiff version recomputes them and was the slowest op of a small LM's train step.
  """
  return _standardize_fwd(x, epsilon)[0]


def _standardize_bwd(epsilon, residuals, g):
  del epsilon
  y, inv_std = residuals
  mean_g = jnp.mean(g, axis=-1, keepdims=True)
  mean_gy = jnp.mean(g * y, axis=-1, keepdims=True)
  return (inv_std * (g - mean_g - y * mean_gy),)


standardize.defvjp(_standardize_fwd, _standardize_bwd)


class LayerNorm(nn.Module):
  """LayerNorm over the last axis; mean/variance in float32 whatever the input dtype.

  Input and output: `[..., d_model]`; the output has `dtype`.
  """

  epsilon: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """`[..., d_model]` -> normalised, scaled and shifted `[..., d_model]` in `dtype`."""
    d_model = x.shape[-1]
    scale = sh.param(self, "scale", nn.initializers.ones, (sh.EMBED,), (d_model,))
    bias = sh.param(self, "bias", nn.initializers.zeros, (sh.EMBED,), (d_model,))
    y = standardize(x.astype(jnp.float32), self.epsilon)
    return scale_shift(y, scale, bias).astype(self.dtype)


class RMSNorm(nn.Module):
  """x / sqrt(mean(x^2) + epsilon) * scale over the last axis: no centring, no bias.

  Input and output: `[..., d_model]`; the statistic is float32, the output has `dtype`.
  """

  epsilon: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """`[..., d_model]` -> RMS-normalised and scaled `[..., d_model]` in `dtype`."""
    scale = sh.param(self, "scale", nn.initializers.ones, (sh.EMBED,), (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return scale_only(y, scale).astype(self.dtype)


def make_norm(kind: str, dtype: jnp.dtype, name: str | None = None, epsilon: float = 1e-6) -> nn.Module:
  """`kind` = layernorm | rmsnorm (config `model.norm`), with `epsilon` (`model.norm_epsilon`).

  Raises:
    ValueError: an unknown kind.
  """
  norms = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
  if kind not in norms:
    raise ValueError(f"unknown norm {kind!r}; use one of {', '.join(norms)}")
  return norms[kind](epsilon=epsilon, dtype=dtype, name=name)
