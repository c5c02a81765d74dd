"""Layer normalization (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019), both with
float32 statistics."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh


class LayerNorm(nn.Module):
  """LayerNorm over the last axis; mean/variance in float32 whatever the input dtype.

  Input and output: `[..., d_model]`; the output has `dtype`.
  """
  epsilon: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d_model = x.shape[-1]
    scale = self.param("scale", sh.param_with_axes(nn.initializers.ones, (sh.EMBED,)), (d_model,))
    bias = self.param("bias", sh.param_with_axes(nn.initializers.zeros, (sh.EMBED,)), (d_model,))
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
    return (y * scale + bias).astype(self.dtype)


class RMSNorm(nn.Module):
  """x / sqrt(mean(x^2) + epsilon) * scale over the last axis: no centring, no bias.

  Input and output: `[..., d_model]`; the statistic is float32, the output has `dtype`.
  """
  epsilon: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", sh.param_with_axes(nn.initializers.ones, (sh.EMBED,)), (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (y * scale).astype(self.dtype)


def make_norm(kind: str, dtype: jnp.dtype, name: str | None = None) -> nn.Module:
  """`kind` = layernorm | rmsnorm (config `model.norm`).

  Raises:
    ValueError: an unknown kind.
  """
  norms = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
  if kind not in norms:
    raise ValueError(f"unknown norm {kind!r}; use one of {', '.join(norms)}")
  return norms[kind](dtype=dtype, name=name)
