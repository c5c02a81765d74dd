"""Sampling text from a causal language model restored from its workdir, with the KV cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.inference.decode import Draft, start
from jaxformer.inference.restore import Restored
from jaxformer.inference.sampling import check_sampling, check_seed
from jaxformer.inference.search import sample_core
from jaxformer.inference.speculative import speculative_greedy
from jaxformer.tasks import get_task


def sample_continuation(
  model,
  params,
  context: jax.Array,
  row_keys: jax.Array,
  num_new: int,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
) -> jax.Array:
  """Prefills the KV cache with `context` (int `[batch, ctx_len]`, no PAD) and samples
  `num_new` tokens, one cached decode step each.

  Token i of row b is drawn with key fold_in(row_keys[b], i) (see `search.sample_core`);
  ctx_len + num_new must not exceed `model.max_length`. Returns int32 `[batch, num_new]`.
  """
  logits, cache, logits_fn = start(model, params, context, num_new)
  return sample_core(
    logits_fn,
    logits,
    cache,
    row_keys,
    max_decode_len=num_new,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    eos_id=-1,
  )


def generate(
  restored: Restored,
  prompt: str,
  max_new_tokens: int,
  *,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  num_samples: int = 1,
  draft: Draft | None = None,
) -> list[str]:
  """Samples `num_samples` continuations of `prompt` (text), each `max_new_tokens` long.

  The model sees at most `window` = min(data.max_length, model.max_length) tokens, the
  context it was trained on. Generation runs in rounds: the first prefills the prompt's
  last (at most window // 2) tokens and samples until the window is full; each later
  round re-prefills the last window // 2 tokens at positions 0.. and samples window // 2
  more. The result depends only on the checkpoint, prompt, options and `seed`. A `draft`
  (top_k = 1 only, which is greedy) runs each round speculatively, with the same tokens.

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
  check_seed(seed)
  if draft is not None and top_k != 1:
    raise ValueError("speculative decoding (a draft model) is greedy: pass --top-k 1")
  window = min(cfg.data.max_length, cfg.model.max_length)
  keep = max(window // 2, 1)
  ids = restored.tokenizer.encode(prompt)
  if not ids:
    raise ValueError(f"the prompt {prompt!r} encodes to no tokens")

  @functools.partial(jax.jit, static_argnums=(3,))
  def run(params, context, row_keys, num_new):
    if draft is not None:
      return speculative_greedy(
        restored.model, params, draft.model, draft.params, context, num_new, draft.num_tokens, eos_id=-1
      )[0]
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
  return [restored.tokenizer.decode(row)[len(prompt_text) :] for row in seqs[:, : len(ids) + max_new_tokens]]
