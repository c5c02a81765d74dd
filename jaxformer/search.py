"""Beam search and sampling over the KV-cached decoder, plus the one decoding factory
that evaluation and the CLI use.

Both searches are split in two layers:

  * a model-free core (`beam_search_core`, `sample_core`) that drives a
    `logits_fn(tokens, cache, position) -> (logits, cache)` closure inside
    `jax.lax.while_loop`; tests can give it a hand-written next-token distribution;
  * model wrappers (`beam_search`, `sample_decode`) that run the encoder once per batch,
    prefill the decoder with BOS (which also caches the cross-attention keys/values) and
    then feed one token per step through the self-attention KV cache.

Greedy search stays in `jaxformer.decode` (`greedy_decode`, `make_greedy_fn`).

Token conventions follow `jaxformer.decode`: BOS sits at decoder position 0 and the
i-th generated token (0-based) at position i + 1; outputs are int32
`[batch, max_decode_len]` holding each row's tokens up to and including EOS, then PAD.

Defaults follow the paper (Vaswani et al. 2017, section 6.1): beam size 4, length
penalty alpha = 0.6, maximum output length = input length + 50.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.decode import EOS_ID, LogitsFn, make_greedy_fn, model_logits_fn, prefill, token_loop
from jaxformer.models.transformer import BOS_ID, PAD_ID, cache_batch_axis

BEAM_SIZE = 4          # paper section 6.1
LENGTH_PENALTY = 0.6   # paper section 6.1 (alpha of Wu et al. 2016)
EXTRA_TOKENS = 50      # paper section 6.1: maximum output length = input length + 50


def length_penalty(length: jax.Array | int, alpha: float) -> jax.Array:
  """GNMT length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al. 2016, eq. 14).

  `length` counts generated tokens, EOS included (BOS excluded); float32 result with
  length's shape. A hypothesis scores `sum log p(y_t) / lp(Y)`; alpha = 0 gives raw log-prob.
  """
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


# ----------------------------------------------------------------------------- model glue

def _check_inputs(inputs: jax.Array) -> None:
  if inputs.ndim != 2 or not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError(f"inputs must be integer ids of shape [batch, src_len], got {inputs.dtype} {inputs.shape}")
  if inputs.shape[0] < 1 or inputs.shape[1] < 1:
    raise ValueError(f"inputs must have at least one row and one column, got shape {inputs.shape}")


def default_decode_len(src_len: int, max_length: int, extra_tokens: int = EXTRA_TOKENS) -> int:
  """min(src_len + extra_tokens, max_length): the paper's input length + 50, capped by the
  decoder cache size (model `max_length`)."""
  return min(src_len + extra_tokens, max_length)


def _resolve_decode_len(model: nn.Module, inputs: jax.Array, max_decode_len: int | None) -> int:
  cache_size = model.config.max_length
  if max_decode_len is None:
    return default_decode_len(inputs.shape[1], cache_size)
  if not 1 <= max_decode_len <= cache_size:
    raise ValueError(f"max_decode_len must be in [1, model max_length={cache_size}], got {max_decode_len}")
  return int(max_decode_len)


def _gather_beams(cache: Any, parent: jax.Array, axis: int) -> Any:
  """Reorders a cache whose leaves have `batch * beam` rows on `axis` by `parent` int
  `[batch, beam]`: new beam k of sentence b takes the cache of its beam `parent[b, k]`.
  Gathers within each sentence (a `[batch, beam]` view of `axis`), so with the batch
  sharded by whole sentences it stays local. Leaves without that axis (`cache_index`,
  shared by all rows) are unchanged."""
  batch, beam = parent.shape

  def gather(x):
    if x.ndim <= axis:
      return x
    x = x.reshape(x.shape[:axis] + (batch, beam) + x.shape[axis + 1:])
    idx = parent.reshape((1,) * axis + (batch, beam) + (1,) * (x.ndim - axis - 2))
    x = jnp.take_along_axis(x, idx, axis=axis + 1)
    return x.reshape(x.shape[:axis] + (batch * beam,) + x.shape[axis + 2:])
  return jax.tree.map(gather, cache)


# ----------------------------------------------------------------------------- beam search

def beam_search_core(logits_fn: LogitsFn, init_logits: jax.Array, cache: Any, *, beam_size: int,
                     max_decode_len: int, alpha: float = LENGTH_PENALTY,
                     eos_id: int = EOS_ID, cache_batch_axis: int = 0) -> tuple[jax.Array, jax.Array]:
  """Beam search with a separate finished set and per-row early stopping.

  Args:
    logits_fn: one decode step for `batch * beam_size` rows (row b * beam_size + k is
      beam k of sentence b); see `LogitsFn`.
    init_logits: float `[batch, vocab]` logits of the first token (after BOS).
    cache: pytree whose leaves have a `batch` dim at `cache_batch_axis` (leaves with fewer
      dims are shared by all rows); it is repeated per beam, and after each step gathered
      along that dim by the surviving beams' parents.
    beam_size: K >= 1; max_decode_len: L >= 1 tokens per hypothesis, EOS included.
    alpha: length-penalty exponent >= 0 (`length_penalty`).
    cache_batch_axis: 0, or 1 for a model with `scan_layers` (cache leaves `[layers, batch, ...]`).
  Returns:
    int32 `[batch, L]` best hypothesis per row (tokens through EOS, then PAD) and float32
    `[batch]` its score `sum log p / lp(|Y|)`.

  Each step scores the K*vocab extensions of the live beams and keeps the top 2K. EOS
  candidates among the top K leave the beam into the finished set (its best K by score);
  the best K non-EOS candidates become the live beams, so the beam stays full. A row stops
  (its state frozen) once its best finished score is >= the best any live beam can still
  reach, `max live log-prob / lp(L)` (log-probs only fall and lp grows with alpha >= 0).
  The loop ends when all rows stop or L tokens are out. A row returns its best finished
  hypothesis; only a row where none finished returns its best live beam, cut at length L and
  scored at |Y| = L. With K = 1 and alpha = 0 this is greedy search.
  """
  batch, vocab = init_logits.shape
  k, length = beam_size, max_decode_len
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"beam_size must be an integer >= 1, got {beam_size!r}")
  if not isinstance(length, int) or length < 1:
    raise ValueError(f"max_decode_len must be an integer >= 1, got {max_decode_len!r}")
  if not alpha >= 0.0:
    raise ValueError(f"length penalty alpha must be >= 0, got {alpha}")
  if vocab < 2:
    raise ValueError(f"beam search needs a vocabulary of at least 2 tokens, got {vocab}")
  neg_inf = jnp.float32(-jnp.inf)
  best_possible_lp = length_penalty(length, alpha)

  def take(x, idx):  # x [B, M, ...] gathered at idx [B, K'] along axis 1
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)

  def cond(carry):
    i, done = carry[0], carry[-1]
    return (i < length) & ~jnp.all(done)

  def body(carry):
    i, cache, logits, live_seqs, live_logp, fin_seqs, fin_scores, done = carry
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(batch, k, vocab)
    flat = (live_logp[:, :, None] + logp).reshape(batch, k * vocab)
    cand_logp, cand_idx = jax.lax.top_k(flat, 2 * k)                         # [B, 2K]
    cand_beam, cand_tok = cand_idx // vocab, (cand_idx % vocab).astype(jnp.int32)
    cand_seqs = take(live_seqs, cand_beam).at[:, :, i].set(cand_tok)         # [B, 2K, L]
    is_eos = cand_tok == eos_id

    # Finished set: old finished + EOS candidates within the top K, best K by score.
    in_beam = jnp.arange(2 * k) < k
    new_fin = jnp.where(is_eos & in_beam, cand_logp / length_penalty(i + 1, alpha), neg_inf)
    all_scores = jnp.concatenate([fin_scores, new_fin], axis=1)               # [B, 3K]
    new_fin_scores, fin_idx = jax.lax.top_k(all_scores, k)
    new_fin_seqs = take(jnp.concatenate([fin_seqs, cand_seqs], axis=1), fin_idx)

    # Live beams: best K non-EOS candidates.
    new_live_logp, live_idx = jax.lax.top_k(jnp.where(is_eos, neg_inf, cand_logp), k)
    new_live_seqs = take(cand_seqs, live_idx)
    parent = take(cand_beam, live_idx)                                        # [B, K]
    tokens = take(cand_tok, live_idx)

    # Stopped rows keep their state (so a row's result never depends on its neighbours).
    keep = done[:, None]
    live_seqs = jnp.where(keep[..., None], live_seqs, new_live_seqs)
    live_logp = jnp.where(keep, live_logp, new_live_logp)
    fin_seqs = jnp.where(keep[..., None], fin_seqs, new_fin_seqs)
    fin_scores = jnp.where(keep, fin_scores, new_fin_scores)
    parent = jnp.where(keep, jnp.arange(k, dtype=parent.dtype), parent)
    tokens = jnp.where(keep, PAD_ID, tokens)
    done = done | (fin_scores.max(axis=1) >= live_logp.max(axis=1) / best_possible_lp)

    cache = _gather_beams(cache, parent, cache_batch_axis)
    logits, cache = logits_fn(tokens.reshape(-1), cache, i + 1)
    return i + 1, cache, logits, live_seqs, live_logp, fin_seqs, fin_scores, done

  def repeat(x, axis=0):
    return jnp.repeat(x, k, axis=axis) if x.ndim > axis else x

  init = (jnp.array(0, jnp.int32), jax.tree.map(lambda x: repeat(x, cache_batch_axis), cache),
          repeat(init_logits.astype(jnp.float32)),
          jnp.zeros((batch, k, length), jnp.int32),
          jnp.broadcast_to(jnp.where(jnp.arange(k) == 0, 0.0, neg_inf), (batch, k)).astype(jnp.float32),
          jnp.zeros((batch, k, length), jnp.int32), jnp.full((batch, k), neg_inf),
          jnp.zeros((batch,), bool))
  _, _, _, live_seqs, live_logp, fin_seqs, fin_scores, _ = jax.lax.while_loop(cond, body, init)

  # A hypothesis cut at length L never produced EOS: it is returned (scored at |Y| = L) only
  # by a row with no finished hypothesis at all.
  has_finished = fin_scores[:, 0] > neg_inf                                   # top_k: column 0 is the best
  live_scores = jnp.where(has_finished[:, None], neg_inf, live_logp / best_possible_lp)
  scores = jnp.concatenate([fin_scores, live_scores], axis=1)
  best = jnp.argmax(scores, axis=1)[:, None]
  tokens = take(jnp.concatenate([fin_seqs, live_seqs], axis=1), best)[:, 0]
  return tokens, take(scores, best)[:, 0]


def beam_search(model: nn.Module, params: Any, inputs: jax.Array, beam_size: int = BEAM_SIZE,
                max_decode_len: int | None = None, alpha: float = LENGTH_PENALTY,
                eos_id: int = EOS_ID) -> tuple[jax.Array, jax.Array]:
  """Beam search with the KV cache (see `beam_search_core` for the algorithm).

  The encoder and the BOS prefill run once per batch; the cache is then repeated to
  `batch * beam_size` rows and reordered by the chosen beams after every step. Jittable
  (`beam_size`, `max_decode_len`, `alpha`, `eos_id` static).

  Args:
    inputs: int `[batch, src_len]` source ids, PAD (0) padded.
    beam_size: K >= 1 (paper: 4).
    max_decode_len: tokens per hypothesis at most, EOS included; None gives
      min(src_len + 50, model max_length) (paper section 6.1); must not exceed max_length.
    alpha: GNMT length-penalty exponent (paper: 0.6), >= 0.
  Returns:
    (int32 `[batch, max_decode_len]` best hypothesis per row, float32 `[batch]` its
    length-normalised log-probability).
  """
  _check_inputs(inputs)
  length = _resolve_decode_len(model, inputs, max_decode_len)
  if not isinstance(beam_size, int) or beam_size < 1:
    raise ValueError(f"beam_size must be an integer >= 1, got {beam_size!r}")
  if not alpha >= 0.0:
    raise ValueError(f"length penalty alpha must be >= 0, got {alpha}")
  logits, cache = prefill(model, params, inputs)
  step_fn = model_logits_fn(model, params, jnp.repeat(inputs, beam_size, axis=0))
  return beam_search_core(step_fn, logits, cache, beam_size=beam_size, max_decode_len=length,
                          alpha=alpha, eos_id=eos_id, cache_batch_axis=cache_batch_axis(model.config))


# ----------------------------------------------------------------------------- sampling

def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
  """Raises ValueError (one line) unless temperature > 0, top_k is an int >= 0 and top_p is in (0, 1]."""
  if not temperature > 0.0:
    raise ValueError(f"temperature must be > 0 (for temperature -> 0 use greedy search), got {temperature}")
  if not isinstance(top_k, int) or top_k < 0:
    raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")


def filter_logits(logits: jax.Array, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
  """float32 `[vocab]` logits / temperature, with tokens outside the top k (k > 0) and
  then outside the nucleus (smallest set of most probable tokens whose probability
  reaches top_p; Holtzman et al. 2019) set to -inf. The most probable token is always
  kept; ties at the top-k boundary keep the lower ids."""
  vocab = logits.shape[-1]
  logits = logits.astype(jnp.float32) / temperature
  if 0 < top_k < vocab:
    _, idx = jax.lax.top_k(logits, top_k)
    logits = jnp.where(jnp.zeros((vocab,), bool).at[idx].set(True), logits, -jnp.inf)
  if top_p < 1.0:
    order = jnp.argsort(logits, descending=True, stable=True)
    probs = jax.nn.softmax(logits[order])
    keep_sorted = jnp.cumsum(probs) - probs < top_p    # mass strictly before the token
    logits = jnp.where(jnp.zeros((vocab,), bool).at[order].set(keep_sorted), logits, -jnp.inf)
  return logits


def source_row_keys(rng: jax.Array, inputs: jax.Array) -> jax.Array:
  """One key per row, `rng` folded in with the row's non-PAD source ids in order.

  A row's key depends only on `rng` and its own tokens, not on its position in the batch,
  its neighbours or how much padding the batch adds; identical sources share a key.
  Returns keys `[batch]` of `rng`'s kind (typed or raw uint32 `[batch, 2]`).
  """
  def fold(key, token):
    return jnp.where(token != PAD_ID, jax.random.fold_in(key, token), key), None

  def row(tokens):
    return jax.lax.scan(fold, rng, tokens)[0]
  return jax.vmap(row)(inputs.astype(jnp.int32))


def sample_core(logits_fn: LogitsFn, init_logits: jax.Array, cache: Any, row_keys: jax.Array, *,
                max_decode_len: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                eos_id: int = EOS_ID) -> jax.Array:
  """Ancestral sampling: token i of row b is drawn from `filter_logits` of its logits with
  key `fold_in(row_keys[b], i)`, so a row's draws depend only on its own key.

  Args:
    logits_fn: one decode step for the `batch` rows; see `LogitsFn`.
    init_logits: float `[batch, vocab]` logits of the first token; cache: as for logits_fn.
    row_keys: `[batch]` keys (e.g. `source_row_keys`).
  Returns:
    int32 `[batch, max_decode_len]`: tokens through EOS, then PAD; rows stop independently.
  """
  check_sampling(temperature, top_k, top_p)
  if not isinstance(max_decode_len, int) or max_decode_len < 1:
    raise ValueError(f"max_decode_len must be an integer >= 1, got {max_decode_len!r}")
  def draw(key, logits, i):
    return jax.random.categorical(jax.random.fold_in(key, i), filter_logits(logits, temperature, top_k, top_p))

  def choose(logits, i):
    return jax.vmap(draw, (0, 0, None))(row_keys, logits, i)

  return token_loop(logits_fn, init_logits, cache, choose, max_decode_len, eos_id)


def sample_decode(model: nn.Module, params: Any, inputs: jax.Array, max_decode_len: int | None,
                  rng: jax.Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  eos_id: int = EOS_ID) -> jax.Array:
  """Samples one translation per row with the KV cache (temperature, top-k, nucleus).

  Reproducible: the output is a function of (params, rng, the row's source tokens, options)
  only. Each row's key is `source_row_keys(rng, inputs)`, so a sentence gets the same sample
  alone or in any batch (any neighbours, position or padding); identical sentences in one
  call get identical samples (use different rngs for several samples). top_k = 1 is greedy.

  Args:
    inputs: int `[batch, src_len]` source ids, PAD (0) padded.
    max_decode_len: as in `beam_search` (None: min(src_len + 50, model max_length)).
    rng: a JAX PRNG key (typed or raw).
    temperature: > 0; top_k: 0 (off) or k >= 1; top_p: in (0, 1], 1 = off.
  Returns:
    int32 `[batch, max_decode_len]`: tokens through EOS, then PAD.
  """
  _check_inputs(inputs)
  check_sampling(temperature, top_k, top_p)
  length = _resolve_decode_len(model, inputs, max_decode_len)
  logits, cache = prefill(model, params, inputs)
  return sample_core(model_logits_fn(model, params, inputs), logits, cache, source_row_keys(rng, inputs),
                     max_decode_len=length, temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id)


# ----------------------------------------------------------------------------- one factory

@dataclasses.dataclass(frozen=True)
class SearchOptions:
  """How to decode. The strategy follows from the fields:

    * `beam_size` > 1: beam search (with `length_penalty`);
    * else any of `temperature`, `top_k`, `top_p` set (not None): sampling with `seed`
      (unset ones default to 1.0, 0 = off, 1.0 = off);
    * else greedy search.

  Beam search combined with sampling options is rejected by `validate`. Output length is
  min(source length + `extra_tokens`, model max_length) (paper: + 50).
  """
  beam_size: int = 1
  length_penalty: float = LENGTH_PENALTY
  extra_tokens: int = EXTRA_TOKENS
  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0
  eos_id: int = EOS_ID

  @property
  def sampling(self) -> bool:
    return self.temperature is not None or self.top_k is not None or self.top_p is not None

  @property
  def strategy(self) -> str:
    """"beam", "sample" or "greedy"."""
    if self.beam_size > 1:
      return "beam"
    return "sample" if self.sampling else "greedy"

  def validate(self) -> "SearchOptions":
    if not isinstance(self.beam_size, int) or self.beam_size < 1:
      raise ValueError(f"beam size must be an integer >= 1 (1 = greedy), got {self.beam_size!r}")
    if self.beam_size > 1 and self.sampling:
      raise ValueError(f"beam size {self.beam_size} cannot be combined with sampling "
                       "(temperature/top-k/top-p); use beam size 1 to sample")
    if not self.length_penalty >= 0.0:
      raise ValueError(f"length penalty must be >= 0, got {self.length_penalty}")
    if not isinstance(self.extra_tokens, int) or self.extra_tokens < 0:
      raise ValueError(f"max length (extra tokens over the source length) must be >= 0, got {self.extra_tokens!r}")
    if self.sampling:
      check_sampling(*self._sampling_args())
    return self

  def _sampling_args(self) -> tuple[float, int, float]:
    return (1.0 if self.temperature is None else self.temperature, 0 if self.top_k is None else self.top_k,
            1.0 if self.top_p is None else self.top_p)

  def summary(self) -> dict[str, Any]:
    """The options that matter for the chosen strategy (for logs / JSON results)."""
    out: dict[str, Any] = {"strategy": self.strategy, "extra_tokens": self.extra_tokens}
    if self.strategy == "beam":
      out.update(beam_size=self.beam_size, length_penalty=self.length_penalty)
    elif self.strategy == "sample":
      t, k, p = self._sampling_args()
      out.update(temperature=t, top_k=k, top_p=p, seed=self.seed)
    return out


def make_decode_fn(model: nn.Module, mesh: Mesh, max_length: int,
                   options: SearchOptions | None = None) -> Callable[[Any, jax.Array], jax.Array]:
  """Jitted `(params, inputs [batch, src_len]) -> int32 tokens [batch, out_len]` for the
  strategy of `options` (default: greedy), out_len = min(src_len + extra_tokens, max_length).

  The batch is sharded over the data axes (beams stay with their sentence); recompiles
  once per source length. Sampling uses `jax.random.key(options.seed)` for every batch;
  per-row keys come from the source tokens (`sample_decode`), so results do not depend
  on batching.
  """
  options = (options or SearchOptions()).validate()
  if options.strategy == "greedy":
    return make_greedy_fn(model, mesh, max_length, options.extra_tokens, options.eos_id)

  @functools.partial(jax.jit, static_argnums=(2,))
  def run(params, inputs, out_len):
    inputs = jax.lax.with_sharding_constraint(inputs, sh.batch_sharding(mesh))
    if options.strategy == "beam":
      return beam_search(model, params, inputs, options.beam_size, out_len, options.length_penalty,
                         options.eos_id)[0]
    t, k, p = options._sampling_args()
    return sample_decode(model, params, inputs, out_len, jax.random.key(options.seed), t, k, p, options.eos_id)

  def decode_fn(params, inputs):
    out_len = default_decode_len(inputs.shape[1], max_length, options.extra_tokens)
    with jax.set_mesh(mesh), sh.axis_rules():
      return run(params, inputs, out_len)
  return decode_fn
