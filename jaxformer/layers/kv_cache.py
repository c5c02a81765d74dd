"""The attention side of the KV cache: where a row's keys/values live, how new ones are
written, and attention of new queries over the cached keys.

Storage lives per layer in the linen "cache" collection, in one of two layouts:

  * contiguous: a tuple of segments `[batch, num_kv_heads, length_j, head_dim]` splitting the
    capacity at `segment_bounds` (8, 16, 32, ... tokens), token p of row b at `[b, :, p -
    start_j]` of the segment holding p. Cross-attention storage is one segment;
  * paged: a pool `[num_pages, num_kv_heads, page_size, head_dim]` shared by all rows, token p
    of row b at `[page_table[b, p // page_size], :, p % page_size]`. Page 0 is never handed to
    a request: writes of padding tokens and of idle rows land there and are never read as valid.

Why segments: a decode step's attention reads the whole cache from memory, and XLA:CPU
copies a slice of an array before a matmul reads it, so one array cannot be read in part.
Separate arrays can: a step skips (`lax.cond`) every segment after the first that starts past
the longest row, so it reads the first segment or at most twice what the longest row holds,
not the whole capacity (under `vmap` the conds become selects and every segment is read).

Heads come before length so one step's scores are a batched matmul over (batch, kv head)
with no copy of the cache. Which rows hold how many tokens is not stored here: it comes with
every call as a `CacheState` (per-row lengths and page tables), so rows are independent and
any subset of rows can run a step (continuous batching).

Beam search keeps one contiguous row per sentence and never copies keys/values between
beams: each self-attention segment is `[sentences, num_kv_heads, beam_size * length_j,
head_dim]`, beam slot m of a sentence owning slots `m * length_j + p - start_j` (in one array,
`join_segments`: `m * capacity + p`). Each step, decode row r = b *
beam_size + j writes its new token into its own slot j, and `CacheState.beam_origin[r, p]`
records which slot holds position p of that row's history; a beam that continues another
copies that row of the (small, int) table instead of the keys. Attention then scores the
row's query against all slots of its sentence and masks every slot but the recorded one
(`beam_attention`): beam_size times the (small) score FLOPs, against copying every
self-attention key and value of every beam each step. Cross-attention storage has one row
per sentence, shared by its beams. All beams of a sentence must feed a token at every step
(or all PAD), so their lengths stay equal: a beam left behind would write into positions of
its slot that another beam's history may name.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxformer.layers.positions import PositionBias
from jaxformer.layers.scores import NEG, position_mask


@flax.struct.dataclass
class CacheState:
  """Per-row bookkeeping of a KV cache, passed into every cached model call.

  Attributes:
    lengths: int32 `[batch]` tokens already in each row's self-attention cache; the next
      token of row b goes to position `lengths[b]`.
    source_lengths: int32 `[batch]` source tokens per row (encoder-decoder), or None.
    page_table: int32 `[batch, pages_per_row]` self-attention pages per row, or None for the
      contiguous layout.
    source_page_table: int32 `[batch, source_pages_per_row]` cross-attention pages, or None.
    beam_origin: int32 `[batch, capacity]` grouped beam layout (module docstring): the beam
      slot holding position p of row r's keys/values, or None.
    capacity: contiguous layout: self-attention tokens per row (the decode's need, at most the
      model's max_length; writes past it are dropped). Static.
    num_pages, page_size: paged layout: pages in each pool and tokens per page. Static.
    beam_size: rows per sentence of the grouped beam layout; 1 = one storage row per row. Static.
  """

  lengths: jax.Array
  source_lengths: jax.Array | None = None
  page_table: jax.Array | None = None
  source_page_table: jax.Array | None = None
  beam_origin: jax.Array | None = None
  capacity: int = flax.struct.field(pytree_node=False, default=0)
  num_pages: int = flax.struct.field(pytree_node=False, default=0)
  page_size: int = flax.struct.field(pytree_node=False, default=0)
  beam_size: int = flax.struct.field(pytree_node=False, default=1)

  @property
  def paged(self) -> bool:
    """Whether the self-attention cache uses pages (a `page_table`) rather than contiguous rows."""
    return self.page_table is not None


MIN_SEGMENT = 8  # tokens: the first segment of contiguous storage (and the second)
MAX_SEGMENTS = 6  # each segment is one more cond per layer and step, and one more scatter


def segment_bounds(tokens: int) -> tuple[int, ...]:
  """Start position of each segment of a contiguous row of `tokens` positions, then `tokens`:
  `tokens` halved while the half is at least MIN_SEGMENT, at most MAX_SEGMENTS segments, e.g.
  (0, 8, 16, 32) for 32 tokens, (0, 12, 25, 50, 100) for 100, (0, 15) for 15."""
  bounds = [tokens]
  while bounds[-1] // 2 >= MIN_SEGMENT and len(bounds) < MAX_SEGMENTS:
    bounds.append(bounds[-1] // 2)
  return (0, *reversed(bounds))


Storage = jax.Array | tuple[jax.Array, ...]  # the paged pool, or contiguous segments


def join_segments(segments: tuple[jax.Array, ...], beams: int = 1, axis: int = 2) -> jax.Array:
  """Contiguous segments (slots on `axis`, `beams * length_j` each: the grouped beam layout's
  beam-major slots) as one array of `beams * capacity` slots, beam m's position p at slot
  `m * capacity + p`."""
  grouped = [x.reshape(x.shape[:axis] + (beams, x.shape[axis] // beams) + x.shape[axis + 1 :]) for x in segments]
  whole = jnp.concatenate(grouped, axis=axis + 1)
  return whole.reshape(whole.shape[:axis] + (-1,) + whole.shape[axis + 2 :])


def split_segments(x: jax.Array, beams: int = 1, axis: int = 2) -> tuple[jax.Array, ...]:
  """`join_segments` undone: `x` with `beams * capacity` slots on `axis` as segments at
  `segment_bounds(capacity)`."""
  capacity = x.shape[axis] // beams
  grouped = x.reshape(x.shape[:axis] + (beams, capacity) + x.shape[axis + 1 :])
  bounds = segment_bounds(capacity)
  cut = (jax.lax.slice_in_dim(grouped, start, end, axis=axis + 1) for start, end in zip(bounds, bounds[1:]))
  return tuple(c.reshape(c.shape[:axis] + (-1,) + c.shape[axis + 2 :]) for c in cut)


def empty_storage(
  state: CacheState, rows: int, tokens: int, num_kv_heads: int, head_dim: int, dtype, segmented: bool = True
) -> Storage:
  """One layer's zero key (or value) storage: the paged pool `[num_pages, num_kv_heads,
  page_size, head_dim]`, or contiguous segments `[rows, num_kv_heads, length_j, head_dim]`
  at `segment_bounds(tokens)` (`segmented`), else one segment of all `tokens`."""
  if state.paged:
    return jnp.zeros((state.num_pages, num_kv_heads, state.page_size, head_dim), dtype)
  bounds = segment_bounds(tokens) if segmented else (0, tokens)
  return tuple(jnp.zeros((rows, num_kv_heads, end - start, head_dim), dtype) for start, end in zip(bounds, bounds[1:]))


def _write_rows(segment: jax.Array, new: jax.Array, slots: jax.Array, valid: jax.Array) -> jax.Array:
  """`segment` `[rows, K, S, H]` with `new` `[rows, T, K, H]` at slots int `[rows, T]`
  (those with `valid` False, or out of range, dropped)."""
  rows = jnp.broadcast_to(jnp.arange(new.shape[0])[:, None], slots.shape)
  slots = jnp.where(valid & (slots >= 0), slots, segment.shape[2])  # out of range: dropped
  return segment.at[rows, :, slots].set(new.astype(segment.dtype), mode="drop")


def write(
  storage: Storage, new: jax.Array, positions: jax.Array, valid: jax.Array, page_table: jax.Array | None, page_size: int
) -> Storage:
  """Writes `new` `[batch, T, num_kv_heads, head_dim]` at token positions int `[batch, T]`
  of each row; tokens with `valid` False (padding, idle rows) are dropped (contiguous) or go
  to page 0 (paged). Returns the updated storage."""
  if page_table is None:
    return tuple(_write_rows(seg, new, positions - start, valid) for seg, start in zip(storage, _starts(storage)))
  new = new.astype(storage.dtype)
  page = jnp.take_along_axis(page_table, jnp.clip(positions // page_size, 0, page_table.shape[1] - 1), axis=1)
  page = jnp.where(valid, page, 0)
  return storage.at[page, :, positions % page_size].set(new, mode="promise_in_bounds")


def _starts(segments: tuple[jax.Array, ...], slots_per_position: int = 1) -> list[int]:
  """First position of each segment `[rows, K, slots, H]` (slots_per_position slots a position)."""
  lengths = [seg.shape[2] // slots_per_position for seg in segments]
  return [sum(lengths[:j]) for j in range(len(segments))]


def read(storage: Storage, page_table: jax.Array | None) -> tuple[jax.Array, ...]:
  """Each row's keys (or values) as segments `[batch, num_kv_heads, S_j, head_dim]`: the
  contiguous segments as stored, or (paged) one segment of pages_per_row * page_size tokens
  gathered through the page table."""
  if page_table is None:
    return storage
  pages = storage[page_table]  # [B, P, K, ps, H]
  b, p, k, ps, h = pages.shape
  return (pages.transpose(0, 2, 1, 3, 4).reshape(b, k, p * ps, h),)


def cached_attention(
  q: jax.Array,
  k: tuple[jax.Array, ...],
  v: tuple[jax.Array, ...],
  q_positions: jax.Array,
  kv_lengths: jax.Array | None,
  *,
  causal: bool,
  sliding_window: int = 0,
  global_tokens: int = 0,
  position_bias: PositionBias | None = None,
  softcap: float = 0.0,
  kv_positions: jax.Array | None = None,
  kv_mask: jax.Array | None = None,
  kv_used: jax.Array | None = None,
  slots_per_position: int = 1,
) -> jax.Array:
  """Attention of new queries over a row's cached keys (paper eq. 1, softmax in float32).

  Args:
    q: `[batch, T, num_heads, head_dim]` queries at positions int `[batch, T]`.
    k, v: segments `[batch, num_kv_heads, S_j, head_dim]` from `read`; their slots in order
      are the S keys, key s at position s unless `kv_positions` says otherwise.
    kv_lengths: int `[batch]` valid keys per row (positions 0..length-1, new ones included),
      or None when `kv_mask` says which keys are valid.
    causal, sliding_window, global_tokens: as in `scores.position_mask`.
    position_bias: (bias function, its params) as in `positions.PositionBias` (ALiBi, T5), or None.
    softcap: as in `scores.attention_scores`.
    kv_positions: int `[1, S]` position of each key when not 0..S-1 (the grouped beam layout).
    kv_mask: bool `[batch, T, S]` keys each query may see (with `kv_lengths` None).
    kv_used: int scalar, no valid key at a position >= it (default: the largest kv_lengths;
      with `kv_mask` and no `kv_used`, every segment is read). Segments after the first that
      start there are not read: their keys are all masked.
    slots_per_position: slots of a segment per position (the grouped beam layout's beams).

  Returns:
    `[batch, T, num_heads, head_dim]` in q's dtype. Grouped-query heads share their key head
    without copying it (query head j*G + g reads key head j).
  """
  b, t, n, h = q.shape
  kh = k[0].shape[1]
  g = n // kh
  if kv_used is None and kv_lengths is None:
    read_segment = [True] * len(k)
  else:
    used = jnp.max(kv_lengths) if kv_used is None else kv_used
    read_segment = [j == 0 or start < used for j, start in enumerate(_starts(k, slots_per_position))]

  def skippable(j, fn, skipped_shape, *args):
    if j == 0:
      return fn(*args)
    return jax.lax.cond(read_segment[j], fn, lambda *_: jnp.zeros(skipped_shape, jnp.float32), *args)

  # Queries as [B, K, G, T, H], so each (row, key head) is one matmul. The scores are computed
  # keys-first, [S, H] x [H, G*T], reading the cached keys in their stored order: XLA:CPU ran
  # the queries-first product (keys transposed) 1.7x slower in beam search, where G*T = beams.
  # The barrier keeps XLA from folding the transpose back into that product; softmax and the
  # value product then run on the small [B, K, G, T, S] scores.
  qg = jnp.moveaxis((q * jnp.asarray(h**-0.5, q.dtype)).reshape(b, t, kh, g, h), 1, 3)

  def segment_scores(keys, qg):
    return jax.lax.optimization_barrier(jnp.einsum("bksh,bkgth->bksgt", keys.astype(qg.dtype), qg)).astype(jnp.float32)

  scores = jnp.concatenate(
    [skippable(j, segment_scores, (b, kh, keys.shape[2], g, t), keys, qg) for j, keys in enumerate(k)], axis=2
  )
  s = scores.shape[2]
  scores = jnp.moveaxis(scores, 2, 4)  # [B, K, G, T, S]
  if softcap > 0:
    scores = softcap * jnp.tanh(scores / softcap)
  kv_pos = jnp.arange(s)[None] if kv_positions is None else kv_positions  # [1, S]
  if position_bias is not None:
    fn, params = position_bias
    scores = scores + fn(params, q_positions, kv_pos).reshape(-1, kh, g, t, s)
  mask = kv_mask if kv_lengths is None else kv_pos[:, None, :] < kv_lengths[:, None, None]  # [B, T or 1, S]
  positional = position_mask(q_positions, kv_pos, causal, sliding_window, global_tokens)
  if positional is not None:
    mask = mask & positional
  scores = jnp.where(mask[:, None, None], scores, NEG)
  weights = jax.nn.softmax(scores, axis=-1).astype(v[0].dtype)

  def segment_values(w, values):
    return jnp.einsum("bkgts,bksh->bkgth", w, values).astype(jnp.float32)

  out, offset = 0.0, 0
  for j, values in enumerate(v):
    w = weights[..., offset : offset + values.shape[2]]
    out = out + skippable(j, segment_values, (b, kh, g, t, h), w, values)
    offset += values.shape[2]
  out = jnp.moveaxis(out, 3, 1)  # [B, T, K, G, H]
  return out.reshape(b, t, n, h).astype(q.dtype)


# ----------------------------------------------------------------------------- beam layout


def _by_sentence(x: jax.Array, beams: int) -> jax.Array:
  """`[rows, 1, ...]` (one token per decode row) -> `[rows / beams, beams, ...]`."""
  if x.shape[1] != 1:
    raise ValueError(f"the grouped beam cache takes one token per row and step, got {x.shape[1]}")
  return x.reshape((x.shape[0] // beams, beams) + x.shape[2:])


def mark_beams(state: CacheState, fed: jax.Array) -> CacheState:
  """Grouped beam layout: `state` whose `beam_origin` says that row r's next position
  (`lengths[r]`) is held by its own beam slot r % beam_size, for the rows with `fed` True
  (bool `[rows]`: a token, not PAD, goes in this step). Call before the step's attention."""
  rows, capacity = state.beam_origin.shape
  here = (jnp.arange(capacity)[None] == state.lengths[:, None]) & fed[:, None]  # [rows, S]
  own = (jnp.arange(rows, dtype=jnp.int32) % state.beam_size)[:, None]
  return state.replace(beam_origin=jnp.where(here, own, state.beam_origin))


def write_beams(storage: tuple[jax.Array, ...], new: jax.Array, state: CacheState, valid: jax.Array) -> tuple:
  """Grouped beam layout: writes each row's new key (or value) `[rows, 1, num_kv_heads, head_dim]`
  into its own beam slot of its sentence's segments `[rows / beams, num_kv_heads, beams *
  length_j, head_dim]` at position `lengths[r]`; rows with `valid` `[rows, 1]` False, and
  positions past capacity, write nothing."""
  beams = state.beam_size
  beam = jnp.arange(new.shape[0]) % beams
  out = []
  for seg, start in zip(storage, _starts(storage, beams)):
    length = seg.shape[2] // beams
    offset = state.lengths - start  # [rows]
    ok = valid[:, 0] & (offset >= 0) & (offset < length)  # else the slot would be another beam's
    out.append(
      _write_rows(seg, _by_sentence(new, beams), (beam * length + offset).reshape(-1, beams), ok.reshape(-1, beams))
    )
  return tuple(out)


def beam_attention(
  q: jax.Array,
  k: tuple[jax.Array, ...],
  v: tuple[jax.Array, ...],
  state: CacheState,
  valid: jax.Array | None,
  *,
  causal: bool = False,
  sliding_window: int = 0,
  global_tokens: int = 0,
  position_bias: PositionBias | None = None,
  softcap: float = 0.0,
) -> jax.Array:
  """Grouped beam layout: attention of each decode row's query `[rows, 1, num_heads, head_dim]`
  over its sentence's key/value segments `[rows / beams, num_kv_heads, S_j, head_dim]`, the beams of a
  sentence being its queries. Self-attention (`valid` bool `[rows, 1]`: the row's token is
  fed) sees, at each position, the one beam slot `beam_origin` names; cross-attention
  (`valid` None) sees the sentence's `source_lengths` source keys. Returns `[rows, 1,
  num_heads, head_dim]`, equal to `cached_attention` over a per-row copy of the row's history."""
  beams = state.beam_size
  rows, _, n, h = q.shape
  q_pos = state.lengths.reshape(-1, beams)  # [B, beams]
  if valid is None:
    out = cached_attention(
      _by_sentence(q, beams), k, v, q_pos, state.source_lengths.reshape(-1, beams)[:, 0], causal=False, softcap=softcap
    )
    return out.reshape(rows, 1, n, h)
  # Each segment's slots are beam-major: slot m * length_j + i holds position start_j + i of beam m.
  kv_pos, slot_beam, origin = [], [], []
  for seg, start in zip(k, _starts(k, beams)):
    length = seg.shape[2] // beams
    kv_pos.append(jnp.tile(jnp.arange(start, start + length), beams))
    slot_beam.append(jnp.repeat(jnp.arange(beams, dtype=jnp.int32), length))
    origin.append(jnp.tile(state.beam_origin[:, start : start + length], (1, beams)))
  kv_pos = jnp.concatenate(kv_pos)[None]  # [1, beams * S]
  kv_lengths = state.lengths + valid[:, 0]
  mask = (jnp.concatenate(origin, axis=1) == jnp.concatenate(slot_beam)[None]) & (kv_pos < kv_lengths[:, None])
  out = cached_attention(
    _by_sentence(q, beams),
    k,
    v,
    q_pos,
    None,
    causal=causal,
    sliding_window=sliding_window,
    global_tokens=global_tokens,
    position_bias=position_bias,
    softcap=softcap,
    kv_positions=kv_pos,
    kv_mask=mask.reshape(-1, beams, kv_pos.shape[1]),
    kv_used=jnp.max(kv_lengths),
    slots_per_position=beams,
  )
  return out.reshape(rows, 1, n, h)
