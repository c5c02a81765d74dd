"""The paper's encoder-decoder Transformer (Vaswani et al. 2017, Figure 1).

Token id 0 is padding everywhere; padding masks are derived from the ids.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.config import ModelConfig
from jaxformer.layers.embedding import Embed, sinusoidal_positions
from jaxformer.layers.norm import make_norm
from jaxformer.layers.positions import LearnedPositions
from jaxformer.models.blocks import BLOCK_AXES, DecoderBlock, EncoderBlock

PAD_ID = 0
BOS_ID = 2


def shift_right(targets: jax.Array, bos_id: int = BOS_ID) -> jax.Array:
  """Decoder inputs from targets: `[BOS, y1, ..., y_{T-1}]` (int `[batch, length]`).

  Padding stays padding, so the decoder's padding mask equals the target's.
  """
  shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
  return jnp.where(targets == PAD_ID, PAD_ID, shifted)


def default_positions(tokens: jax.Array) -> jax.Array:
  """int32 `[batch, length]` positions 0..length-1."""
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


class EncoderDecoder(nn.Module):
  """Encoder-decoder Transformer.

  Methods:
    encode(inputs) -> `[batch, src_len, d_model]` from int `[batch, src_len]` source ids.
    decode(encoded, inputs, decoder_inputs, ...) -> float32 logits `[batch, tgt_len, vocab_size]`.
    __call__(inputs, targets) -> logits for teacher forcing (targets shifted right with BOS).
  """
  config: ModelConfig

  def setup(self):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    if cfg.tie_embeddings:
      self.source_embed = self.target_embed = Embed(cfg.vocab_size, cfg.d_model, dtype, name="embed")
    else:
      self.source_embed = Embed(cfg.vocab_size, cfg.d_model, dtype, name="source_embed")
      self.target_embed = Embed(cfg.vocab_size, cfg.d_model, dtype, name="target_embed")
      self.output_proj = self.param(
          "output_proj", sh.param_with_axes(nn.initializers.xavier_uniform(), (sh.EMBED, sh.VOCAB)),
          (cfg.d_model, cfg.vocab_size))
    self.encoder_blocks = [EncoderBlock(cfg, name=f"encoder_{i}") for i in range(cfg.num_encoder_layers)]
    self.decoder_blocks = [DecoderBlock(cfg, name=f"decoder_{i}") for i in range(cfg.num_decoder_layers)]
    if cfg.pre_norm:  # pre-LN leaves the residual stream unnormalized: close each stack with a norm
      self.encoder_norm = make_norm(cfg.norm, dtype)
      self.decoder_norm = make_norm(cfg.norm, dtype)
    if cfg.position == "learned":
      self.source_positions = LearnedPositions(cfg.max_length, cfg.d_model, dtype)
      self.target_positions = LearnedPositions(cfg.max_length, cfg.d_model, dtype)
    self.dropout = nn.Dropout(cfg.dropout_rate)

  def _embed(self, embed: Embed, tokens, positions, deterministic, learned=None):
    """Token embeddings plus absolute positions (sinusoidal or learned); rope and alibi act
    inside self-attention instead, `none` adds nothing."""
    x = embed(tokens)
    if self.config.position == "sinusoidal":
      x = x + sinusoidal_positions(positions, self.config.d_model).astype(embed.dtype)
    elif self.config.position == "learned":
      x = x + learned(positions)
    return sh.constrain(self.dropout(x, deterministic=deterministic), BLOCK_AXES)

  def encode(self, inputs: jax.Array, *, deterministic: bool = True) -> jax.Array:
    """Encoder stack over int `[batch, src_len]` ids -> `[batch, src_len, d_model]`."""
    valid = inputs != PAD_ID
    x = self._embed(self.source_embed, inputs, default_positions(inputs), deterministic,
                    getattr(self, "source_positions", None))
    for block in self.encoder_blocks:
      x = block(x, valid, deterministic)
    return self.encoder_norm(x) if self.config.pre_norm else x

  def decode(self, encoded: jax.Array | None, inputs: jax.Array, decoder_inputs: jax.Array, *,
             positions: jax.Array | None = None, deterministic: bool = True,
             decode: bool = False) -> jax.Array:
    """Decoder stack -> float32 logits `[batch, tgt_len, vocab_size]`.

    Args:
      encoded: encoder output `[batch, src_len, d_model]`; at cached decode steps after
        the prefill it may be None (cross-attention keys/values are cached).
      inputs: int `[batch, src_len]` source ids, for the cross-attention padding mask.
      decoder_inputs: int `[batch, tgt_len]`, starting with BOS.
      positions: int `[batch, tgt_len]` positions of `decoder_inputs` for sinusoidal / learned
        embeddings; defaults to 0..tgt_len-1. Decoding passes the absolute step index.
        RoPE and ALiBi use the token index (the cache slot when decoding), which equals it.
      decode: use and update the KV cache (prefill or one decode step).
    """
    if positions is None:
      positions = default_positions(decoder_inputs)
    tgt_valid = decoder_inputs != PAD_ID
    src_valid = inputs != PAD_ID
    y = self._embed(self.target_embed, decoder_inputs, positions, deterministic,
                    getattr(self, "target_positions", None))
    for block in self.decoder_blocks:
      y = block(y, encoded, tgt_valid, src_valid, deterministic, decode)
    if self.config.pre_norm:
      y = self.decoder_norm(y)
    if self.config.tie_embeddings:
      logits = self.target_embed.attend(y)
    else:
      dtype = jnp.dtype(self.config.dtype)
      logits = jnp.einsum("btd,dv->btv", y.astype(dtype), self.output_proj.astype(dtype)).astype(jnp.float32)
    return sh.constrain(logits, (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_VOCAB))

  def __call__(self, inputs: jax.Array, targets: jax.Array, *, deterministic: bool = True) -> jax.Array:
    """Teacher-forced logits `[batch, tgt_len, vocab_size]` (float32) for `targets` `[batch, tgt_len]`."""
    encoded = self.encode(inputs, deterministic=deterministic)
    return self.decode(encoded, inputs, shift_right(targets), deterministic=deterministic)
