"""Masked language modelling with the encoder-only model (`model.kind=encoder_only`, BERT,
Devlin et al. 2019 section 3.1).

Each real token is selected with probability `data.mask_probability`; a selected token
becomes [MASK] (80%), a random token (10%) or stays (10%), and only selected tokens carry
loss weight. The masking runs on device inside the jitted step. [MASK] is the model's last
id, `model.vocab_size - 1`, so the tokenizer has one id fewer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer import data as D
from jaxformer.inference.search import source_row_keys
from jaxformer.models.encoder_only import EncoderOnly
from jaxformer.models.transformer import PAD_ID
from jaxformer.tasks.base import Outputs
from jaxformer.tasks.causal_lm import CausalLM, lm_outputs

_EVAL_MASK_KEY = 0        # eval masks: this key folded with each row's tokens
_SENTENCEPIECE_SPECIALS = 4  # PAD, UNK, BOS, EOS: never drawn as random replacements


def mlm_mask(row_keys: jax.Array, tokens: jax.Array, mask_id: int, random_low: int,
             probability: float = 0.15, pad_id: int = PAD_ID) -> tuple[jax.Array, jax.Array]:
  """BERT's corruption of int `[batch, length]` `tokens`, one key per row (`row_keys` `[batch]`).

  A non-padding (`pad_id`) token is selected with `probability`; a selected token is replaced by
  `mask_id` with probability 0.8, by a uniform random id in `[random_low, mask_id)` with
  probability 0.1, and kept with probability 0.1.

  Returns:
    (int32 corrupted inputs `[batch, length]`, float32 loss weights `[batch, length]`:
    1 on selected tokens, else 0).
  """
  def row(key, ids):
    k_select, k_kind, k_random = jax.random.split(key, 3)
    selected = jax.random.bernoulli(k_select, probability, ids.shape) & (ids != pad_id)
    kind = jax.random.uniform(k_kind, ids.shape)
    random_ids = jax.random.randint(k_random, ids.shape, random_low, mask_id)
    corrupted = jnp.where(kind < 0.8, mask_id, jnp.where(kind < 0.9, random_ids, ids))
    return jnp.where(selected, corrupted, ids).astype(jnp.int32), selected.astype(jnp.float32)
  return jax.vmap(row)(row_keys, tokens)


class MaskedLM(CausalLM):
  """Token windows (targets = inputs) -> `EncoderOnly` with BERT masking."""
  kind = "encoder_only"
  data_kind = D.TEXT
  reserved_ids = 1   # [MASK]
  needs_rng = True
  generates = False
  shift = False

  def make_model(self) -> EncoderOnly:
    """`Task.make_model`: an `EncoderOnly` model."""
    return EncoderOnly(self.config.model)

  @property
  def mask_id(self) -> int:
    """The [MASK] token id: the last id of the vocabulary."""
    return self.config.model.vocab_size - 1

  def outputs(self, model, params, batch, rng):
    """Masked inputs; `rng` None (evaluation) draws masks from a fixed key folded with each
    row's tokens, so the same windows always get the same masks whatever the batching."""
    inputs = batch["inputs"]
    if rng is None:
      keys = source_row_keys(jax.random.key(_EVAL_MASK_KEY), inputs)
    else:
      keys = jax.random.split(jax.random.fold_in(rng, 1), inputs.shape[0])  # a stream apart from dropout's
    random_low = 1 if self.config.data.tokenizer == "char" and not self.config.data.tokenizer_model \
        else _SENTENCEPIECE_SPECIALS
    corrupted, weights = mlm_mask(keys, inputs, self.mask_id, random_low, self.config.data.mask_probability,
                                  self.config.model.pad_id)
    logits, aux = lm_outputs(model, params, batch, rng, corrupted)
    return Outputs(logits, inputs, weights, aux)
