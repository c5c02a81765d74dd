"""Blockwise exact attention: the memory-efficient ("flash") formulation.

Keys and values are visited in blocks of `block_size` with an online softmax (running
max `m` and sum `l`, Milakov & Gimelshein 2018; Rabe & Staats 2021; Dao et al. 2022), so no
`[T, S]` score matrix is ever materialised: temporaries are at most `[batch, heads, T, block_size]`
and grow linearly with the sequence length. The backward pass (a custom VJP) keeps only
q, k, v, the output and the per-row max and sum, and recomputes each block's scores.

Masks are given as padding validity, optional segment ids (packed examples) and causal /
sliding-window / global-token flags on positions, and built per block, as is a position
bias (ALiBi, T5) whose params get their gradient from the recomputing backward pass; the result equals
`dot_product.dot_product_attention` with the same mask (fully masked rows included: they
average all values).

Under a causal or sliding-window mask the queries are split into blocks of the same size too,
each visiting the key blocks in its own loop, as in Dao et al. 2022's algorithm. A key block
that the positions alone mask for every query of a query block (all its keys after the block's
last query under a causal mask, or farther than the sliding window from each of its queries;
padding ignored) is skipped: its scores would all be the mask value, so its share of the
softmax is added in closed form (nothing for a row that sees any key; the block's value sum for
a fully masked row) instead of computing `[B, N, block, block]` scores. A causal mask so
computes about half the (query block, key block) pairs, and temporaries are per block pair.
Under context parallelism each device holds a contiguous range of queries, so a causal model's
devices also skip the blocks after their own range: at 8 devices they compute 36 of the 64
(query shard, key shard) pairs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.layers.context_parallel import gather_length, scatter_length
from jaxformer.layers.positions import PositionBias
from jaxformer.layers.scores import NEG, attention_mask, attention_scores, repeat_kv


class _Spec(NamedTuple):
  causal: bool
  sliding_window: int
  softcap: float
  block_size: int
  bias_fn: Callable | None  # positions.PositionBias's function, or None
  global_tokens: int
  gather_axes: tuple[str, ...]  # mesh axes the keys/values are split over (context parallelism), or ()


def blockwise_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  q_positions: jax.Array,
  kv_positions: jax.Array,
  q_valid: jax.Array | None = None,
  kv_valid: jax.Array | None = None,
  causal: bool = False,
  sliding_window: int = 0,
  position_bias: PositionBias | None = None,
  softcap: float = 0.0,
  block_size: int = 128,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  global_tokens: int = 0,
  gather_axes: tuple[str, ...] = (),
) -> jax.Array:
  """Exact softmax attention over key/value blocks, with a memory-linear gradient.

  Args:
    q: `[batch, T, num_heads, head_dim]`.
    k, v: `[batch, S, num_kv_heads, head_dim]`; num_kv_heads divides num_heads.
    q_positions: int `[batch, T]`; kv_positions: int `[batch, S]` (batch may be 1).
    q_valid, kv_valid: bool `[batch, T]` / `[batch, S]` padding validity, or None (all valid).
    causal, sliding_window, global_tokens, softcap: as in `scores.position_mask` and
      `scores.attention_scores`.
    position_bias: (bias function, params) as in `positions.PositionBias`, or None; the
      params get gradients.
    block_size: keys per block; S is padded up to a multiple (padded keys get weight 0). Under
      a causal or sliding-window mask also the most queries per block: T is split into
      ceil(T / block_size) equal blocks, padded at the end with invalid queries.
    q_segment_ids, kv_segment_ids: int `[batch, T]` / `[batch, S]` packed-example ids, both
      or neither, as in `scores.attention_mask`.
    gather_axes: context parallelism (`layers.context_parallel`; call inside a map manual over
      these mesh axes): k, v and their positions, validity and segment ids are this device's
      shard of a longer sequence, all-gathered along S in the forward pass and again in the
      backward pass, so only the shards are kept for it; their gradients are reduce-scattered.

  Returns:
    `[batch, T, num_heads, head_dim]` in q's dtype.

  Raises:
    ValueError: only one of the segment ids given.
  """
  batch, length = q.shape[0], q.shape[1]
  q_valid = jnp.ones((batch, length), bool) if q_valid is None else q_valid
  kv_valid = jnp.ones((batch, k.shape[1]), bool) if kv_valid is None else kv_valid
  bias_fn, bias_params = position_bias if position_bias is not None else (None, jnp.zeros((1,), jnp.float32))
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("blockwise_attention needs both q_segment_ids and kv_segment_ids, or neither")
  spec = _Spec(causal, sliding_window, float(softcap), block_size, bias_fn, global_tokens, tuple(gather_axes))
  kv = (k, v, kv_positions, kv_valid, kv_segment_ids)
  return _flash(spec, q, kv, q_positions, q_valid, q_segment_ids, bias_params)


def _varying(q: jax.Array) -> tuple[str, ...]:
  """The manual mesh axes over which the queries differ (inside a `shard_map`: the context axes, and a
  pipeline's stage axes), which the scan carries must vary over too; () outside one."""
  return tuple(sorted(jax.typeof(q).manual_axis_type.varying))


def _kv_blocks(spec: _Spec, kv):
  """(k, v, positions, validity, in-range flags, segment ids or None), each `[S_pad / block, B', block, ...]`
  (S padded at the end to a multiple of the block), from the keys/values, gathered first if split."""
  k, v, kv_pos, kv_valid, kv_seg = (gather_length(x, spec.gather_axes) for x in kv)
  kv_len = k.shape[1]
  block = min(spec.block_size, kv_len)
  pad = -kv_len % block

  def blocks(x):  # [B', S, ...] -> [S_pad / block, B', block, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(x.shape[0], -1, block, *x.shape[2:]), 1, 0)

  in_range = blocks(jnp.ones((1, kv_len), bool))  # [nb, 1, block]
  kv_seg = None if kv_seg is None else blocks(kv_seg)  # [nb, B, block] or None
  return blocks(k), blocks(v), blocks(kv_pos), blocks(kv_valid), in_range, kv_seg


def _unblock(spec: _Spec, d_blocks, like):
  """Gradient blocks `[nb, B, block, K, H]` -> the gradient of `like` `[B, S, K, H]`, this device's
  keys or values: the padding cut off and, when gathered, reduce-scattered back to the shards."""
  d = jnp.moveaxis(d_blocks, 0, 1)
  d = d.reshape(d.shape[0], -1, *d.shape[3:])
  if not spec.gather_axes:
    return d[:, : like.shape[1]]
  return scatter_length(d[:, : like.shape[1] * jax.lax.axis_size(spec.gather_axes)], spec.gather_axes)


def _block_scores(spec: _Spec, q, k_blk, kpos_blk, kvalid_blk, in_range, kseg_blk, q_pos, q_valid, q_seg, bias_params):
  """Masked scores float32 `[B, N, T, block]` of one key block; out-of-range keys get -inf."""
  mask = attention_mask(
    q_pos, kpos_blk, q_valid, kvalid_blk, spec.causal, spec.sliding_window, q_seg, kseg_blk, spec.global_tokens
  )
  bias = spec.bias_fn(bias_params, q_pos, kpos_blk) if spec.bias_fn is not None else None
  scores = attention_scores(q, k_blk, bias, mask, spec.softcap)
  return jnp.where(in_range[:, None, None, :], scores, -jnp.inf)


def _may_skip(spec: _Spec) -> bool:
  """Whether positions alone can mask a whole key block under `spec` (a causal or window mask)."""
  return spec.causal or bool(spec.sliding_window and not spec.global_tokens)


def block_is_masked(spec: _Spec, kpos_blk, k_ok, q_pos, q_ok) -> jax.Array:
  """Whether the mask covers every (query, key) pair of a key block by position: bool scalar.

  Args:
    kpos_blk: int `[B', block]` key positions; k_ok: bool `[B', block]`, False for a key that
      is padding (past S, or invalid), masked for every query anyway.
    q_pos: int `[B, T]` query positions; q_ok: bool `[B, T]`, False for padding queries.

  Causal: every real key lies after the last real query. Sliding window w (without global
  tokens, which see across it): every real key is at least w positions from every real query,
  on either side. Packing only masks more, so the answer is exact for the mask the block would
  get. A block of padding only, or a batch of padding queries only, counts as masked.
  """
  big, small = jnp.iinfo(kpos_blk.dtype).max, jnp.iinfo(kpos_blk.dtype).min
  k_min, k_max = jnp.min(jnp.where(k_ok, kpos_blk, big)), jnp.max(jnp.where(k_ok, kpos_blk, small))
  q_min, q_max = jnp.min(jnp.where(q_ok, q_pos, big)), jnp.max(jnp.where(q_ok, q_pos, small))
  # A side of padding only masks the block; its sentinels would overflow the window's differences.
  masked = (k_min > k_max) | (q_min > q_max)
  if spec.causal:
    masked = masked | (k_min > q_max)
  if spec.sliding_window and not spec.global_tokens:
    w = spec.sliding_window
    masked = masked | (k_min - q_max >= w) | (q_min - k_max >= w)
  return masked


def _scan_blocks(spec: _Spec, visit, skip, init, blocks, q_pos, q_valid):
  """`lax.scan` of `visit` over the key blocks, running `skip` instead on each block that
  `block_is_masked` (decided for all blocks before the loop); both take and return
  (carry, out) alike."""
  if not _may_skip(spec):
    return jax.lax.scan(visit, init, blocks)
  _, _, kpos, kvalid, in_range, _ = blocks
  masked = jax.vmap(lambda p, ok: block_is_masked(spec, p, ok, q_pos, q_valid))(kpos, kvalid & in_range)

  def step(carry, x):
    blk, blk_masked = x
    return jax.lax.cond(blk_masked, skip, visit, carry, blk)

  return jax.lax.scan(step, init, (blocks, masked))


def _value_sum(v_blk, in_range, heads):
  """float32 `[B, N, H]`: the sum of a block's in-range values, per query head."""
  v = jnp.where(in_range[:, :, None, None], v_blk.astype(jnp.float32), 0.0).sum(axis=1)  # [B, K, H]
  return repeat_kv(v[:, None], heads)[:, 0]


def _forward(spec: _Spec, q, blocks, q_pos, q_valid, q_seg, bias_params):
  """(output `[B, T, N, H]` in q's dtype, (row max, row sum) float32 `[B, N, T]`) of one set of
  queries against all key blocks (`_kv_blocks`)."""
  batch, length, heads, head_dim = q.shape

  def visit(carry, blk):
    m, l, acc = carry  # [B, N, T], [B, N, T], [B, T, N, H]
    k_blk, v_blk, kpos, kvalid, in_range, kseg = blk
    s = _block_scores(spec, q, k_blk, kpos, kvalid, in_range, kseg, q_pos, q_valid, q_seg, bias_params)
    m_new = jnp.maximum(m, s.max(axis=-1))
    correction = jnp.exp(m - m_new)  # 0 at the first block (m = -inf)
    p = jnp.exp(s - m_new[..., None])  # [B, N, T, block]
    l = l * correction + p.sum(axis=-1)
    pv = jnp.einsum(
      "bnts,bsnh->btnh", p.astype(v_blk.dtype), repeat_kv(v_blk, heads), preferred_element_type=jnp.float32
    )
    acc = acc * jnp.moveaxis(correction, 1, 2)[..., None] + pv
    return (m_new, l, acc), None

  def skip(carry, blk):
    # Every in-range score is NEG: p = exp(NEG - m_new) for each of them, 0 unless the row has
    # seen nothing but masked keys so far.
    m, l, acc = carry
    _, v_blk, _, _, in_range, _ = blk
    m_new = jnp.maximum(m, NEG)
    correction, p = jnp.exp(m - m_new), jnp.exp(NEG - m_new)  # [B, N, T]
    l = l * correction + p * in_range.sum().astype(jnp.float32)
    pv = jnp.moveaxis(p, 1, 2)[..., None] * _value_sum(v_blk, in_range, heads)[:, None]
    acc = acc * jnp.moveaxis(correction, 1, 2)[..., None] + pv
    return (m_new, l, acc), None

  init = (
    jnp.full((batch, heads, length), -jnp.inf, jnp.float32),
    jnp.zeros((batch, heads, length), jnp.float32),
    jnp.zeros((batch, length, heads, head_dim), jnp.float32),
  )
  init = jax.lax.pcast(init, _varying(q), to="varying")  # the carry meets each device's own values
  (m, l, acc), _ = _scan_blocks(spec, visit, skip, init, blocks, q_pos, q_valid)
  out = (acc / jnp.moveaxis(l, 1, 2)[..., None]).astype(q.dtype)
  # Row max and sum [B, N, T], kept apart: for a fully masked row m + log(l) would round
  # away log(l) next to the -1e9 mask value.
  return out, (m, l)


def _query_blocks(spec: _Spec, length: int) -> int:
  """How many blocks the queries are split into: blocks of `block_size` where the mask can skip key
  blocks (each query block then skips the key blocks masked for it alone: about half of a causal
  mask's blocks), else 1 (nothing to skip, and one pass over the keys is cheaper)."""
  return -(-length // spec.block_size) if _may_skip(spec) else 1


def _split_queries(n: int, x: jax.Array, fill=0) -> jax.Array:
  """`[B', T, ...]` -> `[n, B', T_pad / n, ...]`: T padded at the end with `fill` to a multiple of n."""
  pad = -x.shape[1] % n
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
  return jnp.moveaxis(x.reshape(x.shape[0], n, -1, *x.shape[2:]), 1, 0)


def _merge_queries(x: jax.Array, length: int, axis: int) -> jax.Array:
  """Inverse of `_split_queries` for an array whose query axis is `axis` (of the unsplit array),
  the padding cut off."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])[(slice(None),) * axis + (slice(0, length),)]


def _per_query_block(n: int, fn, init, xs):
  """`lax.scan` of `fn` (carry, x) -> (carry, y) over the leading query-block axis of the arrays
  `xs`, stacking the y; one direct call when there is one block (the program stays loop-free)."""
  if n == 1:
    carry, y = fn(init, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda a: a[None], y)
  return jax.lax.scan(fn, init, xs)


def _query_side(spec: _Spec, q, q_pos, q_valid, q_seg):
  """(block count, (q, positions, validity, segment ids) split by `_split_queries`); padding queries
  are invalid, so they are masked and ignored by `block_is_masked`."""
  n = _query_blocks(spec, q.shape[1])
  split = functools.partial(_split_queries, n)
  return n, (split(q), split(q_pos), split(q_valid, False), None if q_seg is None else split(q_seg))


def _flash_forward(spec: _Spec, q, kv, q_pos, q_valid, q_seg, bias_params):
  """(output `[B, T, N, H]`, residuals of the backward pass: the per-query-block outputs, row
  maxima and sums, padding queries included)."""
  blocks = _kv_blocks(spec, kv)
  n, q_side = _query_side(spec, q, q_pos, q_valid, q_seg)
  _, (out, (m, l)) = _per_query_block(
    n, lambda c, x: (c, _forward(spec, x[0], blocks, *x[1:], bias_params)), (), q_side
  )
  return _merge_queries(out, q.shape[1], 1), (out, m, l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(spec, q, kv, q_pos, q_valid, q_seg, bias_params):
  return _flash_forward(spec, q, kv, q_pos, q_valid, q_seg, bias_params)[0]


def _flash_fwd(spec, q, kv, q_pos, q_valid, q_seg, bias_params):
  out, per_block = _flash_forward(spec, q, kv, q_pos, q_valid, q_seg, bias_params)
  return out, (q, kv, q_pos, q_valid, q_seg, bias_params, per_block)


def _backward(spec: _Spec, blocks, q, q_pos, q_valid, q_seg, bias_local, out, m, l, d_out):
  """One query block's gradients: (dq float32 `[B, T, N, H]`, its share of the bias gradient, and
  float32 dk, dv `[nb, B, block, K, H]` per key block). Recomputes each block's probabilities
  p = exp(s - m) / l; dS = p * (dP - rowsum(dO * O))."""
  heads = q.shape[2]
  d_out = d_out.astype(jnp.float32)
  delta = jnp.einsum("btnh,btnh->bnt", d_out, out.astype(jnp.float32))  # [B, N, T]

  def visit(carry, blk):
    dq, dbias = carry
    k_blk, v_blk, kpos, kvalid, in_range, kseg = blk
    s, scores_vjp = jax.vjp(
      lambda q_, k_, b_: _block_scores(spec, q_, k_, kpos, kvalid, in_range, kseg, q_pos, q_valid, q_seg, b_),
      q,
      k_blk,
      bias_local,
    )
    p = jnp.exp(s - m[..., None]) / l[..., None]  # [B, N, T, block]
    v_rep = repeat_kv(v_blk, heads)
    dv = jnp.einsum("bnts,btnh->bsnh", p, d_out)  # [B, block, N, H]
    dp = jnp.einsum("btnh,bsnh->bnts", d_out, v_rep.astype(jnp.float32))
    dq_blk, dk, dbias_blk = scores_vjp(p * (dp - delta[..., None]))
    dv = dv.reshape(*v_blk.shape[:3], -1, v_blk.shape[-1]).sum(axis=3)  # sum query heads per kv head
    return (dq + dq_blk.astype(jnp.float32), dbias + dbias_blk), (dk, dv)

  # A masked key's value gradient, the same for every key of every skipped block: the rows'
  # probability-weighted output gradient (0 but for fully masked rows), summed per kv head.
  dv_masked = jnp.einsum("bnt,btnh->bnh", jnp.exp(NEG - m) / l, d_out)  # [B, N, H]
  num_kv_heads = blocks[1].shape[3]
  dv_masked = dv_masked.reshape(dv_masked.shape[0], num_kv_heads, -1, dv_masked.shape[-1]).sum(axis=2)  # [B, K, H]

  def skip(carry, blk):
    # Masked scores are constants: no gradient reaches q, k or the bias.
    k_blk, v_blk, _, _, in_range, _ = blk
    dv = jnp.where(in_range[:, :, None, None], dv_masked[:, None], 0.0)  # [B, block, K, H]
    dk = jax.lax.pcast(jnp.zeros(k_blk.shape, k_blk.dtype), _varying(q), to="varying")  # as the visited branch's
    return carry, (dk, dv)

  init = (jax.lax.pcast(jnp.zeros(q.shape, jnp.float32), _varying(q), to="varying"), jnp.zeros_like(bias_local))
  (dq, dbias), (dk, dv) = _scan_blocks(spec, visit, skip, init, blocks, q_pos, q_valid)
  return dq, dbias, dk.astype(jnp.float32), dv


def _flash_bwd(spec, residuals, d_out):
  """`_backward` for each query block; the key, value and bias gradients add up over them."""
  q, kv, q_pos, q_valid, q_seg, bias_params, (out, m, l) = residuals
  blocks = _kv_blocks(spec, kv)
  n, q_side = _query_side(spec, q, q_pos, q_valid, q_seg)
  # Split keys: each device sums its queries' share of the bias gradient, then one psum adds the shares.
  bias_local = jax.lax.pcast(bias_params, _varying(q), to="varying")
  xs = (*q_side, out, m, l, _split_queries(n, d_out))

  def step(carry, x):
    dq, *shares = _backward(spec, blocks, *x[:4], bias_local, *x[4:])
    return jax.tree.map(jnp.add, carry, tuple(shares)), dq

  zeros = jax.lax.pcast(
    (jnp.zeros(blocks[0].shape, jnp.float32), jnp.zeros(blocks[1].shape, jnp.float32)), _varying(q), to="varying"
  )
  (dbias, dk, dv), dq = _per_query_block(n, step, (jnp.zeros_like(bias_local), *zeros), xs)
  if spec.gather_axes:
    dbias = jax.lax.psum(dbias, spec.gather_axes)
  # Positions, validity, segment ids: integer / bool inputs, no gradient. dk and dv are cast
  # before `_unblock`, so a split sequence's reduce-scatter moves them in the inputs' dtype.
  k, v = kv[0], kv[1]
  return (
    _merge_queries(dq, q.shape[1], 1).astype(q.dtype),
    (_unblock(spec, dk.astype(k.dtype), k), _unblock(spec, dv.astype(v.dtype), v), None, None, None),
    None,
    None,
    None,
    dbias,
  )


_flash.defvjp(_flash_fwd, _flash_bwd)
