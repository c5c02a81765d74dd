"""Decoder-only causal language model (GPT style): token embedding + positions, a stack of
self-attention + FFN blocks under a causal mask, and output logits.

The block is the paper's encoder block (section 3.1) with causal self-attention, so every
option of the encoder-decoder (positions, norm and its placement, FFN, grouped-query
attention, soft-cap, sliding window, blockwise attention, remat, scan_layers, tied
embeddings) applies unchanged. Token id `model.pad_id` (0 unless imported) is padding: padded
keys are masked and not cached. Packed rows (several examples per row) pass segment ids and
per-segment positions, as in `models.transformer`.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.config import ModelConfig
from jaxformer.layers.dropout import Dropout
from jaxformer.layers.embedding import Embed
from jaxformer.layers.kv_cache import CacheState
from jaxformer.layers.mlm_head import MaskedLMHead
from jaxformer.layers.norm import make_norm
from jaxformer.layers.positions import LearnedPositions
from jaxformer.models.blocks import BLOCK_AXES, EncoderBlock
from jaxformer.models.layout import StackedInit, layer_rngs
from jaxformer.models.transformer import (
  advance,
  bias_table,
  cache_positions,
  embed_tokens,
  layer_stack,
  output_logits,
  resolve_positions,
  run_stack,
  untied_output_proj,
)


class SelfAttentionStack(StackedInit, nn.Module):
  """Embedding, self-attention blocks, final norm (pre-LN) and logits.

  Shared by `DecoderOnly` (causal, `model.num_decoder_layers`) and `EncoderOnly`
  (bidirectional, `model.num_encoder_layers`); subclasses set `CAUSAL` and `STACKS` (the
  stack `layer` and the config field of its depth).

  BERT-style options: `model.type_vocab_size` adds row 0 of the param `token_types`
  `[type_vocab_size, d_model]` to every token (inputs carry no type ids, so every token is
  type 0; the other rows are kept for export only), `model.embedding_norm` normalises the
  summed embeddings (param `embedding_norm`) before dropout, and `model.mlm_head` (encoder-only)
  transforms the final states before the logits (`layers.mlm_head`, params `mlm_head`).
  """

  config: ModelConfig
  pipeline: Any = None  # a `models.pipeline.Pipeline` (training and evaluation steps on a stage mesh), or None
  CAUSAL: ClassVar[bool] = False
  STACKS: ClassVar[tuple]

  def setup(self):
    """Creates the embedding, positions, layer stack and final norm for `config`."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype, cfg.embedding_scale, name="embed")
    if not cfg.tie_embeddings:
      self.output_proj = untied_output_proj(self, cfg)
    if cfg.position == "learned":
      self.positions = LearnedPositions(cfg.max_length, cfg.d_model, dtype, offset=cfg.position_offset)
    if cfg.type_vocab_size:
      self.token_types = sh.param(
        self, "token_types", nn.initializers.normal(0.02), (None, sh.EMBED), (cfg.type_vocab_size, cfg.d_model)
      )
    if cfg.embedding_norm:
      self.embedding_norm = make_norm(cfg.norm, dtype, epsilon=cfg.norm_epsilon)
    ((name, depth),) = self.STACKS
    self.num_layers = getattr(cfg, depth)
    self.stack = layer_stack(EncoderBlock, cfg, self.num_layers, name, self.pipeline, causal=self.CAUSAL)
    self.bias_table = bias_table(self, cfg, "relative_bias")
    if cfg.pre_norm:  # pre-LN leaves the residual stream unnormalized: close the stack with a norm
      self.final_norm = make_norm(cfg.norm, dtype, epsilon=cfg.norm_epsilon)
    if cfg.mlm_head:
      self.mlm_head = MaskedLMHead(cfg)
    self.dropout = Dropout(cfg.dropout_rate)

  def _logits(
    self, tokens, valid, positions, segment_ids, deterministic: bool, cache_state: CacheState | None = None
  ) -> jax.Array:
    """Logits for int `[batch, length]` tokens; `positions`, `segment_ids` and `cache_state`
    as in `DecoderOnly.__call__`."""
    decode = cache_state is not None
    if decode and (segment_ids is not None or positions is not None):
      raise ValueError("cached decoding (cache_state) takes no segment ids or positions: rows are unpacked")
    if decode:  # attention takes the positions from the cache state itself
      positions, attn_positions = cache_positions(cache_state, tokens), None
    else:
      positions, attn_positions = resolve_positions(tokens, positions, segment_ids)
    cfg = self.config
    x = embed_tokens(cfg, self.embed, tokens, positions, getattr(self, "positions", None))
    if cfg.type_vocab_size:  # every token is type 0
      x = x + self.token_types[0].astype(x.dtype)
    if cfg.embedding_norm:
      x = self.embedding_norm(x)
    x = sh.constrain(self.dropout(x, deterministic=deterministic), BLOCK_AXES)
    x = run_stack(
      self.stack,
      x,
      valid,
      deterministic,
      decode,
      segment_ids,
      attn_positions,
      cache_state,
      self.bias_table,
      rngs=layer_rngs(self, self.num_layers, deterministic),
    )
    if cfg.pre_norm:
      x = self.final_norm(x)
    output = functools.partial(output_logits, cfg, self.embed, getattr(self, "output_proj", None), decode=decode)
    return self.mlm_head(x, output) if cfg.mlm_head else output(x)


class DecoderOnly(SelfAttentionStack):
  """Causal LM over int `[batch, length]` token ids -> float32 logits `[batch, length, vocab_size]`
  (logits at position t predict token t + 1). Layers: `model.num_decoder_layers`."""

  CAUSAL: ClassVar[bool] = True
  STACKS: ClassVar = (("layer", "num_decoder_layers"),)
  ENCODES_SOURCE: ClassVar[bool] = False  # `prefill` caches the prompt itself

  def __call__(
    self,
    inputs: jax.Array,
    targets: jax.Array | None = None,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    deterministic: bool = True,
    cache_state: CacheState | None = None,
  ) -> jax.Array:
    """Next-token logits.

    Args:
      inputs: int `[batch, length]` token ids, padded at the end with `model.pad_id`.
      targets: ignored; accepted so the model has the `(inputs, targets)` call form the
        training state's initialisation uses (the targets are the inputs shifted by one).
      positions: int `[batch, length]` positions, restarting at 0 in each segment when
        packed; None = derived from `segment_ids`, or 0..length-1.
      segment_ids: int `[batch, length]` packed-example ids (1, 2, ... per example of a
        row, 0 on padding): attention stays inside a segment. None = one example per row.
      cache_state: decode with the KV cache (`jaxformer.inference`; the "cache" collection
        mutable): row b's tokens go to positions `cache_state.lengths[b]`, ...; a prefill
        feeds the prompt (PAD-padded at the end), each later call one token. PAD tokens are
        not cached. No segment ids or positions then.

    Returns:
      float32 `[batch, length, vocab_size]`.

    Raises:
      ValueError: `segment_ids` or `positions` with `cache_state`.
    """
    del targets
    return self._logits(inputs, inputs != self.config.pad_id, positions, segment_ids, deterministic, cache_state)

  def prefill(self, prompt: jax.Array, cache_state: CacheState) -> tuple[jax.Array, CacheState]:
    """Starts cached decoding of int `[batch, T]` prompts (PAD padded at the end, at least
    one token each). Returns float32 logits `[batch, vocab_size]` of the token after each
    prompt and the state with the prompts cached."""
    logits = self(prompt, cache_state=cache_state)
    pad = self.config.pad_id
    last = jnp.sum(prompt != pad, axis=1) - 1  # [B]
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], advance(cache_state, prompt, pad)

  def extend(self, tokens: jax.Array, cache_state: CacheState) -> tuple[jax.Array, CacheState]:
    """Feeds int `[batch, T]` tokens after each row's cached ones (PAD: not fed). Returns
    float32 logits `[batch, T, vocab_size]` and the advanced state."""
    return self(tokens, cache_state=cache_state), advance(cache_state, tokens, self.config.pad_id)
