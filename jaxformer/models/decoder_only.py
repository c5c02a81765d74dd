"""Decoder-only causal language model (GPT style): token embedding + positions, a stack of
self-attention + FFN blocks under a causal mask, and output logits.

The block is the paper's encoder block (section 3.1) with causal self-attention, so every
option of the encoder-decoder (positions, norm and its placement, FFN, grouped-query
attention, soft-cap, sliding window, blockwise attention, remat, scan_layers, tied
embeddings) applies unchanged. Token id 0 is padding: padded keys are masked and padded
positions get zero loss weight. Packed rows (several examples per row) pass segment ids and
per-segment positions, as in `models.transformer`.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.config import ModelConfig
from jaxformer.layers.dropout import Dropout
from jaxformer.layers.embedding import Embed
from jaxformer.layers.norm import make_norm
from jaxformer.layers.positions import LearnedPositions
from jaxformer.models.blocks import BLOCK_AXES, EncoderBlock
from jaxformer.models.layout import StackedInit, layer_rngs
from jaxformer.models.transformer import (PAD_ID, embed_tokens, layer_stack, output_logits, resolve_positions,
                                          run_stack, untied_output_proj)


class SelfAttentionStack(StackedInit, nn.Module):
  """Embedding, self-attention blocks, final norm (pre-LN) and logits.

  Shared by `DecoderOnly` (causal, `model.num_decoder_layers`) and `EncoderOnly`
  (bidirectional, `model.num_encoder_layers`); subclasses set `CAUSAL` and `STACKS` (the
  stack `layer` and the config field of its depth).
  """
  config: ModelConfig
  CAUSAL: ClassVar[bool] = False
  STACKS: ClassVar[tuple]

  def setup(self):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype, name="embed")
    if not cfg.tie_embeddings:
      self.output_proj = untied_output_proj(self, cfg)
    if cfg.position == "learned":
      self.positions = LearnedPositions(cfg.max_length, cfg.d_model, dtype)
    ((name, depth),) = self.STACKS
    self.num_layers = getattr(cfg, depth)
    self.stack = layer_stack(EncoderBlock, cfg, self.num_layers, name, causal=self.CAUSAL)
    if cfg.pre_norm:  # pre-LN leaves the residual stream unnormalized: close the stack with a norm
      self.final_norm = make_norm(cfg.norm, dtype)
    self.dropout = Dropout(cfg.dropout_rate)

  def _logits(self, tokens, valid, positions, segment_ids, deterministic: bool, decode: bool) -> jax.Array:
    """Logits for int `[batch, length]` tokens; `positions` and `segment_ids` as in `__call__`."""
    if decode and segment_ids is not None:
      raise ValueError("packed rows (segment_ids) cannot be decoded with the KV cache (decode=True)")
    positions, attn_positions = resolve_positions(tokens, positions, segment_ids)
    x = embed_tokens(self.config, self.embed, tokens, positions, getattr(self, "positions", None))
    x = sh.constrain(self.dropout(x, deterministic=deterministic), BLOCK_AXES)
    attn_positions = None if decode else attn_positions  # decoding: the cache slots
    x = run_stack(self.stack, x, valid, deterministic, decode, segment_ids, attn_positions,
                  rngs=layer_rngs(self, self.num_layers, deterministic))
    if self.config.pre_norm:
      x = self.final_norm(x)
    return output_logits(self.config, self.embed, getattr(self, "output_proj", None), x)


class DecoderOnly(SelfAttentionStack):
  """Causal LM over int `[batch, length]` token ids -> float32 logits `[batch, length, vocab_size]`
  (logits at position t predict token t + 1). Layers: `model.num_decoder_layers`."""
  CAUSAL: ClassVar[bool] = True
  STACKS: ClassVar = (("layer", "num_decoder_layers"),)

  def __call__(self, inputs: jax.Array, targets: jax.Array | None = None, *,
               positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
               deterministic: bool = True, decode: bool = False) -> jax.Array:
    """Next-token logits.

    Args:
      inputs: int `[batch, length]` token ids, PAD (0) padded at the end.
      targets: ignored; accepted so the model has the `(inputs, targets)` call form the
        training state's initialisation uses (the targets are the inputs shifted by one).
      positions: int `[batch, length]` positions, restarting at 0 in each segment when
        packed; None = derived from `segment_ids`, or 0..length-1. Cached decoding passes
        the index of each fed token (attention then uses the cache slot, which equals it).
      segment_ids: int `[batch, length]` packed-example ids (1, 2, ... per example of a
        row, 0 on padding): attention stays inside a segment. None = one example per row.
      decode: use and update the self-attention KV cache (`model.max_length` slots):
        a prefill feeds the prompt, each later call one token. No padding mask is
        applied then, so cached rows must not contain PAD; no segment ids.
    Returns:
      float32 `[batch, length, vocab_size]`.
    Raises:
      ValueError: `segment_ids` with `decode=True`.
    """
    del targets
    valid = None if decode else inputs != PAD_ID
    return self._logits(inputs, valid, positions, segment_ids, deterministic, decode)
