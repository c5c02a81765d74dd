"""What each model kind learns from a batch: the model, its logits, targets and loss weights.

  * encoder_decoder (translation): logits of `targets` given `inputs` (teacher forcing).
  * decoder_only (causal LM): logits of `inputs`; the batch's `targets` are the inputs
    shifted one token ahead (the data pipeline makes the windows).
  * encoder_only (masked LM, Devlin et al. 2019 section 3.1): each real token is selected
    with probability `data.mask_probability`; a selected token becomes [MASK] (80%), a
    random token (10%) or stays (10%), and only selected tokens carry loss weight. The
    masking runs on device inside the jitted step.

Loss weights are 1 for real (non-PAD) targets and 0 for padding in every kind.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.config import Config
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.models.encoder_only import EncoderOnly
from jaxformer.models.transformer import PAD_ID, EncoderDecoder
from jaxformer.search import source_row_keys

_EVAL_MASK_KEY = 0        # eval masks: this key folded with each row's tokens
_SENTENCEPIECE_SPECIALS = 4  # PAD, UNK, BOS, EOS: never drawn as random replacements


def make_model(config: Config) -> nn.Module:
  """The model of `model.kind`."""
  cls = {"encoder_decoder": EncoderDecoder, "decoder_only": DecoderOnly, "encoder_only": EncoderOnly}
  return cls[config.model.kind](config.model)


def mask_token_id(config: Config) -> int:
  """Masked LM: [MASK] is the last id, `model.vocab_size - 1` (the tokenizer has one id fewer)."""
  return config.model.vocab_size - 1


def mlm_mask(row_keys: jax.Array, tokens: jax.Array, mask_id: int, random_low: int,
             probability: float = 0.15) -> tuple[jax.Array, jax.Array]:
  """BERT's corruption of int `[batch, length]` `tokens`, one key per row (`row_keys` `[batch]`).

  A non-PAD token is selected with `probability`; a selected token is replaced by
  `mask_id` with probability 0.8, by a uniform random id in `[random_low, mask_id)` with
  probability 0.1, and kept with probability 0.1.

  Returns:
    (int32 corrupted inputs `[batch, length]`, float32 loss weights `[batch, length]`:
    1 on selected tokens, else 0).
  """
  def row(key, ids):
    k_select, k_kind, k_random = jax.random.split(key, 3)
    selected = jax.random.bernoulli(k_select, probability, ids.shape) & (ids != PAD_ID)
    kind = jax.random.uniform(k_kind, ids.shape)
    random_ids = jax.random.randint(k_random, ids.shape, random_low, mask_id)
    corrupted = jnp.where(kind < 0.8, mask_id, jnp.where(kind < 0.9, random_ids, ids))
    return jnp.where(selected, corrupted, ids).astype(jnp.int32), selected.astype(jnp.float32)
  return jax.vmap(row)(row_keys, tokens)


class Task:
  """Binds a model to its kind's training objective; see the module docstring."""

  def __init__(self, model: nn.Module, config: Config):
    self.model = model
    self.kind = config.model.kind
    self.mask_id = mask_token_id(config)
    self.random_low = 1 if config.data.tokenizer == "char" else _SENTENCEPIECE_SPECIALS
    self.mask_probability = config.data.mask_probability

  @property
  def needs_rng(self) -> bool:
    """Whether the train step must pass a key even without dropout (MLM masking)."""
    return self.kind == "encoder_only"

  def outputs(self, params: Any, batch: dict[str, jax.Array],
              rng: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(float32 logits `[batch, length, vocab]`, int targets `[batch, length]`, float32 weights).

    `rng` None means evaluation: dropout off, and MLM masks drawn from a fixed key folded
    with each row's tokens (the same windows always get the same masks, whatever the
    batching). Otherwise `rng` is the step's key (dropout and MLM masks).
    """
    rngs = None if rng is None else {"dropout": rng}
    apply = lambda inputs, targets: self.model.apply(  # noqa: E731
        {"params": params}, inputs, targets, deterministic=rng is None, rngs=rngs)
    inputs, targets = batch["inputs"], batch["targets"]
    if self.kind == "encoder_only":
      if rng is None:
        keys = source_row_keys(jax.random.key(_EVAL_MASK_KEY), inputs)
      else:
        keys = jax.random.split(jax.random.fold_in(rng, 1), inputs.shape[0])  # a stream apart from dropout's
      corrupted, weights = mlm_mask(keys, inputs, self.mask_id, self.random_low, self.mask_probability)
      return apply(corrupted, None), inputs, weights
    logits = apply(inputs, targets if self.kind == "encoder_decoder" else None)
    return logits, targets, (targets != PAD_ID).astype(jnp.float32)
