"""Tests of jaxformer.data: the Multi30k source, streaming preparation, tokenizer, train/eval batches."""

import importlib.util

import numpy as np
import pytest

from jaxformer import data as D
from jaxformer.config import config_from_dict
from jaxformer.data import tokenizer as tok_lib
from jaxformer.data.sources.base import read_lines
from jaxformer.data.sources.multi30k import RAW_DIR
from jaxformer.tasks import get_task


def _raw(split, lang):
  stem = {"train": "train", "validation": "val", "test": "test_2016_flickr"}[split]
  return [line.strip() for _, line in read_lines(RAW_DIR / f"{stem}.{lang}.gz")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def prepared(data_dir):
  """Real Multi30k with the default 8000-piece shared tokenizer."""
  config = config_from_dict({"data": {"data_dir": str(data_dir)}})
  vocab, splits = get_task(config).load_data()
  assert vocab.shared
  return vocab.target, splits


@pytest.fixture(scope="module")
def tiny_texts():
  return _raw("validation", "en") + _raw("validation", "de")


def test_tensorflow_is_not_installed():
  assert importlib.util.find_spec("tensorflow") is None


def test_prepared_split_sizes_order_and_cache(prepared, data_dir):
  tokenizer, splits = prepared
  expected = {"train": 29000, "validation": 1014, "test": 1000}
  for split, n in expected.items():
    data = splits[split]
    assert len(data) == n
    en, de = _raw(split, "en"), _raw(split, "de")
    src, tgt = data.texts([0, n // 2, n - 1])
    assert src == [en[0], en[n // 2], en[n - 1]] and tgt == [de[0], de[n // 2], de[n - 1]]
    ids_src, ids_tgt = data.fetch([n // 2])
    assert ids_src[0].tolist() == tokenizer.encode(en[n // 2]) + [D.EOS_ID]
    assert ids_tgt[0].tolist() == tokenizer.encode(de[n // 2]) + [D.EOS_ID]
  # A second load reuses the cache (same folders), and no incomplete folder is left.
  _, again = get_task(config_from_dict({"data": {"data_dir": str(data_dir)}})).load_data()
  assert {k: v.folder for k, v in again.items()} == {k: v.folder for k, v in splits.items()}
  assert not list((data_dir / "prepared").glob("*incomplete*"))


def test_missing_tokenizer_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="missing or empty"):
    tok_lib.Tokenizer.load(tmp_path / "none.model")


def test_tokenizer_round_trip_and_specials(prepared):
  tokenizer, _ = prepared
  assert tokenizer.vocab_size == 8000
  sentences = [
    "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    "Ein Mädchen (5 Jahre) läuft über die Straße – schön, oder?!",
    "Größe: 3€;  \"Äpfel\" & 'Öl' @ 10:30 Uhr… Übermorgen ß!",
    "A little girl climbing into a wooden playhouse.",
    "Ünïcødé 漢字 ✓",
  ]
  for s in sentences:
    ids = tokenizer.encode(s)
    assert all(i not in (D.PAD_ID, D.BOS_ID, D.EOS_ID) for i in ids)
    assert tokenizer.decode(ids) == s
    framed = [D.BOS_ID] + ids + [D.EOS_ID] + [7, 8] + [D.PAD_ID] * 3
    assert tokenizer.decode(np.array(framed, np.int32)) == s
  assert (D.PAD_ID, D.tokenizer.UNK_ID, D.BOS_ID, D.EOS_ID) == (0, 1, 2, 3)


def test_tokenizer_tiny_deterministic_save_load(tmp_path, tiny_texts):
  a = tok_lib.train_tokenizer(tiny_texts, 200, "bpe")
  b = tok_lib.train_tokenizer(tiny_texts, 200, "bpe")
  assert a.serialized == b.serialized and a.vocab_size == 200
  s = "Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt."
  assert a.decode(a.encode(s)) == s
  a.save(tmp_path / "t.model")
  assert tok_lib.Tokenizer.load(tmp_path / "t.model").serialized == a.serialized
  assert [p.name for p in tmp_path.iterdir()] == ["t.model"]  # No temp left.

  with pytest.raises(ValueError, match="model_type"):
    tok_lib.train_tokenizer(tiny_texts, 200, "word")


def test_static_bucket_shapes(prepared):
  _, splits = prepared
  train = splits["train"]
  buckets = D.DEFAULT_BUCKETS
  batches = D.TrainBatches(train, 64, buckets, seed=1)
  for step in range(0, 3 * batches.batches_per_epoch, 97):
    b = batches[step]
    assert set(b) == {"inputs", "targets"}
    assert b["inputs"].dtype == np.int32 and b["targets"].dtype == np.int32
    L = b["inputs"].shape[1]
    assert b["inputs"].shape == b["targets"].shape == (64, L)
    assert L in buckets
    longest = max((b["inputs"] != 0).sum(1).max(), (b["targets"] != 0).sum(1).max())
    assert L == min(x for x in buckets if x >= longest)
    for row in b["inputs"]:
      n = int((row != 0).sum())
      assert row[n - 1] == D.EOS_ID and not row[n:].any()


def test_epoch_has_no_duplicates_and_seeds(prepared):
  _, splits = prepared
  train = splits["train"]
  a = D.TrainBatches(train, 128, seed=0)
  assert a.batches_per_epoch == len(train) // 128
  plan = a._epoch_plan(0)
  assert len(np.unique(plan)) == plan.size
  same = D.TrainBatches(train, 128, seed=0)
  other = D.TrainBatches(train, 128, seed=1)
  for step in (0, 5, a.batches_per_epoch + 3):
    np.testing.assert_array_equal(a[step]["inputs"], same[step]["inputs"])
    np.testing.assert_array_equal(a[step]["targets"], same[step]["targets"])
  assert any(
    a[s]["inputs"].shape != other[s]["inputs"].shape or (a[s]["inputs"] != other[s]["inputs"]).any() for s in range(3)
  )
  # Different epochs differ.
  assert not np.array_equal(a._epoch_plan(0), a._epoch_plan(1))


def test_resume_matches_indexing(prepared):
  _, splits = prepared
  batches = D.TrainBatches(splits["train"], 32, seed=3)
  k = batches.batches_per_epoch - 2  # Crosses an epoch boundary.
  it = batches.iterate(start_step=k)
  for step in range(k, k + 4):
    got = next(it)
    want = batches[step]
    for key in ("inputs", "targets"):
      np.testing.assert_array_equal(got[key], want[key])
  no_threads = D.TrainBatches(splits["train"], 32, seed=3, num_threads=0)
  np.testing.assert_array_equal(next(no_threads.iterate(k))["inputs"], batches[k]["inputs"])
  assert len(batches.dataset(10, 5)) == 5


def test_process_shards_union(prepared):
  _, splits = prepared
  train = splits["train"]
  full = D.TrainBatches(train, 64, seed=7)
  shards = [D.TrainBatches(train, 64, seed=7, process_index=i, process_count=2) for i in range(2)]
  for step in (0, 11, 500):
    parts = [s[step] for s in shards]
    for key in ("inputs", "targets"):
      assert all(p[key].shape == (32, full[step][key].shape[1]) for p in parts)
      np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), full[step][key])
  with pytest.raises(ValueError, match="multiple of process_count"):
    D.TrainBatches(train, 63, process_index=0, process_count=2)


def test_overlong_drop_vs_truncate(prepared):
  tokenizer, splits = prepared
  src = splits["validation"].source_texts[:200]
  tgt = splits["validation"].target_texts[:200]
  dropped = D.tokenize_split(tokenizer, src, tgt, 12, overlong="drop")
  trunc = D.tokenize_split(tokenizer, src, tgt, 12, overlong="truncate")
  assert dropped.num_dropped > 0 and len(dropped) == 200 - dropped.num_dropped
  assert len(trunc) == 200 and trunc.num_truncated == dropped.num_dropped
  assert max(len(x) for x in trunc.inputs + trunc.targets) == 12
  assert all(x[-1] == D.EOS_ID for x in trunc.inputs + trunc.targets)
  assert max(dropped.lengths) <= 12
  kept = dropped.index
  assert [src[i] for i in kept] == dropped.source_texts
  with pytest.raises(ValueError, match="overlong"):
    D.tokenize_split(tokenizer, src, tgt, 12, overlong="skip")
  with pytest.raises(ValueError, match="largest bucket"):
    D.TrainBatches(trunc, 8, (8, 10))


def test_eval_batches_cover_once(prepared):
  _, splits = prepared
  val = splits["validation"]
  assert len(val) == 1014 and val.num_dropped == 0
  for sort in (True, False):
    batches = D.eval_batches(val, 64, sort_by_length=sort)
    index = np.concatenate([b["index"] for b in batches])
    assert sorted(index[index >= 0].tolist()) == list(range(len(val)))
    assert (index == -1).sum() == 64 * len(batches) - len(val)
    last = batches[-1]
    filler = last["index"] == -1
    assert not last["inputs"][filler].any() and not last["targets"][filler].any()
    inputs = val.fetch(range(len(val)))[0]
    for b in batches:
      for row, i in zip(b["inputs"], b["index"]):
        if i >= 0:
          n = len(inputs[i])
          np.testing.assert_array_equal(row[:n], inputs[i])
    if not sort:
      np.testing.assert_array_equal(index[: len(val)], np.arange(len(val)))
  sharded = [D.eval_batches(val, 64, process_index=i, process_count=2) for i in range(2)]
  full = D.eval_batches(val, 64)
  for b, p0, p1 in zip(full, *sharded):
    np.testing.assert_array_equal(np.concatenate([p0["index"], p1["index"]]), b["index"])
    assert p0["inputs"].shape == p1["inputs"].shape


def test_train_padding_fraction(prepared):
  _, splits = prepared
  batches = D.TrainBatches(splits["train"], 128, seed=0)
  fractions = [D.padding_fraction(batches[i]) for i in range(batches.batches_per_epoch)]
  assert np.mean(fractions) < 0.15
  assert len({batches[i]["inputs"].shape for i in range(50)}) <= len(D.DEFAULT_BUCKETS)


def test_grouped_epochs_are_permutations_with_aligned_runs(prepared):
  _, splits = prepared
  train = splits["train"]
  plain = D.TrainBatches(train, 128, seed=0)
  n = plain.batches_per_epoch
  for group in (1, 4, n + 5):  # one past an epoch's length too
    grouped = D.TrainBatches(train, 128, seed=0, group=group)
    for epoch in (0, 1, 2):
      plan = grouped._epoch_plan(epoch)
      # Each epoch uses the same batches as without grouping, once each.
      assert sorted(map(tuple, plan)) == sorted(map(tuple, plain._epoch_plan(epoch)))
  # group=1 is the ungrouped plan itself.
  np.testing.assert_array_equal(D.TrainBatches(train, 128, seed=0, group=1)._epoch_plan(1), plain._epoch_plan(1))
  # With group 4 every batch of a run (global steps 4j .. 4j+3) has the run's length, so
  # the runs stack as they are, with little padding over their own longest bucket.
  grouped = D.TrainBatches(train, 128, seed=0, group=4)
  steps = 2 * n // 4 * 4  # two epochs, whole runs; epoch 1 starts at a step that is not a multiple of 4
  assert n % 4 != 0
  for j in range(0, steps, 4):
    run = [grouped[s] for s in range(j, j + 4)]
    assert len({b["inputs"].shape for b in run}) == 1, j
    np.testing.assert_array_equal(D.stack_batches(run)["targets"][2], run[2]["targets"])
  grouped_padding = np.mean([D.padding_fraction(grouped[s]) for s in range(steps)])

  def padded_to_longest(run):  # what stacking 4 ungrouped batches would cost
    length = max(b["inputs"].shape[1] for b in run)
    return np.mean(
      [
        1 - (b["inputs"].size + b["targets"].size) * (1 - D.padding_fraction(b)) / (2 * b["inputs"].shape[0] * length)
        for b in run
      ]
    )

  ungrouped_padding = np.mean([padded_to_longest([plain[s] for s in range(j, j + 4)]) for j in range(0, steps, 4)])
  assert grouped_padding < 0.19 < 0.30 < ungrouped_padding
  with pytest.raises(ValueError, match="group=0"):
    D.TrainBatches(train, 128, group=0)
