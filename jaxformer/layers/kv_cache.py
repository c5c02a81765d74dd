"""The attention side of the KV cache: where a row's keys/values live, how new ones are
written, and attention of new queries over the cached keys.

Storage is a per-layer array in the linen "cache" collection, in one of two layouts:

  * contiguous: `[batch, num_kv_heads, capacity, head_dim]`, token p of row b at `[b, :, p]`;
  * paged: a pool `[num_pages, num_kv_heads, page_size, head_dim]` shared by all rows, token p
    of row b at `[page_table[b, p // page_size], :, p % page_size]`. Page 0 is never handed to
    a request: writes of padding tokens and of idle rows land there and are never read as valid.

Heads come before length so one step's scores are a batched matmul over (batch, kv head)
with no copy of the cache. Which rows hold how many tokens is not stored here: it comes with
every call as a `CacheState` (per-row lengths and page tables), so rows are independent and
any subset of rows can run a step (continuous batching).
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
    capacity: contiguous layout: self-attention tokens per row (model max_length). Static.
    num_pages, page_size: paged layout: pages in each pool and tokens per page. Static.
  """
  lengths: jax.Array
  source_lengths: jax.Array | None = None
  page_table: jax.Array | None = None
  source_page_table: jax.Array | None = None
  capacity: int = flax.struct.field(pytree_node=False, default=0)
  num_pages: int = flax.struct.field(pytree_node=False, default=0)
  page_size: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def paged(self) -> bool:
    """Whether the self-attention cache uses pages (a `page_table`) rather than contiguous rows."""
    return self.page_table is not None


def storage_shape(state: CacheState, rows: int, tokens: int, num_kv_heads: int, head_dim: int) -> tuple:
  """Shape of one layer's key (or value) storage: the paged pool, or contiguous
  `[rows, num_kv_heads, tokens, head_dim]`."""
  if state.paged:
    return (state.num_pages, num_kv_heads, state.page_size, head_dim)
  return (rows, num_kv_heads, tokens, head_dim)


def write(storage: jax.Array, new: jax.Array, positions: jax.Array, valid: jax.Array,
          page_table: jax.Array | None, page_size: int) -> jax.Array:
  """Writes `new` `[batch, T, num_kv_heads, head_dim]` at token positions int `[batch, T]`
  of each row; tokens with `valid` False (padding, idle rows) are dropped (contiguous) or go
  to page 0 (paged). Returns the updated storage."""
  new = new.astype(storage.dtype)
  if page_table is None:
    rows = jnp.broadcast_to(jnp.arange(new.shape[0])[:, None], positions.shape)
    slot = jnp.where(valid, positions, storage.shape[2])          # out of range: dropped
    return storage.at[rows, :, slot].set(new, mode="drop")
  page = jnp.take_along_axis(page_table, jnp.clip(positions // page_size, 0, page_table.shape[1] - 1), axis=1)
  page = jnp.where(valid, page, 0)
  return storage.at[page, :, positions % page_size].set(new, mode="promise_in_bounds")


def read(storage: jax.Array, page_table: jax.Array | None) -> jax.Array:
  """Each row's keys (or values) `[batch, num_kv_heads, S, head_dim]`, S = capacity
  (contiguous) or pages_per_row * page_size (paged: gathered through the page table)."""
  if page_table is None:
    return storage
  pages = storage[page_table]                                         # [B, P, K, ps, H]
  b, p, k, ps, h = pages.shape
  return pages.transpose(0, 2, 1, 3, 4).reshape(b, k, p * ps, h)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, kv_lengths: jax.Array, *,
                     causal: bool, sliding_window: int = 0, global_tokens: int = 0,
                     position_bias: PositionBias | None = None, softcap: float = 0.0) -> jax.Array:
  """Attention of new queries over a row's cached keys (paper eq. 1, softmax in float32).

  Args:
    q: `[batch, T, num_heads, head_dim]` queries at positions int `[batch, T]`.
    k, v: `[batch, num_kv_heads, S, head_dim]` from `read`: key s sits at position s.
    kv_lengths: int `[batch]` valid keys per row (positions 0..length-1, new ones included).
    causal, sliding_window, global_tokens: as in `scores.position_mask`.
    position_bias: (bias function, its params) as in `positions.PositionBias` (ALiBi, T5), or None.
    softcap: as in `scores.attention_scores`.

  Returns:
    `[batch, T, num_heads, head_dim]` in q's dtype. Grouped-query heads share their key head
    without copying it (query head j*G + g reads key head j).
  """
  b, t, n, h = q.shape
  kh, s = k.shape[1], k.shape[2]
  g = n // kh
  qg = (q * jnp.asarray(h ** -0.5, q.dtype)).reshape(b, t, kh, g, h)                 # [B, T, K, G, H]
  scores = jnp.einsum("btkgh,bksh->bkgts", qg, k.astype(q.dtype)).astype(jnp.float32)
  if softcap > 0:
    scores = softcap * jnp.tanh(scores / softcap)
  kv_pos = jnp.arange(s)[None]                                                        # [1, S]
  if position_bias is not None:
    fn, params = position_bias
    scores = scores + fn(params, q_positions, kv_pos).reshape(-1, kh, g, t, s)
  mask = kv_pos[:, None, :] < kv_lengths[:, None, None]                               # [B, 1, S]
  positional = position_mask(q_positions, kv_pos, causal, sliding_window, global_tokens)
  if positional is not None:
    mask = mask & positional
  scores = jnp.where(mask[:, None, None], scores, NEG)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bksh->btkgh", weights, v)
  return out.reshape(b, t, n, h).astype(q.dtype)
