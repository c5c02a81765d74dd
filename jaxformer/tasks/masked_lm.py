"""Masked language modelling with the encoder-only model (`model.kind=encoder_only`, BERT,
Devlin et al. 2019 section 3.1).

Each real token is selected with probability `data.mask_probability`; a selected token
becomes [MASK] (80%), a random token (10%) or stays (10%), and only selected tokens carry
loss weight. The masking runs on device inside the jitted step. [MASK] is `model.mask_id`
(an imported BERT's tokenizer token) or, when that is -1, the model's last id,
`model.vocab_size - 1`, kept beyond the tokenizer's ids (ours).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer import data as D
from jaxformer.inference.sampling import source_row_keys
from jaxformer.models.encoder_only import EncoderOnly
from jaxformer.models.transformer import PAD_ID
from jaxformer.tasks.base import Outputs
from jaxformer.tasks.causal_lm import CausalLM, lm_outputs

_EVAL_MASK_KEY = 0  # eval masks: this key folded with each row's tokens
_SENTENCEPIECE_SPECIALS = 4  # our PAD, UNK, BOS, EOS: never drawn as random replacements


def random_ids(key: jax.Array, shape: tuple[int, ...], vocab_size: int, never_drawn: tuple[int, ...]) -> jax.Array:
  """Int32 ids of `shape`, uniform over `[0, vocab_size)` less the sorted, distinct ids `never_drawn`.

  A draw r in `[0, vocab_size - len(never_drawn))` steps over each excluded id at or below it in
  increasing order, a bijection onto the allowed ids.
  """
  ids = jax.random.randint(key, shape, 0, vocab_size - len(never_drawn))
  for special in never_drawn:
    ids = ids + (ids >= special)
  return ids.astype(jnp.int32)


def mlm_mask(
  row_keys: jax.Array,
  tokens: jax.Array,
  mask_id: int,
  vocab_size: int,
  never_drawn: tuple[int, ...],
  probability: float = 0.15,
  pad_id: int = PAD_ID,
) -> tuple[jax.Array, jax.Array]:
  """BERT's corruption of int `[batch, length]` `tokens`, one key per row (`row_keys` `[batch]`).

  A non-padding (`pad_id`) token is selected with `probability`; a selected token is replaced by
  `mask_id` with probability 0.8, by a uniform random id of `[0, vocab_size)` other than the
  sorted ids `never_drawn` (the special tokens, [MASK] among them) with probability 0.1, and kept
  with probability 0.1.

  Returns:
    (int32 corrupted inputs `[batch, length]`, float32 loss weights `[batch, length]`:
    1 on selected tokens, else 0).
  """

  def row(key, ids):
    k_select, k_kind, k_random = jax.random.split(key, 3)
    selected = jax.random.bernoulli(k_select, probability, ids.shape) & (ids != pad_id)
    kind = jax.random.uniform(k_kind, ids.shape)
    replacements = random_ids(k_random, ids.shape, vocab_size, never_drawn)
    corrupted = jnp.where(kind < 0.8, mask_id, jnp.where(kind < 0.9, replacements, ids))
    return jnp.where(selected, corrupted, ids).astype(jnp.int32), selected.astype(jnp.float32)

  return jax.vmap(row)(row_keys, tokens)


class MaskedLM(CausalLM):
  """Token windows (targets = inputs) -> `EncoderOnly` with BERT masking."""

  kind = "encoder_only"
  data_kind = D.TEXT
  needs_rng = True
  generates = False
  benchable = False
  attention_maps = (("layer", "self_attention", "encoder self-attention"),)
  mlm_head = True
  shift = False

  def make_model(self) -> EncoderOnly:
    """`Task.make_model`: an `EncoderOnly` model."""
    return EncoderOnly(self.config.model)

  @property
  def reserved_ids(self) -> int:
    """1 when [MASK] is the model's last id, beyond the tokenizer's (ours); 0 when the tokenizer has it."""
    return 0 if self.config.model.mask_id >= 0 else 1

  @property
  def mask_id(self) -> int:
    """The [MASK] token id: `model.mask_id`, or the last id of the vocabulary when that is -1."""
    m = self.config.model
    return m.mask_id if m.mask_id >= 0 else m.vocab_size - 1

  @functools.cached_property
  def never_drawn(self) -> tuple[int, ...]:
    """The sorted ids a random replacement never takes: the tokenizer's special tokens and [MASK]."""
    data, ids = self.config.data, self.config.model.special_ids
    if data.tokenizer == "hf":
      from jaxformer.data.tokenizer_hf import HFTokenizer  # noqa: PLC0415  (the hf extra)

      specials = {ids.pad, ids.bos, ids.eos, *HFTokenizer.load(data.tokenizer_model).added_token_ids}
    elif data.tokenizer == "char" and not data.tokenizer_model:
      specials = {ids.pad}
    else:
      specials = set(range(_SENTENCEPIECE_SPECIALS))
    return tuple(sorted(i for i in specials | {self.mask_id} if i >= 0))

  def outputs(self, model, params, batch, rng):
    """Masked inputs; `rng` None (evaluation) draws masks from a fixed key folded with each
    row's tokens, so the same windows always get the same masks whatever the batching."""
    inputs = batch["inputs"]
    if rng is None:
      keys = source_row_keys(jax.random.key(_EVAL_MASK_KEY), inputs, self.config.model.pad_id)
    else:
      keys = jax.random.split(jax.random.fold_in(rng, 1), inputs.shape[0])  # a stream apart from dropout's
    m = self.config.model
    corrupted, weights = mlm_mask(
      keys, inputs, self.mask_id, m.vocab_size, self.never_drawn, self.config.data.mask_probability, m.pad_id
    )
    logits, aux = lm_outputs(model, params, batch, rng, corrupted)
    return Outputs(logits, inputs, weights, aux)
