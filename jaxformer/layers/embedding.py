"""Token embeddings (scaled by sqrt(d_model), optionally tied to the output logits)
and sinusoidal positional encodings (paper section 3.4 and 3.5)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import sharding as sh
from jaxformer.layers import int8


def sinusoid_table(max_length: int, d_model: int) -> jax.Array:
  """float32 `[max_length, d_model]`: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),
  PE(pos, 2i+1) = cos(same) for positions 0..max_length-1 (section 3.5).

  Raises:
    ValueError: odd d_model.
  """
  if d_model % 2:
    raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
  inv_freq = 1.0 / (10000.0 ** (np.arange(0, d_model, 2, dtype=np.float32) / d_model))  # [D/2]
  angles = jnp.arange(max_length, dtype=jnp.float32)[:, None] * inv_freq  # [L, D/2]
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(max_length, d_model)


def sinusoidal_positions(positions: jax.Array, d_model: int, max_length: int) -> jax.Array:
  """float32 `[batch, length, d_model]`: the `sinusoid_table` rows of int `[batch, length]`
  positions. The table covers max(max_length, length) positions (`max_length`: the model's),
  so a sequence longer than the model's `max_length` still gets the formula's encodings;
  positions past the table (only a cached step's padding) get its last row.

  Raises:
    ValueError: odd d_model.
  """
  # A row per token rather than sine and cosine per token: XLA hoists the table out of a
  # decode loop, and computing them for each new token cost about 0.1 ms a step at 128 rows.
  table = sinusoid_table(max(max_length, positions.shape[-1]), d_model)
  return jnp.take(table, positions, axis=0, mode="clip")


class Embed(nn.Module):
  """Token embedding table `[vocab_size, d_model]`, sharded over vocab (tensor) and embed (fsdp).

  `__call__` maps int `[batch, length]` ids to `[batch, length, d_model]` vectors times
  sqrt(d_model) (section 3.4; `scale=False`: unscaled, as in GPT-2, Llama and BERT); `attend`
  maps `[batch, length, d_model]` to float32 logits
  `[batch, length, vocab_size]` with the same matrix (weight tying, section 3.4).
  """

  vocab_size: int
  d_model: int
  dtype: jnp.dtype = jnp.float32
  scale: bool = True

  def setup(self):
    """Creates the `[vocab_size, d_model]` table, initialised N(0, 1/d_model)."""
    init = nn.initializers.normal(stddev=self.d_model**-0.5)
    self.embedding = sh.param(self, "embedding", init, (sh.VOCAB, sh.EMBED), (self.vocab_size, self.d_model))

  def __call__(self, ids: jax.Array) -> jax.Array:
    """int `[batch, length]` ids -> `[batch, length, d_model]` vectors (times sqrt(d_model) if `scale`), in `dtype`."""
    # Gather the table over the vocab (tensor) axis first: a lookup into a vocab-sharded
    # table would make XLA replicate it anyway, with a warning and extra copies.
    table = self.embedding
    if int8.is_quantized(table):  # decoding with int8 weights (`layers.int8`): rows scaled per row
      table = table.replace(values=sh.constrain(table.values, (None, sh.EMBED)))
    else:
      table = sh.constrain(table, (None, sh.EMBED))
    x = int8.take_rows(table, ids, mode="clip")  # clip: a model without a pad token pads with -1
    return (x * np.sqrt(self.d_model) if self.scale else x).astype(self.dtype)

  def attend(self, x: jax.Array, vocab_major: bool = False) -> jax.Array:
    """`[batch, length, d_model]` -> float32 logits `[batch, length, vocab_size]` (the tied
    output layer). `vocab_major`: compute them as `[vocab, tokens]` and transpose, for the few
    tokens of a decode step (the values are the same up to float rounding). An int8 table
    (`layers.int8.QuantizedArray`, decoding) gives the int8 product's logits."""
    # One 2-D matmul over the flattened tokens: from the 3-D form XLA:CPU computes the
    # weight gradient through a transposed copy of the whole [batch, length, vocab]
    # logits gradient, which doubles the logits' share of the train step.
    flat = x.reshape(-1, x.shape[-1]).astype(self.dtype)  # [B*T, D]
    if int8.is_quantized(self.embedding):  # int8 x int8, tokens first (`layers.int8`)
      logits = int8.matmul_rows(flat, self.embedding)
      return logits.reshape(*x.shape[:-1], self.vocab_size)
    table = self.embedding.astype(self.dtype)
    if vocab_major:
      # The table as the left operand, read in its stored [vocab, d_model] order: XLA:CPU
      # (YNNPACK) ran the tokens-first product 1.6x slower at 32 tokens (1.21 against 0.76 ms
      # for 32 x 256 x 8000), where the table streams from memory. The barrier keeps XLA from
      # folding the transpose back into the product.
      logits = jax.lax.optimization_barrier(jnp.einsum("vd,nd->vn", table, flat)).T
    else:
      logits = jnp.einsum("nd,vd->nv", flat, table)  # [B*T, V]
    return logits.reshape(*x.shape[:-1], self.vocab_size).astype(jnp.float32)
