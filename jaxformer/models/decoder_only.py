"""Decoder-only causal language model (GPT style): token embedding + positions, a stack of
self-attention + FFN blocks under a causal mask, and tied output logits.

The block is the paper's encoder block (section 3.1) with a causal mask, so every layer
option of `EncoderBlock` (norm placement, FFN, attention) applies unchanged. Token id 0
is padding: padded keys are masked and padded positions get zero loss weight.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.config import ModelConfig
from jaxformer.layers.attention import causal_mask, padding_mask
from jaxformer.layers.embedding import Embed, sinusoidal_positions
from jaxformer.layers.norm import LayerNorm
from jaxformer.models.blocks import BLOCK_AXES, EncoderBlock
from jaxformer.models.transformer import PAD_ID, default_positions


class SelfAttentionStack(nn.Module):
  """Embedding, `num_layers` self-attention blocks, final norm (pre-LN) and logits.

  Shared by `DecoderOnly` (causal mask) and `EncoderOnly` (padding mask only); subclasses
  choose the mask and the layer count.
  """
  config: ModelConfig

  @property
  def num_layers(self) -> int:
    raise NotImplementedError

  def setup(self):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype, name="embed")
    if not cfg.share_embeddings:
      self.output_proj = self.param(
          "output_proj", sh.param_with_axes(nn.initializers.xavier_uniform(), (sh.EMBED, sh.VOCAB)),
          (cfg.d_model, cfg.vocab_size))
    self.blocks = [EncoderBlock(cfg, name=f"layer_{i}") for i in range(self.num_layers)]
    if cfg.pre_norm:  # pre-LN leaves the residual stream unnormalized: close the stack with a norm
      self.final_norm = LayerNorm(dtype=dtype)
    self.dropout = nn.Dropout(cfg.dropout_rate)

  def _embed(self, tokens: jax.Array, positions: jax.Array, deterministic: bool) -> jax.Array:
    x = self.embed(tokens) + sinusoidal_positions(positions, self.config.d_model).astype(self.embed.dtype)
    return sh.constrain(self.dropout(x, deterministic=deterministic), BLOCK_AXES)

  def _logits(self, x: jax.Array) -> jax.Array:
    if self.config.pre_norm:
      x = self.final_norm(x)
    if self.config.share_embeddings:
      logits = self.embed.attend(x)
    else:
      dtype = jnp.dtype(self.config.dtype)
      logits = jnp.einsum("btd,dv->btv", x.astype(dtype), self.output_proj.astype(dtype)).astype(jnp.float32)
    return sh.constrain(logits, (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_VOCAB))

  def _stack(self, tokens, mask, positions, deterministic: bool, decode: bool) -> jax.Array:
    x = self._embed(tokens, positions, deterministic)
    for block in self.blocks:
      x = block(x, mask, deterministic, decode)
    return self._logits(x)


class DecoderOnly(SelfAttentionStack):
  """Causal LM over int `[batch, length]` token ids -> float32 logits `[batch, length, vocab_size]`
  (logits at position t predict token t + 1). Layers: `model.num_decoder_layers`."""

  @property
  def num_layers(self) -> int:
    return self.config.num_decoder_layers

  def __call__(self, inputs: jax.Array, targets: jax.Array | None = None, *,
               positions: jax.Array | None = None, deterministic: bool = True,
               decode: bool = False) -> jax.Array:
    """Next-token logits.

    Args:
      inputs: int `[batch, length]` token ids, PAD (0) padded at the end.
      targets: ignored; accepted so the model has the `(inputs, targets)` call form the
        training state's initialisation uses (the targets are the inputs shifted by one).
      positions: int `[batch, length]` absolute positions; defaults to 0..length-1.
        Cached decoding passes the index of each fed token.
      decode: use and update the self-attention KV cache (`model.max_length` slots):
        a prefill feeds the prompt, each later call one token. No padding mask is
        applied then, so cached rows must not contain PAD.
    Returns:
      float32 `[batch, length, vocab_size]`.
    """
    del targets
    if positions is None:
      positions = default_positions(inputs)
    mask = None
    if not decode:
      valid = inputs != PAD_ID
      mask = padding_mask(valid, valid) & causal_mask(inputs.shape[1])
    return self._stack(inputs, mask, positions, deterministic, decode)
