"""The masked LM's output head of BERT (Devlin et al. 2019; `model.mlm_head`): a dense layer
with bias, the FFN's nonlinearity and a norm transform the final hidden states, the output
layer (tied embedding or output projection) gives logits, and a per-token output bias is added.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.config import ModelConfig
from jaxformer.layers.feed_forward import ACTIVATIONS
from jaxformer.layers.norm import make_norm


class MaskedLMHead(nn.Module):
  """logits = output(norm(act(y W + b))) + output_bias.

  Params: `dense_kernel` `[d_model, d_model]`, `dense_bias` `[d_model]`, `norm` (`model.norm`
  with `model.norm_epsilon`) and `output_bias` `[vocab_size]`. `act` is the FFN's nonlinearity
  (`model.ffn`; SiLU for swiglu, GELU for geglu).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, y: jax.Array, output: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`y` `[batch, length, d_model]` -> float32 logits `[batch, length, vocab_size]`; `output`
    maps the transformed `[batch, length, d_model]` states to logits without the bias."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    d = cfg.d_model
    kernel = sh.param(self, "dense_kernel", nn.initializers.xavier_uniform(), (sh.EMBED, None), (d, d))
    bias = sh.param(self, "dense_bias", nn.initializers.zeros, (sh.EMBED,), (d,))
    b, t, _ = y.shape  # one 2-D matmul over the tokens (see layers/attention.py `_project`)
    h = jnp.einsum("md,de->me", y.reshape(b * t, d).astype(dtype), kernel.astype(dtype)) + bias.astype(dtype)
    h = ACTIVATIONS[cfg.ffn][0](h.reshape(b, t, d))
    h = make_norm(cfg.norm, dtype, name="norm", epsilon=cfg.norm_epsilon)(h)
    output_bias = sh.param(self, "output_bias", nn.initializers.zeros, (sh.VOCAB,), (cfg.vocab_size,))
    logits = output(h) + output_bias.astype(jnp.float32)
    return sh.constrain(logits, (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_VOCAB))
