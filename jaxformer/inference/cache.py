"""The KV cache as an explicit pytree, and the one logits function decoding runs on.

A `KVCache` is the model's "cache" collection (each attention layer's key/value storage,
see `layers.kv_cache`) together with a `CacheState` (per-row lengths, and page tables when
paged). There is no global cache index: rows may hold different numbers of tokens and any
subset of rows can advance. The one exception is beam search's grouped layout
(`repeat_rows`), where a sentence's beams share its storage and advance together.

Every model kind that decodes has two methods (`models.transformer.EncoderDecoder`,
`models.decoder_only.DecoderOnly`): `prefill(inputs, state)` (the source, or the prompt)
and `extend(tokens, state)`; `prefill` and `extend` here call them, so nothing in the
inference package depends on the model kind.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jaxformer.layers.kv_cache import CacheState, mark_beams
from jaxformer.models.transformer import PAD_ID


@flax.struct.dataclass
class KVCache:
  """Keys/values of every attention layer (`layers`, the linen "cache" collection) and the
  rows' bookkeeping (`state`). Contiguous self-attention keys (and values) are a tuple of
  segments `[batch, num_kv_heads, length_j, head_dim]` at `layers.kv_cache.segment_bounds(
  capacity)`, cross-attention ones one segment `[batch, num_kv_heads, src_len, head_dim]`,
  paged ones a pool `[num_pages, num_kv_heads, page_size, head_dim]`. In beam search's
  grouped layout (`repeat_rows`) batch counts sentences, each self-attention segment holds
  `beam_size * length_j` slots and the state has a row per beam. Under `model.scan_layers`
  every array has a leading `[num_layers]` axis."""

  layers: Any
  state: CacheState


def _abstract(tree: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], str], ...]]:
  """A hashable stand-in for `tree`: its structure and each leaf's (shape, dtype name)."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves)


def _concrete(abstract: tuple[Any, tuple[tuple[tuple[int, ...], str], ...]]) -> Any:
  treedef, leaves = abstract
  return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in leaves])


# Finding the cache's shapes traces a whole prefill, which building a decode function would
# otherwise do again for shapes it has seen (half its tracing for a small model); one entry per
# decoding shape in use. lru_cache is thread-safe: the server decodes from several threads.
@functools.lru_cache(maxsize=64)
def _cache_shapes(model: nn.Module, params: Any, inputs_shape: tuple[int, int], state: Any) -> Any:
  def run(params, state):
    return model.apply(
      {"params": params}, jnp.ones(inputs_shape, jnp.int32), state, method="prefill", mutable=["cache"]
    )[1]["cache"]

  return _abstract(jax.eval_shape(run, _concrete(params), _concrete(state)))


def _zeros(model: nn.Module, params: Any, inputs_shape: tuple[int, int], state: CacheState) -> KVCache:
  shapes = _concrete(_cache_shapes(model, _abstract(params), tuple(inputs_shape), _abstract(state)))
  return KVCache(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), state)


def contiguous_cache(
  model: nn.Module, params: Any, batch_size: int, input_len: int, capacity: int | None = None
) -> KVCache:
  """An empty contiguous cache for `batch_size` rows whose prefill inputs (sources, or
  prompts) are `input_len` tokens; each row holds up to `capacity` tokens (default
  `model.config.max_length`; writes past it are dropped)."""
  state = CacheState(
    lengths=jnp.zeros((batch_size,), jnp.int32),
    source_lengths=jnp.zeros((batch_size,), jnp.int32),
    capacity=capacity or model.config.max_length,
  )
  return _zeros(model, params, (batch_size, input_len), state)


def paged_cache(
  model: nn.Module,
  params: Any,
  batch_size: int,
  num_pages: int,
  page_size: int,
  pages_per_row: int,
  source_pages_per_row: int,
) -> KVCache:
  """An empty paged cache: pools of `num_pages` pages of `page_size` tokens per layer (page 0
  is the null page), page tables `[batch_size, pages_per_row]` (self-attention) and
  `[batch_size, source_pages_per_row]` (cross-attention) all pointing at page 0."""
  state = CacheState(
    lengths=jnp.zeros((batch_size,), jnp.int32),
    source_lengths=jnp.zeros((batch_size,), jnp.int32),
    page_table=jnp.zeros((batch_size, pages_per_row), jnp.int32),
    source_page_table=jnp.zeros((batch_size, source_pages_per_row), jnp.int32),
    num_pages=num_pages,
    page_size=page_size,
  )
  return _zeros(model, params, (batch_size, max(source_pages_per_row, 1) * page_size), state)


def prefill(model: nn.Module, params: Any, cache: KVCache, inputs: jax.Array) -> tuple[jax.Array, KVCache]:
  """Caches int `[batch, len]` inputs (sources for an encoder-decoder, prompts for a
  decoder-only model; PAD padded at the end) for the rows of `cache`. Returns float32
  logits `[batch, vocab_size]` of each row's next token and the updated cache."""
  (logits, state), mutated = model.apply(
    {"params": params, "cache": cache.layers}, inputs, cache.state, method="prefill", mutable=["cache"]
  )
  return logits, KVCache(mutated["cache"], state)


def extend(model: nn.Module, params: Any, cache: KVCache, tokens: jax.Array) -> tuple[jax.Array, KVCache]:
  """Feeds int `[batch, T]` tokens after each row's cached ones (PAD is not fed: idle and
  finished rows pass PAD). Returns float32 logits `[batch, T, vocab_size]` and the cache."""
  state = cache.state
  if state.beam_size > 1:  # grouped beam layout: say where this step's keys go first
    state = mark_beams(state, tokens[:, 0] != model.config.pad_id)
  (logits, state), mutated = model.apply(
    {"params": params, "cache": cache.layers}, tokens, state, method="extend", mutable=["cache"]
  )
  return logits, KVCache(mutated["cache"], state)


def step(model: nn.Module, params: Any, cache: KVCache, tokens: jax.Array) -> tuple[jax.Array, KVCache]:
  """One decode step: int `[batch]` tokens in, float32 next-token logits `[batch, vocab_size]` out."""
  logits, cache = extend(model, params, cache, tokens[:, None])
  return logits[:, 0], cache


def no_pad(logits: jax.Array, pad_id: int = PAD_ID) -> jax.Array:
  """Next-token logits `[..., vocab]` with the padding id (`model.pad_id`; -1: none) at -inf: padding
  is never a target, and feeding it means "no token" to the cache, so decoding never emits it. A
  select rather than an in-place update, so XLA fuses it into whatever reads the logits."""
  return jnp.where(jnp.arange(logits.shape[-1]) == pad_id, -jnp.inf, logits)


def repeat_rows(cache: Any, times: int, batch_axis: int = 0) -> Any:
  """`cache` with `times` decode rows per row (row b -> rows b*times .. b*times + times - 1),
  e.g. one per beam.

  A contiguous `KVCache` takes the grouped beam layout (`layers.kv_cache`): its storage keeps
  one row per input row, whose self-attention positions grow `times`-fold (beam slot 0 holds
  what is cached so far, and every beam's `beam_origin` points there); the state gets a row
  per beam. The layer leaves have the batch on `batch_axis`. Any other pytree's leaves are
  repeated on axis 0 (scalars are shared by all rows).

  Raises:
    ValueError: a paged `KVCache` (beam search decodes on a contiguous cache).
  """
  if not isinstance(cache, KVCache):
    return jax.tree.map(lambda x: jnp.repeat(x, times, axis=0) if x.ndim else x, cache)
  state = cache.state
  if state.paged:
    raise ValueError("beam search needs a contiguous KV cache (cache.contiguous_cache), not a paged one")

  rows = jax.tree.map(lambda x: jnp.repeat(x, times, axis=0), state)
  rows = rows.replace(
    beam_origin=jnp.zeros((state.lengths.shape[0] * times, state.capacity), jnp.int32), beam_size=times
  )
  axis = batch_axis + 2  # [.., batch, heads, positions, head_dim]

  def grow(path, segments):  # each self-attention segment: one slot per beam and position, zeros after slot 0
    if any(getattr(p, "key", None) == "cross_attention" for p in path):
      return segments
    return tuple(
      jnp.pad(x, [(0, (times - 1) * x.shape[axis]) if d == axis else (0, 0) for d in range(x.ndim)]) for x in segments
    )

  return KVCache(jax.tree_util.tree_map_with_path(grow, cache.layers, is_leaf=lambda x: isinstance(x, tuple)), rows)


def reorder_beams(cache: Any, parent: jax.Array) -> Any:
  """The cache whose beam k of sentence b is beam `parent[b, k]` (int `[batch, beam]`) of
  the same sentence, for a cache of `batch * beam` rows (row b * beam + k). Gathers inside
  each sentence, so with the batch sharded by whole sentences it stays on its device.

  A `KVCache` (grouped beam layout, from `repeat_rows`) reorders only its state: the lengths
  and each row's `beam_origin`, so no key or value moves. Other pytrees: leaves on axis 0
  (scalars shared).

  Raises:
    ValueError: a `KVCache` not in the grouped beam layout.
  """
  batch, beam = parent.shape

  def gather(x):
    x = x.reshape((batch, beam) + x.shape[1:])
    x = jnp.take_along_axis(x, parent.reshape((batch, beam) + (1,) * (x.ndim - 2)), axis=1)
    return x.reshape((batch * beam,) + x.shape[2:])

  if not isinstance(cache, KVCache):
    return jax.tree.map(lambda x: gather(x) if x.ndim else x, cache)
  if cache.state.beam_size != beam:
    raise ValueError(
      f"reorder_beams needs a cache with {beam} beams per row (cache.repeat_rows), "
      f"got beam_size={cache.state.beam_size}"
    )
  return KVCache(cache.layers, jax.tree.map(gather, cache.state))
