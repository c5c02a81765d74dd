"""TPU flash attention (`model.attention=splash`): the splash-attention Pallas kernels JAX ships
(`jax.experimental.pallas.ops.tpu.splash_attention`), forward and backward, which keep each block
of scores in on-chip memory and skip the blocks the mask leaves empty.

Masks. The kernel takes a mask over token indices (causal, a causal sliding window, or none) and a
segment id per token; a query sees the keys of its own segment. Ours map onto them: a real token's
id is its packed example's (1 without packing), padding's is 0, so a real query sees the real keys
of its example, as `scores.attention_mask` says. Padded queries see padded keys rather than a
uniform row; their outputs are never used (no loss, no prediction is read there). Causal by token
index equals ours by position where positions count up by one within each example, as the default
positions and packing's do.

Platforms. On TPU the Mosaic kernels run; on any other platform the same kernels in Pallas
interpret mode (the CPU tests), chosen when the program is lowered (`lax.platform_dependent`), so a
train step lowered for a TPU topology on a CPU machine carries the TPU kernels.

Sharding. Under a mesh each device runs the kernels on its own rows (the `act_batch` axes) and
heads (the `act_heads` axes, whole key/value groups), through a `jax.shard_map` manual over every
mesh axis; every device sees whole sequences, so the length must not be split (`mesh.context` = 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import PartitionSpec

from jaxformer import sharding as sh

LANES = 128  # the kernels' key blocks are multiples of a TPU vector register's 128 lanes


def _kernel(
  q_len: int, kv_len: int, group: int, causal: bool, window: int, softcap: float, block: int, interpret: bool
) -> kernels.SplashAttentionKernel:
  """The multi-query kernel for `group` query heads over one key/value head, built afresh in each
  trace: it holds its block masks as arrays of the trace that built it, so a kernel kept from one
  trace would leak tracers into the next. The costly part, the numpy preprocessing of the masks, is
  cached by JAX itself (`splash_attention_mask_info._process_mask`, keyed by the mask)."""
  if causal and window:
    mask = masks.LocalMask((q_len, kv_len), window_size=(window - 1, 0), offset=0)
  else:
    mask = masks.CausalMask((q_len, kv_len)) if causal else masks.FullMask((q_len, kv_len))
  bq, bkv = min(block, q_len), min(block, kv_len)
  sizes = kernels.BlockSizes(
    block_q=bq,
    block_kv=bkv,
    block_kv_compute=bkv,
    block_q_dkv=bq,
    block_kv_dkv=bkv,
    block_kv_dkv_compute=bkv,
    block_q_dq=bq,
    block_kv_dq=bkv,
  )
  return kernels.make_splash_mqa_single_device(
    masks.MultiHeadMask([mask] * group), block_sizes=sizes, attn_logits_soft_cap=softcap or None, interpret=interpret
  )


def _segments(valid: jax.Array | None, segment_ids: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
  """int32 `[batch, length]`: the packed example's id (1 without packing) on real tokens, 0 on padding."""
  ids = jnp.ones(shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  return ids if valid is None else jnp.where(valid, ids, 0)


def _local(q, k, v, q_ids, kv_ids, *, causal: bool, window: int, softcap: float, block: int) -> jax.Array:
  """Splash attention of one device's rows and heads: q `[B, T, N, H]` (already scaled), k/v
  `[B, S, K, H]`, segment ids `[B, T]` / `[B, S]` -> `[B, T, N, H]`."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  group = n // kh
  q = q.reshape(b, t, kh, group, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]: query heads by key/value head
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]

  def run(interpret, q, k, v, q_ids, kv_ids):
    kernel = _kernel(t, s, group, causal, window, softcap, block, interpret)
    per_head = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids), in_axes=(0, 0, 0, None))
    return jax.vmap(per_head)(q, k, v, kernels.SegmentIds(q_ids, kv_ids))

  out = jax.lax.platform_dependent(
    q, k, v, q_ids, kv_ids, tpu=functools.partial(run, False), default=functools.partial(run, True)
  )
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _padded(block: int, *arrays: jax.Array) -> list[jax.Array]:
  """`arrays` `[batch, length, ...]` padded with zeros along the length to a multiple of `LANES` and of
  the block (when longer than it): the padding's segment id 0 keeps it out of every real query's view."""
  length = arrays[0].shape[1]
  whole = -(-length // LANES) * LANES
  whole = -(-whole // min(block, whole)) * min(block, whole)
  return [jnp.pad(x, [(0, 0), (0, whole - length)] + [(0, 0)] * (x.ndim - 2)) for x in arrays]


def _dividing(axes: tuple[str, ...], size: int) -> tuple[str, ...]:
  """`axes` if their devices split `size` evenly, else () (that dimension stays whole)."""
  mesh = jax.sharding.get_abstract_mesh()
  return axes if axes and size % int(np.prod([mesh.shape[a] for a in axes])) == 0 else ()


def splash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  q_valid: jax.Array | None,
  kv_valid: jax.Array | None,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  *,
  causal: bool,
  sliding_window: int = 0,
  softcap: float = 0.0,
  block_size: int = 128,
  gather_axes: tuple[str, ...] = (),
) -> jax.Array:
  """softmax(q k^T / sqrt(head_dim)) v by the splash-attention kernels (module docstring), equal to
  `dot_product.dot_product_attention` under `scores.attention_mask` on every real query.

  Args:
    q: `[batch, T, num_heads, head_dim]`; k, v: `[batch, S, num_kv_heads, head_dim]`, num_kv_heads
      dividing num_heads.
    q_valid, kv_valid: bool `[batch, T]` / `[batch, S]`, False on padding, or None.
    q_segment_ids, kv_segment_ids: int packed-example ids (0 on padding), both or neither.
    causal: queries see keys at their index and before; `sliding_window` w > 0 (causal only):
      only the last w of them. `softcap`: c > 0 maps scores to c * tanh(score / c).
    block_size: query and key tokens per block, a multiple of `LANES`; the lengths are padded to
      a multiple of it (or of `LANES` when shorter), the padding masked out.
    gather_axes: mesh axes splitting the length (context parallelism), which splash does not take.

  Returns:
    `[batch, T, num_heads, head_dim]` in q's dtype.

  Raises:
    ValueError: a block size that is not a multiple of `LANES`, or a split length (one line each).
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  if gather_axes:
    raise ValueError(
      "model.attention=splash attends over whole sequences; set mesh.context=1 or use "
      "model.attention=dense, blockwise or fused with context parallelism"
    )
  if block_size % LANES:
    raise ValueError(
      f"model.attention=splash needs model.attention_block_size to be a multiple of {LANES}, got {block_size}"
    )
  local = functools.partial(
    _local, causal=causal, window=sliding_window if causal else 0, softcap=softcap, block=block_size
  )
  q_ids, kv_ids = _segments(q_valid, q_segment_ids, (b, t)), _segments(kv_valid, kv_segment_ids, (b, s))
  (q, q_ids), (k, v, kv_ids) = (
    _padded(block_size, q * jnp.asarray(h**-0.5, q.dtype), q_ids),
    _padded(block_size, k, v, kv_ids),
  )
  rows, heads = _dividing(sh.split_axes(sh.ACT_BATCH), b), _dividing(sh.split_axes(sh.ACT_HEADS), kh)
  if jax.sharding.get_abstract_mesh().empty:
    return local(q, k, v, q_ids, kv_ids)[:, :t]
  tokens = PartitionSpec(rows or None, None, heads or None, None)
  ids = PartitionSpec(rows or None, None)
  # Manual over every mesh axis (XLA cannot partition a Mosaic kernel over any axis left automatic), without
  # the varying-axes check (a Pallas call's outputs declare none; JAX 0.10 refuses them under it).
  out = jax.shard_map(local, in_specs=(tokens, tokens, tokens, ids, ids), out_specs=tokens, check_vma=False)(
    q, k, v, q_ids, kv_ids
  )
  return out[:, :t]
