"""Sampling from a causal language model restored from its workdir, with the KV cache."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.evaluate import Restored
from jaxformer.models.transformer import PAD_ID
from jaxformer.search import check_sampling, sample_core
from jaxformer.tasks import get_task


def _init_cache(model, batch_size: int) -> Any:
  tokens = jnp.ones((batch_size, 1), jnp.int32)
  shapes = jax.eval_shape(functools.partial(model.init, decode=True), jax.random.key(0), tokens)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def _no_pad(logits: jax.Array) -> jax.Array:
  return logits.at[:, PAD_ID].set(-jnp.inf)  # PAD is never a target: never sample it


def sample_continuation(model, params, context: jax.Array, row_keys: jax.Array, num_new: int,
                        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Prefills the KV cache with `context` (int `[batch, ctx_len]`, no PAD, at positions
  0..ctx_len-1) and samples `num_new` tokens, one cached decode step each.

  Token i of row b is drawn with key fold_in(row_keys[b], i) (see `search.sample_core`);
  ctx_len + num_new must not exceed `model.max_length`. Returns int32 `[batch, num_new]`.
  """
  ctx_len = context.shape[1]
  cache = _init_cache(model, context.shape[0])
  logits, mutated = model.apply({"params": params, "cache": cache}, context, decode=True, mutable=["cache"])

  def logits_fn(tokens, cache, position):  # position i + 1 feeds generated token i
    positions = jnp.full((tokens.shape[0], 1), ctx_len + position - 1, jnp.int32)
    logits, mutated = model.apply({"params": params, "cache": cache}, tokens[:, None], positions=positions,
                                  decode=True, mutable=["cache"])
    return _no_pad(logits[:, -1]), mutated["cache"]

  return sample_core(logits_fn, _no_pad(logits[:, -1]), mutated["cache"], row_keys, max_decode_len=num_new,
                     temperature=temperature, top_k=top_k, top_p=top_p, eos_id=-1)


def generate(restored: Restored, prompt: str, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, num_samples: int = 1) -> list[str]:
  """Samples `num_samples` continuations of `prompt` (text), each `max_new_tokens` long.

  The model sees at most `window` = min(data.max_length, model.max_length) tokens, the
  context it was trained on. Generation runs in rounds: the first prefills the prompt's
  last (at most window // 2) tokens and samples until the window is full; each later
  round re-prefills the last window // 2 tokens at positions 0.. and samples window // 2
  more. The result depends only on the checkpoint, prompt, options and `seed`.

  Returns:
    The generated texts (without the prompt): each sample is decoded together with the
    prompt and the prompt's decoded text cut off, so word boundaries at the seam are kept.
  Raises:
    ValueError: an empty prompt, a character outside the vocabulary, bad sampling options.
  """
  cfg = restored.config
  if not get_task(cfg).generates:
    raise ValueError(f"generate needs a decoder_only model; this workdir holds model.kind={cfg.model.kind}")
  if not prompt:
    raise ValueError("the prompt is empty; pass --prompt TEXT (e.g. a newline)")
  if max_new_tokens < 1 or num_samples < 1:
    raise ValueError("--max-new-tokens and --num-samples must be >= 1")
  check_sampling(temperature, top_k, top_p)
  window = min(cfg.data.max_length, cfg.model.max_length)
  keep = max(window // 2, 1)
  ids = restored.tokenizer.encode(prompt)
  if not ids:
    raise ValueError(f"the prompt {prompt!r} encodes to no tokens")

  @functools.partial(jax.jit, static_argnums=(3,))
  def run(params, context, row_keys, num_new):
    return sample_continuation(restored.model, params, context, row_keys, num_new, temperature, top_k, top_p)

  seqs = np.tile(np.asarray(ids, np.int32), (num_samples, 1))
  base = jax.random.key(seed)
  round_index = 0
  while seqs.shape[1] - len(ids) < max_new_tokens:
    context = seqs[:, -keep:]
    row_keys = jax.random.split(jax.random.fold_in(base, round_index), num_samples)
    tokens = np.asarray(run(restored.params, jnp.asarray(context), row_keys, window - context.shape[1]))
    seqs = np.concatenate([seqs, tokens], axis=1)
    round_index += 1
  # Decode each continuation behind the prompt, then cut the prompt's text off: decoded
  # apart, a SentencePiece continuation would lose its leading space ("Citizen:we").
  prompt_text = restored.tokenizer.decode(ids)
  return [restored.tokenizer.decode(row)[len(prompt_text):] for row in seqs[:, :len(ids) + max_new_tokens]]
