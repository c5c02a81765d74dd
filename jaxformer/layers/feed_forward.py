"""Position-wise feed-forward network, FFN(x) = max(0, x W1 + b1) W2 + b2 (paper eq. 2),
and the GELU / SiLU / gated (SwiGLU, GEGLU; Shazeer 2020) variants."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.layers import int8
from jaxformer.layers.lora import LoraSpec, add_adapter
from jaxformer.layers.token_sum import add_bias

xavier_uniform = nn.initializers.xavier_uniform

# activation name -> (nonlinearity, gated?). GELU is the exact (erf) one; the `_tanh` names use
# the tanh approximation (GPT-2's `gelu_new`, T5 v1.1's gated-GELU); silu is Marian's `swish`.
ACTIVATIONS = {
  "relu": (nn.relu, False),
  "gelu": (lambda h: nn.gelu(h, approximate=False), False),
  "gelu_tanh": (lambda h: nn.gelu(h, approximate=True), False),
  "silu": (nn.silu, False),
  "swiglu": (nn.silu, True),
  "geglu": (lambda h: nn.gelu(h, approximate=False), True),
  "geglu_tanh": (lambda h: nn.gelu(h, approximate=True), True),
}


def _dense(x: jax.Array, w: jax.Array | int8.QuantizedArray, spec: str, dtype) -> jax.Array:
  """`[tokens, in]` x kernel `[in, out]` -> `[tokens, out]` in `dtype`: the einsum `spec`, or the
  int8 product for a quantized kernel (decoding; `layers.int8`)."""
  if int8.is_quantized(w):
    return int8.matmul(x, w, 1, dtype)
  return jnp.einsum(spec, x, w.astype(dtype))


class FeedForward(nn.Module):
  """`[batch, length, d_model]` -> `[batch, length, d_model]`.

  relu / gelu / gelu_tanh / silu: act(x W1 + b1) W2 + b2. swiglu / geglu / geglu_tanh:
  (act(x Wg + bg) * (x W1 + b1)) W2 + b2, with act = SiLU / GELU and one more `[d_model, d_ff]`
  kernel `wi_gate`. `use_bias=False` drops the biases (Llama's and T5's FFNs have none).
  W1 (and Wg) are split over the tensor axis by columns (d_ff) and W2 by rows (d_ff), so
  the hidden activation `[batch, length, d_ff]` never needs gathering (Megatron style).

  Raises:
    ValueError: an unknown activation.
  """

  d_ff: int
  dtype: jnp.dtype = jnp.float32
  activation: str = "relu"  # a key of ACTIVATIONS
  use_bias: bool = True
  lora: LoraSpec | None = None  # LoRA adapters beside wi, wi_gate (target mlp_in) and wo (mlp_out); layers/lora.py

  def _dense_in(self, name: str, x: jax.Array) -> jax.Array:
    d_model = x.shape[-1]
    w = sh.param(self, name, xavier_uniform(), (sh.EMBED, sh.MLP), (d_model, self.d_ff))
    # Matmuls over the flattened tokens `[batch*length, ...]`: XLA:CPU runs the 2-D form's
    # weight gradients without transposed copies of the activations (a third faster there).
    h = _dense(x.reshape(-1, d_model), w, "nd,df->nf", self.dtype)
    h = add_adapter(self, self.lora, "mlp_in", name, x, h, (sh.EMBED,), (sh.MLP,), self.dtype)
    if self.use_bias:
      b = sh.param(self, name.replace("wi", "bi"), nn.initializers.zeros, (sh.MLP,), (self.d_ff,))
      h = add_bias(h, b.astype(self.dtype))
    return h.reshape(*x.shape[:-1], self.d_ff)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """`[batch, length, d_model]` -> `[batch, length, d_model]`; see the class docstring."""
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"unknown activation {self.activation!r}; use one of {', '.join(ACTIVATIONS)}")
    act, gated = ACTIVATIONS[self.activation]
    d_model = x.shape[-1]
    x = x.astype(self.dtype)
    h = self._dense_in("wi", x)
    h = act(self._dense_in("wi_gate", x)) * h if gated else act(h)
    h = sh.constrain(h, (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_MLP))
    w2 = sh.param(self, "wo", xavier_uniform(), (sh.MLP, sh.EMBED), (self.d_ff, d_model))
    y = _dense(h.reshape(-1, self.d_ff), w2, "nf,fd->nd", self.dtype)
    y = add_adapter(self, self.lora, "mlp_out", "wo", h, y, (sh.MLP,), (sh.EMBED,), self.dtype)
    if self.use_bias:
      y = add_bias(y, sh.param(self, "bo", nn.initializers.zeros, (sh.EMBED,), (d_model,)).astype(self.dtype))
    return y.reshape(*x.shape[:-1], d_model)
