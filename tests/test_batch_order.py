"""Resume sees the batches an uninterrupted run would: for every source, the batch of step k is
a pure function of (seed, k), whatever the process count or the step a run started from."""

import json

import numpy as np
import pytest
from conftest import sweep

from jaxformer.config import config_from_dict
from jaxformer.tasks import get_task

SMALL = {"vocab_size": 300, "max_length": 64}


def _sources(tmp, multi30k_dir):
  (tmp / "a.xx").write_text("".join(f"w{i} x{i % 9} y{i % 4}\n" for i in range(120)))
  (tmp / "a.yy").write_text("".join(f"v{i} z{i % 9}\n" for i in range(120)))
  (tmp / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * (1 + i % 6)}) + "\n" for i in range(200)))
  from test_tfds_source import JaxformerToyPairs

  JaxformerToyPairs(data_dir=str(tmp / "tfds"), file_format="array_record").download_and_prepare(
    file_format="array_record"
  )
  files = {"dataset": "files", "source_lang": "xx", "target_lang": "yy", "tokenizer": "bpe"}
  return {
    # Multi30k at configs/tiny.yaml's vocabulary, so the session's prepared copy serves (`multi30k_dir`).
    "multi30k": ({"vocab_size": 1000}, {"data_dir": multi30k_dir, "buckets": [16, 32, 64]}),
    "multi30k-packed": ({"vocab_size": 1000}, {"data_dir": multi30k_dir, "packing": True}),
    "tinyshakespeare": ({"kind": "decoder_only"}, {"dataset": "tinyshakespeare", "tokenizer": "char"}),
    "files-pairs-packed": ({}, {**files, "train_files": f"{tmp}/a.xx,{tmp}/a.yy", "packing": True}),
    "files-text-mlm": (
      {"kind": "encoder_only"},
      {**files, "train_files": f"{tmp}/d.jsonl", "max_length": 16, "packing": True},
    ),
    "tfds-pairs": ({}, {**files, "dataset": "tfds:jaxformer_toy_pairs", "tfds_data_dir": str(tmp / "tfds")}),
  }


@pytest.fixture(scope="module")
def sources(tmp_path_factory, multi30k_dir):
  tmp = tmp_path_factory.mktemp("order")
  return tmp, _sources(tmp, multi30k_dir)


NAMES = ["multi30k", "multi30k-packed", "tinyshakespeare", "files-pairs-packed", "files-text-mlm", "tfds-pairs"]


@pytest.mark.parametrize("name", sweep(NAMES, set(NAMES) - {"multi30k-packed"}))
def test_batch_k_is_a_pure_function_of_seed_and_step(sources, name):
  tmp, table = sources
  model, data = table[name]
  config = config_from_dict(
    {
      "model": {**SMALL, **model},
      "data": {"data_dir": str(tmp / "cache"), **data},
      "train": {"batch_size": 8},
      "runtime": {"seed": 5},
    }
  )
  task = get_task(config)
  _, splits = task.load_data()
  whole, _ = task.make_batches(splits)
  halves = [task.make_batches(splits, i, 2)[0] for i in range(2)]
  resumed = get_task(config).make_batches(splits)[0].iterate(7)
  for step in range(7, 10):
    batch = whole[step]
    assert set(batch) >= {"inputs", "targets"}
    restarted = next(resumed)
    for key, value in batch.items():
      np.testing.assert_array_equal(restarted[key], value)
      np.testing.assert_array_equal(np.concatenate([h[step][key] for h in halves]), value)
  assert not np.array_equal(whole[7]["inputs"], whole[8]["inputs"])
