"""Speculative greedy decoding (Leviathan et al. 2023; Chen et al. 2023): a small draft model
proposes k tokens one by one, the target model scores all of them in one `extend` pass, and
the longest prefix the target agrees with is kept, plus the target's own next token.

With greedy search on both sides the output is the target's greedy output, token for token:
every kept token is the target's argmax after the tokens before it. Rejected proposals are
undone by setting the rows' cache lengths back (`KVCache.state.lengths`); their keys and
values stay in the cache but are masked and later overwritten. Rows accept different numbers
of tokens per round, which per-row lengths allow.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.inference import cache as kv
from jaxformer.inference import topk
from jaxformer.inference.quantize import decoding_params


def _last_valid(logits: jax.Array, tokens: jax.Array, pad_id: int) -> jax.Array:
  """Logits `[batch, vocab]` at each row's last position of `tokens` `[batch, T]` that is not `pad_id`."""
  last = jnp.maximum(jnp.sum(tokens != pad_id, axis=1) - 1, 0)
  return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]


def _set_lengths(cache: kv.KVCache, lengths: jax.Array) -> kv.KVCache:
  return kv.KVCache(cache.layers, cache.state.replace(lengths=lengths))


def _capacity(model: nn.Module, inputs: jax.Array, max_decode_len: int, k: int) -> int:
  prompt = 0 if model.ENCODES_SOURCE else inputs.shape[1]
  return prompt + max_decode_len + k + 2  # a round may write k + 1 tokens past the last kept one


def speculative_greedy(
  target: nn.Module,
  target_params: Any,
  draft: nn.Module,
  draft_params: Any,
  inputs: jax.Array,
  max_decode_len: int,
  num_draft_tokens: int = 4,
  eos_id: int | None = None,
  row_limits: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Greedy decoding of `target` sped up by `draft` (same vocabulary). Jittable.

  Args:
    inputs: int `[batch, len]` sources (encoder-decoder) or prompts (decoder-only), padded with
      `model.pad_id` (the target's and the draft's special ids must agree).
    max_decode_len: tokens to generate at most per row, EOS included.
    num_draft_tokens: k >= 1 tokens the draft proposes per round.
    eos_id: the end token; None: the target's `model.eos_id`.
    row_limits: int32 `[batch]` per-row caps (<= max_decode_len), as in `search`; None: none.

  Returns:
    int32 `[batch, max_decode_len]` tokens through EOS then PAD (equal to the target's greedy
    output), int32 `[batch]` draft tokens accepted and int32 `[batch]` rounds run per row
    (acceptance rate = accepted / (k * rounds)).

  Raises:
    ValueError: num_draft_tokens < 1.
  """
  k, length = num_draft_tokens, max_decode_len
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"the draft must propose >= 1 token per round, got {num_draft_tokens!r}")
  target_params, draft_params = decoding_params(target_params), decoding_params(draft_params)
  pad = target.config.pad_id
  eos_id = target.config.eos_id if eos_id is None else eos_id
  batch = inputs.shape[0]
  tcache = kv.contiguous_cache(target, target_params, batch, inputs.shape[1], _capacity(target, inputs, length, k))
  dcache = kv.contiguous_cache(draft, draft_params, batch, inputs.shape[1], _capacity(draft, inputs, length, k))
  t_logits, tcache = kv.prefill(target, target_params, tcache, inputs)
  _, dcache = kv.prefill(draft, draft_params, dcache, inputs)
  first = jnp.argmax(kv.no_pad(t_logits, pad), axis=-1).astype(jnp.int32)  # [B]
  out = jnp.full((batch, length), pad, jnp.int32).at[:, 0].set(first)
  limits = jnp.full((batch,), length, jnp.int32) if row_limits is None else row_limits
  finished = (first == eos_id) | (limits <= 1)
  catch_up = jnp.stack([first, jnp.full_like(first, pad)], axis=1)  # [B, 2]: not in the draft yet
  zeros = jnp.zeros((batch,), jnp.int32)
  carry = (tcache, dcache, first, catch_up, out, jnp.ones((batch,), jnp.int32), finished, zeros, zeros)

  def body(carry):
    tcache, dcache, pending, catch_up, out, count, finished, accepted, rounds = carry
    live = ~finished
    # Draft: catch up on the kept tokens it has not seen, then propose k tokens greedily.
    catch_up = jnp.where(live[:, None], catch_up, pad)
    logits, dcache = kv.extend(draft, draft_params, dcache, catch_up)
    proposal = [topk.argmax(kv.no_pad(_last_valid(logits, catch_up, pad), pad))]
    for _ in range(k - 1):
      logits, dcache = kv.step(draft, draft_params, dcache, jnp.where(live, proposal[-1], pad))
      proposal.append(topk.argmax(kv.no_pad(logits, pad)))
    proposal = jnp.stack(proposal, axis=1)  # [B, k]
    # Target: score the pending token and the k proposals in one pass.
    fed = jnp.where(live[:, None], jnp.concatenate([pending[:, None], proposal], axis=1), pad)
    t_lengths = tcache.state.lengths
    logits, tcache = kv.extend(target, target_params, tcache, fed)
    greedy = topk.argmax(kv.no_pad(logits, pad))  # [B, k + 1]
    n = jnp.sum(jnp.cumprod(proposal == greedy[:, :k], axis=1), axis=1)  # accepted proposals
    n = jnp.where(live, n, 0)
    # Kept: greedy[0..n] (the accepted proposals equal the target's argmax, then its own token).
    j = jnp.arange(k + 1)[None]
    is_eos = (greedy == eos_id) & (j <= n[:, None])
    stop = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), n)  # last kept index
    stop = jnp.minimum(stop, limits - count - 1)  # the row's cap
    keep = (j <= stop[:, None]) & live[:, None]
    slot = jnp.where(keep, count[:, None] + j, length)  # past the end: dropped
    out = out.at[jnp.arange(batch)[:, None], slot].set(greedy, mode="drop")
    new_count = count + jnp.where(live, stop + 1, 0)
    finished = finished | is_eos.any(axis=1) | (new_count >= limits)
    # Roll back what was rejected: the target keeps pending + n proposals, the draft its catch-up + n.
    tcache = _set_lengths(tcache, jnp.where(live, t_lengths + n + 1, t_lengths))
    d_lengths = dcache.state.lengths - jnp.where(live, (k - 1) - jnp.minimum(n, k - 1), 0)
    dcache = _set_lengths(dcache, d_lengths)
    next_pending = jnp.take_along_axis(greedy, n[:, None], axis=1)[:, 0]
    last_proposal = proposal[:, k - 1]
    catch_up = jnp.where(
      (n == k)[:, None],
      jnp.stack([last_proposal, next_pending], axis=1),
      jnp.stack([next_pending, jnp.full_like(n, pad)], axis=1),
    )
    return (
      tcache,
      dcache,
      next_pending,
      catch_up,
      out,
      new_count,
      finished,
      accepted + n,
      rounds + live.astype(jnp.int32),
    )

  carry = jax.lax.while_loop(lambda c: ~jnp.all(c[6]), body, carry)
  return carry[4], carry[7], carry[8]
