"""Position-wise feed-forward network, FFN(x) = max(0, x W1 + b1) W2 + b2 (paper eq. 2)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh

xavier_uniform = nn.initializers.xavier_uniform


class FeedForward(nn.Module):
  """ReLU FFN. `[batch, length, d_model]` -> `[batch, length, d_model]`.

  W1 is split over the tensor axis by columns (d_ff) and W2 by rows (d_ff), so the
  hidden activation `[batch, length, d_ff]` never needs gathering (Megatron style).
  """
  d_ff: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d_model = x.shape[-1]
    w1 = self.param("wi", sh.param_with_axes(xavier_uniform(), (sh.EMBED, sh.MLP)), (d_model, self.d_ff))
    b1 = self.param("bi", sh.param_with_axes(nn.initializers.zeros, (sh.MLP,)), (self.d_ff,))
    w2 = self.param("wo", sh.param_with_axes(xavier_uniform(), (sh.MLP, sh.EMBED)), (self.d_ff, d_model))
    b2 = self.param("bo", sh.param_with_axes(nn.initializers.zeros, (sh.EMBED,)), (d_model,))
    batch, length = x.shape[:2]
    x = x.astype(self.dtype).reshape(batch * length, d_model)  # 2-D matmuls: no transposes in the backward pass
    h = nn.relu(x @ w1.astype(self.dtype) + b1.astype(self.dtype)).reshape(batch, length, self.d_ff)
    h = sh.constrain(h, (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_MLP)).reshape(batch * length, self.d_ff)
    return (h @ w2.astype(self.dtype) + b2.astype(self.dtype)).reshape(batch, length, d_model)
