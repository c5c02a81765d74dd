"""Sequence packing on the data side: rows of several sentence pairs with segment ids and
positions, and language-model windows that keep document boundaries."""

import numpy as np
import pytest

from jaxformer import data as D
from jaxformer.data.binpack import pack_pairs


def _split(rng, n=400, longest=20):
  src = [rng.integers(4, 50, rng.integers(1, longest)).astype(np.int32) for _ in range(n)]
  tgt = [rng.integers(4, 50, rng.integers(1, longest)).astype(np.int32) for _ in range(n)]
  src = [np.append(s, D.EOS_ID).astype(np.int32) for s in src]
  tgt = [np.append(t, D.EOS_ID).astype(np.int32) for t in tgt]
  return D.TokenizedSplit(src, tgt, [""] * n, [""] * n, np.arange(n), longest + 1)


@pytest.mark.parametrize("pack", [D.first_fit, pack_pairs])
def test_packing_rows_fit_and_cover_every_pair_once(pack):
  rng = np.random.default_rng(0)
  src, tgt = rng.integers(1, 30, 500), rng.integers(1, 30, 500)
  rows = pack(src, tgt, 32)
  assert sorted(i for row in rows for i in row) == list(range(500))
  assert all(src[row].sum() <= 32 and tgt[row].sum() <= 32 for row in rows)
  assert len(rows) < (src.sum() + tgt.sum()) / 64 * 1.2  # close to the total length / row length
  assert pack(src.copy(), tgt.copy(), 32) == rows
  assert pack(src[:0], tgt[:0], 32) == []
  with pytest.raises(ValueError, match="longer than the packed row length"):
    pack(np.array([3, 33]), np.array([1, 1]), 32)


def test_pack_pairs_finds_the_rows_first_fit_misses():
  # (source, target) tokens in rows of 10: first fit opens a row with pair 0, pair 3's source
  # does not fit there, pair 2 fills row 0's targets and pair 1 fits neither row: 3 rows. The
  # only 2-row packing is {0, 1} (9, 6 tokens) and {2, 3} (10, 7).
  src, tgt = np.array([5, 4, 2, 8]), np.array([4, 2, 6, 1])
  assert D.first_fit(src, tgt, 10) == [[0, 2], [3], [1]]
  assert sorted(sorted(row) for row in pack_pairs(src, tgt, 10)) == [[0, 1], [2, 3]]
  # Source-heavy and target-heavy pairs a quarter of a row long, as in translation corpora.
  rng = np.random.default_rng(1)
  src = rng.integers(4, 30, 3000)
  tgt = np.clip(src + rng.integers(-6, 8, 3000), 2, 40)
  ffd, rows = D.first_fit(src, tgt, 64), pack_pairs(src, tgt, 64)
  assert pack_pairs(src, tgt, 64, rounds=0) == ffd
  fewest = np.ceil(max(src.sum(), tgt.sum()) / 64)  # the fuller side's tokens / row length
  assert len(rows) <= 1.01 * fewest < len(ffd)
  assert sorted(i for row in rows for i in row) == list(range(3000))
  assert all(src[row].sum() <= 64 and tgt[row].sum() <= 64 for row in rows)


def test_pack_rows_values():
  a, b, c = np.array([5, 6, 3]), np.array([7, 3]), np.array([8, 9, 9, 3])
  out = D.pack_rows([[a, b]], [[c, a]], 8)
  np.testing.assert_array_equal(out["inputs"][0], [5, 6, 3, 7, 3, 0, 0, 0])
  np.testing.assert_array_equal(out["inputs_segment_ids"][0], [1, 1, 1, 2, 2, 0, 0, 0])
  np.testing.assert_array_equal(out["inputs_positions"][0], [0, 1, 2, 0, 1, 0, 0, 0])
  np.testing.assert_array_equal(out["targets"][0], [8, 9, 9, 3, 5, 6, 3, 0])
  np.testing.assert_array_equal(out["targets_segment_ids"][0], [1, 1, 1, 1, 2, 2, 2, 0])
  np.testing.assert_array_equal(out["targets_positions"][0], [0, 1, 2, 3, 0, 1, 2, 0])


def test_packed_batches_are_pure_in_step_and_shard_by_process():
  data = _split(np.random.default_rng(1))
  batches = D.PackedBatches(data, 8, 32, seed=3)
  again = D.PackedBatches(data, 8, 32, seed=3)
  for step in (0, 5, batches.batches_per_epoch + 2):
    b = batches[step]
    assert all(v.shape == (8, 32) and v.dtype == np.int32 for v in b.values())
    for k in b:
      np.testing.assert_array_equal(again[step][k], b[k])
    halves = [D.PackedBatches(data, 8, 32, seed=3, process_index=i, process_count=2)[step] for i in range(2)]
    np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]), b["inputs"])
  # One epoch holds each pair at most once, and unpacking a row gives back its pairs.
  seen = [i for s in range(batches.batches_per_epoch) for row in batches.global_rows(s) for i in row]
  assert len(seen) == len(set(seen)) > 0.8 * len(data)
  row = batches.global_rows(0)[0]
  b = batches[0]
  for k, i in enumerate(row, 1):
    np.testing.assert_array_equal(b["inputs"][0][b["inputs_segment_ids"][0] == k], data.inputs[i])
    np.testing.assert_array_equal(b["targets"][0][b["targets_segment_ids"][0] == k], data.targets[i])
  assert D.padding_fraction(b) < 0.25 < D.padding_fraction(D.TrainBatches(data, 8, (32,), seed=3)[0])


def test_packed_epochs_hold_every_pair_once_and_depend_on_seed_and_epoch():
  data = _split(np.random.default_rng(2))
  batches = D.PackedBatches(data, 8, 32, seed=5)
  plans = {
    (seed, epoch): D.PackedBatches(data, 8, 32, seed=seed)._epoch_rows(epoch) for seed in (5, 6) for epoch in (0, 1)
  }
  for (seed, epoch), rows in plans.items():
    assert sorted(i for row in rows for i in row) == list(range(len(data)))
    assert all(
      sum(len(data.inputs[i]) for i in row) <= 32 and sum(len(data.targets[i]) for i in row) <= 32 for row in rows
    )
    if seed == 5:
      assert batches._epoch_rows(epoch) == rows
  assert len({str(rows) for rows in plans.values()}) == 4


def test_lm_windows_keep_document_boundaries():
  stream = D.ArrayStream(np.arange(1, 41, dtype=np.int32))
  stream.doc_starts = np.array([0, 10, 13, 30])
  batches = D.WindowBatches(stream, 4, 8, seed=0, packing=True)
  b = batches[2]
  starts = np.random.default_rng((0, 2)).integers(0, 32, 4)
  for row, start in enumerate(starts):
    window = np.arange(start, start + 9)
    doc = np.searchsorted(stream.doc_starts, window, side="right") - 1
    np.testing.assert_array_equal(b["inputs_segment_ids"][row], (doc - doc[0] + 1)[:-1])
    begin = np.maximum(stream.doc_starts[doc], start)
    np.testing.assert_array_equal(b["inputs_positions"][row], (window - begin)[:-1])
    crossing = doc[1:] != doc[:-1]  # the last token of a document predicts nothing
    np.testing.assert_array_equal(b["targets"][row], np.where(crossing, 0, window[1:] + 1))
  plain = D.WindowBatches(stream, 4, 8, seed=0)[2]
  np.testing.assert_array_equal(plain["inputs"], b["inputs"])
  assert set(plain) == {"inputs", "targets"}
