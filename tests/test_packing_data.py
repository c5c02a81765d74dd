"""Sequence packing on the data side: rows of several sentence pairs with segment ids and
positions, and language-model windows that keep document boundaries."""

import numpy as np
import pytest

from jaxformer import data as D


def _split(rng, n=400, longest=20):
  src = [rng.integers(4, 50, rng.integers(1, longest)).astype(np.int32) for _ in range(n)]
  tgt = [rng.integers(4, 50, rng.integers(1, longest)).astype(np.int32) for _ in range(n)]
  src = [np.append(s, D.EOS_ID).astype(np.int32) for s in src]
  tgt = [np.append(t, D.EOS_ID).astype(np.int32) for t in tgt]
  return D.TokenizedSplit(src, tgt, [""] * n, [""] * n, np.arange(n), longest + 1)


def test_first_fit_rows_fit_and_cover_every_pair_once():
  rng = np.random.default_rng(0)
  src, tgt = rng.integers(1, 30, 500), rng.integers(1, 30, 500)
  rows = D.first_fit(src, tgt, 32)
  assert sorted(i for row in rows for i in row) == list(range(500))
  assert all(src[row].sum() <= 32 and tgt[row].sum() <= 32 for row in rows)
  assert len(rows) < (src.sum() + tgt.sum()) / 64 * 1.2   # close to the total length / row length
  with pytest.raises(ValueError, match="longer than the packed row length"):
    D.first_fit(np.array([33]), np.array([1]), 32)


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
    crossing = doc[1:] != doc[:-1]   # the last token of a document predicts nothing
    np.testing.assert_array_equal(b["targets"][row], np.where(crossing, 0, window[1:] + 1))
  plain = D.WindowBatches(stream, 4, 8, seed=0)[2]
  np.testing.assert_array_equal(plain["inputs"], b["inputs"])
  assert set(plain) == {"inputs", "targets"}
