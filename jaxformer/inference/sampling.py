"""Sampling: its options (temperature, top-k, top-p, seed), checked in one line each; the
filtered next-token distribution; and per-row keys, so a row's sample depends only on the seed,
its own input ids and its own options, never on its batch-mates or padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.models.transformer import PAD_ID


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
  """Raises ValueError (one line) unless temperature > 0, top_k is an int >= 0 and top_p is in (0, 1]."""
  if not temperature > 0.0:
    raise ValueError(f"temperature must be > 0 (for temperature -> 0 use greedy search), got {temperature}")
  if not isinstance(top_k, int) or top_k < 0:
    raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")


def sampling_values(temperature: float | None, top_k: int | None, top_p: float | None) -> tuple[float, int, float]:
  """(temperature, top_k, top_p) with the unset (None) ones at their 'off' values 1.0, 0, 1.0."""
  return (1.0 if temperature is None else temperature, 0 if top_k is None else top_k, 1.0 if top_p is None else top_p)


def check_seed(seed: int) -> None:
  """Raises ValueError (one line) unless `seed` is an integer in [0, 2**32) (a JAX key's range)."""
  if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
    raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def filter_logits(
  logits: jax.Array, temperature: jax.Array | float = 1.0, top_k: jax.Array | int = 0, top_p: jax.Array | float = 1.0
) -> jax.Array:
  """float32 `[vocab]` logits / temperature, with tokens outside the top k (k > 0) and then
  outside the nucleus (the smallest set of most probable tokens whose probability reaches
  top_p; Holtzman et al. 2019) set to -inf. The most probable token is always kept; ties
  keep the lower ids. The options may be traced scalars (a different one per row under vmap)."""
  vocab = logits.shape[-1]
  logits = logits.astype(jnp.float32) / temperature

  def nucleus(logits):
    order = jnp.argsort(-logits, stable=True)  # most probable first, lower ids on ties
    rank_ok = jnp.arange(vocab) < jnp.where(top_k > 0, top_k, vocab)
    sorted_logits = jnp.where(rank_ok, logits[order], -jnp.inf)
    probs = jax.nn.softmax(sorted_logits)
    keep_sorted = rank_ok & (jnp.cumsum(probs) - probs < top_p)  # mass strictly before the token
    return jnp.where(jnp.zeros((vocab,), bool).at[order].set(keep_sorted), logits, -jnp.inf)

  return jax.lax.cond(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0), nucleus, lambda x: x, logits)


def source_row_keys(rng: jax.Array, inputs: jax.Array, pad_id: int = PAD_ID) -> jax.Array:
  """One key per row, `rng` folded in with the row's input ids but padding (`pad_id`), in order.

  A row's key depends only on `rng` and its own tokens, not on its position in the batch,
  its neighbours or how much padding the batch adds; identical inputs share a key.
  Returns keys `[batch]` of `rng`'s kind (typed or raw uint32 `[batch, 2]`).
  """

  def fold(key, token):
    return jnp.where(token != pad_id, jax.random.fold_in(key, token), key), None

  def row(tokens):
    return jax.lax.scan(fold, rng, tokens)[0]

  return jax.vmap(row)(inputs.astype(jnp.int32))


def sample_tokens(logits: jax.Array, row_keys: jax.Array, index: jax.Array, temperature, top_k, top_p) -> jax.Array:
  """Token `index` of each row drawn from `filter_logits` of float `[rows, vocab]` logits
  with key `fold_in(row_keys[r], index)` (int32 `[rows]`); `index` and the options are
  scalars or `[rows]` arrays, so a row's draw depends only on its own key and options."""

  def draw(key, logits, i, t, k, p):
    return jax.random.categorical(jax.random.fold_in(key, i), filter_logits(logits, t, k, p))

  rows = logits.shape[0]
  per_row = [jnp.broadcast_to(jnp.asarray(a), (rows,)) for a in (index, temperature, top_k, top_p)]
  return jax.vmap(draw)(row_keys, logits, *per_row).astype(jnp.int32)
