"""Encoder-only masked language model (BERT style, Devlin et al. 2019): the paper's encoder
stack with bidirectional self-attention under a padding mask, and output logits that
predict the original token at every position (the loss keeps the masked ones).

Published BERT and RoBERTa masked LMs are this model post-LN with `model.embedding_norm`,
`model.type_vocab_size` and `model.mlm_head` (RoBERTa also `model.position_offset`); see
`interop.hf_bert_mlm`."""

from __future__ import annotations

from typing import ClassVar

import jax

from jaxformer.models.decoder_only import SelfAttentionStack


class EncoderOnly(SelfAttentionStack):
  """Masked LM over int `[batch, length]` ids -> float32 logits `[batch, length, vocab_size]`.
  Layers: `model.num_encoder_layers`. Padding (`model.pad_id`) positions are masked as keys, so appending
  padding does not change the logits of real positions."""

  STACKS: ClassVar = (("layer", "num_encoder_layers"),)

  def __call__(
    self,
    inputs: jax.Array,
    targets: jax.Array | None = None,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    deterministic: bool = True,
  ) -> jax.Array:
    """Logits for every position of `inputs` (ids with [MASK] substitutions already made).

    Args:
      inputs: int `[batch, length]` ids, padded with `model.pad_id`.
      targets: ignored; accepted so the model has the `(inputs, targets)` call form the
        training state's initialisation uses.
      positions: int `[batch, length]` positions, restarting at 0 in each segment when
        packed; None = derived from `segment_ids`, or 0..length-1.
      segment_ids: int `[batch, length]` packed-example ids (1, 2, ... per example of a
        row, 0 on padding): attention stays inside a segment. None = one example per row.

    Returns:
      float32 `[batch, length, vocab_size]`.
    """
    del targets
    return self._logits(inputs, inputs != self.config.pad_id, positions, segment_ids, deterministic)
