"""Greedy search, sampling and beam search as strategies of one decode loop.

The loop (`decode_loop`) is model-free: it drives a `logits_fn(tokens, cache, position) ->
(logits, cache)` closure inside `jax.lax.while_loop`, so tests can give it a hand-written
next-token distribution. A strategy turns each step's logits into the tokens to feed (and,
for beam search, the rows whose cache each new row continues).

Token conventions: the first token (0-based index 0) comes from the prefill's logits; the
i-th generated token is fed at loop position i + 1. Outputs are int32 `[batch,
max_decode_len]` holding each row's tokens up to and including EOS, then PAD.

Optional `row_limits` (int32 `[batch]`, each in [1, max_decode_len]) cap each row on its own:
a row stops after `row_limits[b]` tokens exactly as if decoded alone with that
`max_decode_len`, so a sentence's output never depends on its batch-mates (the paper's
"input length + 50" is per sentence).

Sampling's options and per-row draws are in `inference.sampling`.

Defaults follow the paper (Vaswani et al. 2017, section 6.1): beam size 4, length penalty
alpha = 0.6, maximum output length = input length + 50.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.data.special_ids import SpecialIds
from jaxformer.inference import topk
from jaxformer.inference.cache import reorder_beams, repeat_rows
from jaxformer.inference.sampling import check_sampling, sample_tokens
from jaxformer.models.transformer import PAD_ID

EOS_ID = SpecialIds().eos  # our tokenizers'; the decode functions take the model's (`model.eos_id`)
BEAM_SIZE = 4  # paper section 6.1
LENGTH_PENALTY = 0.6  # paper section 6.1 (alpha of Wu et al. 2016)
EXTRA_TOKENS = 50  # paper section 6.1: maximum output length = input length + 50

# logits_fn(tokens int32 [rows], cache, position int32 scalar) -> (float logits [rows, vocab], cache)
LogitsFn = Callable[[jax.Array, Any, jax.Array], "tuple[jax.Array, Any]"]


def length_penalty(length: jax.Array | int, alpha: float) -> jax.Array:
  """GNMT length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al. 2016, eq. 14).

  `length` counts generated tokens, EOS included (BOS excluded); float32 result with
  length's shape. A hypothesis scores `sum log p(y_t) / lp(Y)`; alpha = 0 gives raw log-prob.
  """
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


# ----------------------------------------------------------------------------- the one loop


class Strategy(NamedTuple):
  """How a decode loop turns logits into tokens.

  init(logits [batch, vocab]) -> search state; step(state, logits [rows, vocab], i) ->
  (state, tokens [rows], parent int [batch, beam] or None: the rows whose cache each new row
  continues), where step 0 gets the prefill's `[batch, vocab]` logits (a sentence's beams start alike);
  done(state) -> bool scalar (every row finished); `rows_per_input` rows decode each input
  row (the beam size, else 1).
  """

  init: Callable
  step: Callable
  done: Callable
  rows_per_input: int = 1


def decode_loop(
  logits_fn: LogitsFn,
  init_logits: jax.Array,
  cache: Any,
  strategy: Strategy,
  max_decode_len: int,
  cache_batch_axis: int = 0,
) -> tuple[Any, Any]:
  """Runs `strategy` for at most `max_decode_len` tokens or until it is done; returns its final
  state and the final cache.

  Token 0 comes from `init_logits`; each loop step feeds the last tokens to `logits_fn` and
  picks the next ones, so `max_decode_len` tokens take `max_decode_len - 1` model calls. The
  cache is repeated per beam first and, when a step returns parents, reordered
  (`cache.reorder_beams`: for a `KVCache`, only its per-row bookkeeping) before the chosen
  tokens are fed.
  """
  k = strategy.rows_per_input
  if k > 1:
    cache = repeat_rows(cache, k, cache_batch_axis)

  def cond(carry):
    i, _, _, _, state = carry
    return (i < max_decode_len) & ~strategy.done(state)

  def body(carry):
    i, cache, tokens, parent, state = carry
    if parent is not None:
      cache = reorder_beams(cache, parent)
    logits, cache = logits_fn(tokens, cache, i)
    state, tokens, parent = strategy.step(state, logits.astype(jnp.float32), i)
    return i + 1, cache, tokens, parent, state

  init_logits = init_logits.astype(jnp.float32)
  state, tokens, parent = strategy.step(strategy.init(init_logits), init_logits, 0)
  _, cache, _, _, state = jax.lax.while_loop(cond, body, (jnp.array(1, jnp.int32), cache, tokens, parent, state))
  return state, cache


def token_strategy(
  choose: Callable[[jax.Array, jax.Array], jax.Array],
  max_decode_len: int,
  eos_id: int = EOS_ID,
  pad_id: int = PAD_ID,
  row_limits: jax.Array | None = None,
) -> Strategy:
  """One token per row per step, `choose(logits [batch, vocab], i) -> tokens [batch]`
  (argmax: greedy; a draw: sampling). State: (out int32 `[batch, L]`, finished `[batch]`);
  a row that emitted `eos_id` or reached its `row_limits` entry is fed `pad_id` (the model's
  padding: not cached) from then on, and its later columns hold `pad_id`."""

  def init(logits):
    batch = logits.shape[0]
    return jnp.full((batch, max_decode_len), pad_id, jnp.int32), jnp.zeros((batch,), bool)

  def step(state, logits, i):
    out, finished = state
    token = jnp.where(finished, pad_id, choose(logits, i).astype(jnp.int32))
    finished = finished | (token == eos_id)
    if row_limits is not None:
      finished = finished | (i + 1 >= row_limits)
    return (out.at[:, i].set(token), finished), token, None

  return Strategy(init, step, lambda state: jnp.all(state[1]))


def greedy_strategy(
  max_decode_len: int, eos_id: int = EOS_ID, pad_id: int = PAD_ID, row_limits: jax.Array | None = None
) -> Strategy:
  """Greedy search: the highest-scoring token at every step."""
  return token_strategy(lambda logits, i: topk.argmax(logits), max_decode_len, eos_id, pad_id, row_limits)


def sample_strategy(
  row_keys: jax.Array,
  max_decode_len: int,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  eos_id: int = EOS_ID,
  pad_id: int = PAD_ID,
  row_limits: jax.Array | None = None,
) -> Strategy:
  """Ancestral sampling: token i of row b from `filter_logits` with key `fold_in(row_keys[b], i)`."""
  return token_strategy(
    lambda logits, i: sample_tokens(logits, row_keys, i, temperature, top_k, top_p),
    max_decode_len,
    eos_id,
    pad_id,
    row_limits,
  )


class BeamState(NamedTuple):
  """The beam search loop state: per row, `beam` live hypotheses with their log-probabilities,
  `beam` finished ones with their scores, and whether the row is done (shapes in the comments)."""

  live_seqs: jax.Array  # int32 [batch, beam, L]
  live_logp: jax.Array  # float32 [batch, beam]
  fin_seqs: jax.Array  # int32 [batch, beam, L]
  fin_scores: jax.Array  # float32 [batch, beam]
  done: jax.Array  # bool [batch]


def _take(x, idx):  # x [B, M, ...] gathered at idx [B, K'] along axis 1
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def check_beam_options(beam_size: int, max_decode_len: int, alpha: float) -> None:
  """Raises ValueError (one line) unless beam_size and max_decode_len are integers >= 1 and the
  length-penalty alpha is >= 0."""
  if not isinstance(beam_size, int) or beam_size < 1:
    raise ValueError(f"beam_size must be an integer >= 1, got {beam_size!r}")
  if not isinstance(max_decode_len, int) or max_decode_len < 1:
    raise ValueError(f"max_decode_len must be an integer >= 1, got {max_decode_len!r}")
  if not alpha >= 0.0:
    raise ValueError(f"length penalty alpha must be >= 0, got {alpha}")


def beam_strategy(
  beam_size: int,
  max_decode_len: int,
  alpha: float = LENGTH_PENALTY,
  eos_id: int = EOS_ID,
  pad_id: int = PAD_ID,
  row_limits: jax.Array | None = None,
) -> Strategy:
  """Beam search with a separate finished set and per-row early stopping.

  Each step scores the K*vocab extensions of the live beams and keeps the top 2K. EOS
  candidates among the top K leave the beam into the finished set (its best K by score
  `sum log p / lp(|Y|)`); the best K non-EOS candidates become the live beams, so the beam
  stays full. A row stops (its state frozen) once its best finished score is >= the best any
  live beam can still reach, `max live log-prob / lp(L)` (log-probs only fall and lp grows
  with alpha >= 0), where L is the row's `row_limits` entry (default `max_decode_len`); a row
  also stops once its hypotheses are L tokens long. With K = 1 and alpha = 0 this is greedy search.

  Raises:
    ValueError: beam_size or max_decode_len < 1, alpha < 0.
  """
  check_beam_options(beam_size, max_decode_len, alpha)
  k, length = beam_size, max_decode_len
  neg_inf = jnp.float32(-jnp.inf)
  best_possible_lp = length_penalty(length if row_limits is None else row_limits, alpha)

  def init(logits):
    batch, vocab = logits.shape
    if vocab < 2:
      raise ValueError(f"beam search needs a vocabulary of at least 2 tokens, got {vocab}")
    seqs = jnp.full((batch, k, length), pad_id, jnp.int32)
    first = jnp.broadcast_to(jnp.where(jnp.arange(k) == 0, 0.0, neg_inf), (batch, k)).astype(jnp.float32)
    return BeamState(seqs, first, seqs, jnp.full((batch, k), neg_inf), jnp.zeros((batch,), bool))

  def step(s: BeamState, logits, i):
    batch, vocab = s.live_logp.shape[0], logits.shape[-1]
    # The best 2K extensions of a sentence are among the best 2K of each of its beams: take
    # those first, so no [batch, K * vocab] array of log-probs is built.
    per_beam = min(2 * k, vocab)
    top_logp, top_tok = topk.top_k_log_probs(logits, per_beam)  # [B*K, P]
    if logits.shape[0] != batch * k:  # step 0: one row per sentence, the same for its beams
      top_logp, top_tok = jnp.repeat(top_logp, k, axis=0), jnp.repeat(top_tok, k, axis=0)
    flat = (s.live_logp.reshape(-1, 1) + top_logp).reshape(batch, k * per_beam)
    cand_logp, cand_idx = jax.lax.top_k(flat, 2 * k)  # [B, 2K]
    cand_beam = cand_idx // per_beam
    cand_tok = jnp.take_along_axis(top_tok.reshape(batch, k * per_beam), cand_idx, axis=1).astype(jnp.int32)
    cand_seqs = _take(s.live_seqs, cand_beam).at[:, :, i].set(cand_tok)  # [B, 2K, L]
    is_eos = cand_tok == eos_id

    # Finished set: old finished + EOS candidates within the top K, best K by score.
    in_beam = jnp.arange(2 * k) < k
    new_fin = jnp.where(is_eos & in_beam, cand_logp / length_penalty(i + 1, alpha), neg_inf)
    fin_scores, fin_idx = jax.lax.top_k(jnp.concatenate([s.fin_scores, new_fin], axis=1), k)
    fin_seqs = _take(jnp.concatenate([s.fin_seqs, cand_seqs], axis=1), fin_idx)

    # Live beams: best K non-EOS candidates.
    live_logp, live_idx = jax.lax.top_k(jnp.where(is_eos, neg_inf, cand_logp), k)
    parent, tokens = _take(cand_beam, live_idx), _take(cand_tok, live_idx)  # [B, K]

    # Stopped rows keep their state (so a row's result never depends on its neighbours).
    keep = s.done[:, None]
    new = BeamState(
      jnp.where(keep[..., None], s.live_seqs, _take(cand_seqs, live_idx)),
      jnp.where(keep, s.live_logp, live_logp),
      jnp.where(keep[..., None], s.fin_seqs, fin_seqs),
      jnp.where(keep, s.fin_scores, fin_scores),
      s.done,
    )
    parent = jnp.where(keep, jnp.arange(k, dtype=parent.dtype), parent)
    # A live beam holds PAD only as a -inf candidate (fewer finite candidates than beams); it
    # still feeds a token (id 1), so all beams of a sentence stay the same length, which the
    # grouped beam cache needs (`layers.kv_cache`). Its score stays -inf.
    tokens = jnp.where(keep, pad_id, jnp.where(tokens == pad_id, pad_id + 1, tokens))
    done = new.done | (new.fin_scores.max(axis=1) >= new.live_logp.max(axis=1) / best_possible_lp)
    if row_limits is not None:
      done = done | (i + 1 >= row_limits)
    return new._replace(done=done), tokens.reshape(-1), parent

  return Strategy(init, step, lambda s: jnp.all(s.done), rows_per_input=k)


def best_hypothesis(
  s: BeamState, max_decode_len: int, alpha: float, row_limits: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """(int32 `[batch, L]` tokens, float32 `[batch]` score) of each row's best hypothesis: its
  best finished one; only a row where none finished returns its best live beam, cut at its
  limit (`row_limits`, default L) and scored at |Y| = that limit."""
  neg_inf = jnp.float32(-jnp.inf)
  has_finished = s.fin_scores[:, 0] > neg_inf  # top_k: column 0 is the best
  limit = max_decode_len if row_limits is None else row_limits[:, None]
  live_scores = jnp.where(has_finished[:, None], neg_inf, s.live_logp / length_penalty(limit, alpha))
  scores = jnp.concatenate([s.fin_scores, live_scores], axis=1)
  best = jnp.argmax(scores, axis=1)[:, None]
  return _take(jnp.concatenate([s.fin_seqs, s.live_seqs], axis=1), best)[:, 0], _take(scores, best)[:, 0]


def beam_search_core(
  logits_fn: LogitsFn,
  init_logits: jax.Array,
  cache: Any,
  *,
  beam_size: int,
  max_decode_len: int,
  alpha: float = LENGTH_PENALTY,
  eos_id: int = EOS_ID,
  cache_batch_axis: int = 0,
  return_cache: bool = False,
  pad_id: int = PAD_ID,
  row_limits: jax.Array | None = None,
) -> Any:
  """Beam search (`beam_strategy`) over `logits_fn` for `batch * beam_size` rows (row
  b * beam_size + k is beam k of sentence b), from float `[batch, vocab]` first-token logits
  and a cache of `batch` rows (`cache_batch_axis` as in `decode_loop`). Returns
  `best_hypothesis`: int32 `[batch, L]`, float32 `[batch]`; with `return_cache`, (that, the
  final cache). `row_limits`: see the module docstring."""
  strategy = beam_strategy(beam_size, max_decode_len, alpha, eos_id, pad_id, row_limits)
  state, cache = decode_loop(logits_fn, init_logits, cache, strategy, max_decode_len, cache_batch_axis)
  best = best_hypothesis(state, max_decode_len, alpha, row_limits)
  return (best, cache) if return_cache else best


def sample_core(
  logits_fn: LogitsFn,
  init_logits: jax.Array,
  cache: Any,
  row_keys: jax.Array,
  *,
  max_decode_len: int,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  eos_id: int = EOS_ID,
  return_cache: bool = False,
  pad_id: int = PAD_ID,
  row_limits: jax.Array | None = None,
) -> Any:
  """Sampling (`sample_strategy`) over `logits_fn`; int32 `[batch, max_decode_len]` tokens
  through EOS, then PAD (with `return_cache`: those and the final cache). `row_limits`: see
  the module docstring.

  Raises:
    ValueError: bad sampling options or max_decode_len < 1.
  """
  check_sampling(temperature, top_k, top_p)
  if not isinstance(max_decode_len, int) or max_decode_len < 1:
    raise ValueError(f"max_decode_len must be an integer >= 1, got {max_decode_len!r}")
  strategy = sample_strategy(row_keys, max_decode_len, temperature, top_k, top_p, eos_id, pad_id, row_limits)
  state, cache = decode_loop(logits_fn, init_logits, cache, strategy, max_decode_len)
  return (state[0], cache) if return_cache else state[0]


def greedy_core(
  logits_fn: LogitsFn,
  init_logits: jax.Array,
  cache: Any,
  *,
  max_decode_len: int,
  eos_id: int = EOS_ID,
  return_cache: bool = False,
  pad_id: int = PAD_ID,
  row_limits: jax.Array | None = None,
) -> Any:
  """Greedy search over `logits_fn`; int32 `[batch, max_decode_len]` tokens through EOS, then
  PAD (with `return_cache`: those and the final cache). `row_limits`: see the module docstring."""
  strategy = greedy_strategy(max_decode_len, eos_id, pad_id, row_limits)
  state, cache = decode_loop(logits_fn, init_logits, cache, strategy, max_decode_len)
  return (state[0], cache) if return_cache else state[0]
