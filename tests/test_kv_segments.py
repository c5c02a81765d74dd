"""Contiguous KV storage in segments (`layers.kv_cache`): where the bounds fall, writes and
attention over segments against one array, and segments past every row's length never read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.layers import kv_cache as kvc
from jaxformer.layers.positions import alibi_bias, alibi_slopes


def test_segment_bounds_double_from_the_minimum_up_to_the_limit():
  """Segments of 8, 8, 16, 32, ... tokens: each as long as all before it, at most six."""
  assert kvc.MIN_SEGMENT == 8 and kvc.MAX_SEGMENTS == 6
  assert kvc.segment_bounds(32) == (0, 8, 16, 32)
  assert kvc.segment_bounds(33) == (0, 8, 16, 33)
  assert kvc.segment_bounds(100) == (0, 12, 25, 50, 100)
  assert kvc.segment_bounds(16) == (0, 8, 16)
  assert kvc.segment_bounds(15) == (0, 15)
  assert kvc.segment_bounds(1) == (0, 1)
  assert kvc.segment_bounds(1024) == (0, 32, 64, 128, 256, 512, 1024)  # at most 6 segments


@pytest.mark.parametrize("beams, axis", [(1, 2), (3, 2), (3, 3)])
def test_split_then_join_restores_the_array(beams, axis):
  """`split_segments` and `join_segments` invert each other, beam-major slots on any axis."""
  shape = (2, 5, 2, beams * 20, 3)[3 - axis :]  # slots on `axis`
  x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  segments = kvc.split_segments(x, beams, axis)
  assert [s.shape[axis] for s in segments] == [beams * 10, beams * 10]
  np.testing.assert_array_equal(kvc.join_segments(segments, beams, axis), x)
  # beam m's position p sits at slot m * length_j + p - start_j of its segment
  np.testing.assert_array_equal(
    jnp.take(segments[1], beams * 10 - 1, axis=axis), jnp.take(x, beams * 20 - 1, axis=axis)
  )


def test_writes_and_attention_over_segments_equal_one_array():
  """Rows of 3, 13 and 9 tokens write two more each (crossing the bound at 16 for one row):
  the segments joined equal one array written alike, attention over them (GQA, causal, ALiBi)
  equals attention over that array, and the segment from 16 on, which no row reaches yet,
  is not read (NaN there changes nothing)."""
  rows, kh, n, h, capacity = 3, 2, 4, 8, 32
  rng = np.random.default_rng(0)
  lengths = jnp.asarray([3, 13, 9], jnp.int32)
  positions = lengths[:, None] + jnp.arange(2)[None]  # [rows, 2]
  valid = jnp.asarray([[True, True], [True, True], [True, False]])
  new_k = jnp.asarray(rng.standard_normal((rows, 2, kh, h)), jnp.float32)
  new_v = jnp.asarray(rng.standard_normal((rows, 2, kh, h)), jnp.float32)
  old_k = jnp.asarray(rng.standard_normal((rows, kh, capacity, h)), jnp.float32)
  old_v = jnp.asarray(rng.standard_normal((rows, kh, capacity, h)), jnp.float32)
  one_k = kvc.write((old_k,), new_k, positions, valid, None, 0)
  one_v = kvc.write((old_v,), new_v, positions, valid, None, 0)
  seg_k = kvc.write(kvc.split_segments(old_k), new_k, positions, valid, None, 0)
  seg_v = kvc.write(kvc.split_segments(old_v), new_v, positions, valid, None, 0)
  assert [x.shape[2] for x in seg_k] == [8, 8, 16]
  np.testing.assert_array_equal(kvc.join_segments(seg_k), one_k[0])
  np.testing.assert_array_equal(kvc.join_segments(seg_v), one_v[0])

  q = jnp.asarray(rng.standard_normal((rows, 2, n, h)), jnp.float32)
  kv_lengths = lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)  # 5, 15, 10: below 16
  opts = dict(causal=True, position_bias=(alibi_bias, jnp.asarray(alibi_slopes(n))))
  want = kvc.cached_attention(q, one_k, one_v, positions, kv_lengths, **opts)
  poisoned_k, poisoned_v = seg_k[:2] + (seg_k[2] * jnp.nan,), seg_v[:2] + (seg_v[2] * jnp.nan,)
  got = jax.jit(lambda *a: kvc.cached_attention(*a, **opts))(q, poisoned_k, poisoned_v, positions, kv_lengths)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lengths", [(0, 0, 5, 5), (7, 7, 8, 8), (15, 15, 16, 16)])
def test_beam_writes_over_segments_equal_one_array(lengths):
  """Grouped beam layout, 2 sentences x 2 beams, capacity 16 (segments 0-7, 8-15): each row's
  key lands in its own beam slot at its length, as in one array; nothing goes into another
  beam's slots (a segment after the row's position must not take it at a negative offset), and
  a position at capacity is dropped."""
  beams, capacity, kh, h = 2, 16, 2, 4
  rng = np.random.default_rng(1)
  old = jnp.asarray(rng.standard_normal((2, kh, beams * capacity, h)), jnp.float32)
  new = jnp.asarray(rng.standard_normal((4, 1, kh, h)), jnp.float32)
  state = kvc.CacheState(lengths=jnp.asarray(lengths, jnp.int32), capacity=capacity, beam_size=beams)
  valid = jnp.asarray([[True], [True], [True], [False]])
  got = kvc.join_segments(kvc.write_beams(kvc.split_segments(old, beams), new, state, valid), beams)
  want = np.asarray(old).copy()
  for r, length in enumerate(lengths):
    if valid[r, 0] and length < capacity:
      want[r // beams, :, (r % beams) * capacity + length] = np.asarray(new)[r, 0]
  np.testing.assert_array_equal(got, want)
