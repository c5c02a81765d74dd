"""Data sources and streaming preparation: the user's files in every format, TFDS by name,
the preparation cache, and one-line errors for bad data."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from jaxformer import data as D
from jaxformer.config import ConfigError, config_from_dict
from jaxformer.data import prepare as prep
from jaxformer.data.sources import make_source
from jaxformer.errors import DataError
from jaxformer.tasks import get_task

PAIRS = [(f"the cat number {i} sat on mat {i % 7}", f"le chat numero {i} assis sur tapis {i % 7}") for i in range(60)]
TINY_MODEL = {
  "vocab_size": 120,
  "d_model": 16,
  "num_heads": 2,
  "d_ff": 32,
  "num_encoder_layers": 1,
  "num_decoder_layers": 1,
  "max_length": 64,
}


def _write(path: Path, text: str) -> str:
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "wt", encoding="utf-8") as f:
    f.write(text)
  return str(path)


def _config(tmp_path, kind="encoder_decoder", **data):
  return config_from_dict(
    {
      "model": {"kind": kind, **TINY_MODEL},
      "data": {
        "dataset": "files",
        "data_dir": str(tmp_path / "cache"),
        "tokenizer": "bpe",
        "source_lang": "xx",
        "target_lang": "yy",
        **data,
      },
    }
  )


@pytest.fixture
def pair_files(tmp_path):
  src = _write(tmp_path / "train.xx.gz", "".join(s + "\n" for s, _ in PAIRS))
  tgt = _write(tmp_path / "train.yy", "".join(t + "\n" for _, t in PAIRS))
  jsonl = _write(tmp_path / "train.jsonl", "".join(json.dumps({"xx": s, "yy": t, "id": 1}) + "\n" for s, t in PAIRS))
  tsv = _write(tmp_path / "train.tsv", "id\txx\tyy\n" + "".join(f"{i}\t{s}\t{t}\n" for i, (s, t) in enumerate(PAIRS)))
  return {"aligned": f"{src},{tgt}", "jsonl": jsonl, "tsv": tsv}


def test_every_pair_format_yields_the_same_pairs(tmp_path, pair_files):
  for spec in pair_files.values():
    source = make_source(_config(tmp_path, train_files=spec).data, D.PAIRS)
    assert source.splits() == ("train",) and list(source.examples("train")) == PAIRS
  named = _config(tmp_path, train_files=pair_files["jsonl"], source_field="yy", target_field="xx").data
  assert list(make_source(named, D.PAIRS).examples("train")) == [(t, s) for s, t in PAIRS]


def test_pairs_prepare_hold_out_validation_and_reuse_the_cache(tmp_path, pair_files, capsys):
  config = _config(tmp_path, train_files=pair_files["aligned"])
  vocab, splits = get_task(config).load_data()
  tokenizer = vocab.target
  assert len(splits["train"]) == 54 and len(splits["validation"]) == 6  # the last tenth is held out
  assert "holding out the last 6 pairs" in capsys.readouterr().err
  src, tgt = splits["validation"].texts(range(6))
  assert list(zip(src, tgt)) == PAIRS[54:]
  ids = splits["train"].fetch([3])
  assert tokenizer.decode(ids[0][0]) == PAIRS[3][0] and ids[1][0][-1] == D.EOS_ID
  folders = sorted(p.name for p in (tmp_path / "cache" / "prepared").iterdir())
  get_task(config).load_data()
  assert sorted(p.name for p in (tmp_path / "cache" / "prepared").iterdir()) == folders


def test_a_changed_file_is_prepared_again(tmp_path, pair_files):
  config = _config(tmp_path, train_files=pair_files["tsv"])
  _, first = get_task(config).load_data()
  with open(pair_files["tsv"], "a", encoding="utf-8") as f:
    f.write("99\tone more cat\tun chat de plus\n")
  _, second = get_task(config).load_data()
  assert second["train"].folder != first["train"].folder
  assert len(second["train"]) + len(second["validation"]) == 61


def test_interrupted_preparation_leaves_no_cache(tmp_path, pair_files):
  config = _config(tmp_path, train_files=pair_files["aligned"])
  source = make_source(config.data, D.PAIRS)
  tokenizer = D.train_tokenizer([s for p in PAIRS for s in p], 60, "bpe")

  class Interrupted(Exception):
    pass

  def broken(split):
    yield from PAIRS[:10]
    raise Interrupted

  real = source.examples
  source.examples = broken
  with pytest.raises(Interrupted):
    prep.prepare_pairs(source, "train", D.Vocabulary(tokenizer, tokenizer), tmp_path / "cache", 64)
  assert not list((tmp_path / "cache" / "prepared").iterdir())  # neither a final nor a temporary folder
  source.examples = real
  done = prep.prepare_pairs(source, "train", D.Vocabulary(tokenizer, tokenizer), tmp_path / "cache", 64)
  assert len(done) == 60 and (done.folder / "meta.json").is_file()


def test_empty_lines_are_dropped_counted_and_reported(tmp_path, capsys):
  src = _write(tmp_path / "a.xx", "one cat\n\nthree cats\nfour cats\n")
  tgt = _write(tmp_path / "a.yy", "un chat\ndeux chats\n \nquatre chats\n")
  source = make_source(_config(tmp_path, train_files=f"{src},{tgt}").data, D.PAIRS)
  tokenizer = D.train_tokenizer(["one cat three cats four", "un chat deux chats quatre"], 30, "bpe")
  prepared = prep.prepare_pairs(source, "train", D.Vocabulary(tokenizer, tokenizer), tmp_path / "cache", 64)
  assert len(prepared) == 2 and prepared.meta["num_empty"] == 2
  assert prepared.texts([0, 1]) == (["one cat", "four cats"], ["un chat", "quatre chats"])
  assert "dropped 2 of 4 train pairs with an empty side" in capsys.readouterr().err


def test_text_documents_from_globs_gzip_and_jsonl(tmp_path):
  _write(tmp_path / "a.txt", "first doc line one\nline two\n\n\nsecond doc\n")
  _write(tmp_path / "b.txt.gz", "third doc\n")
  data = _config(tmp_path, "decoder_only", train_files=str(tmp_path / "*.txt*")).data
  assert list(make_source(data, D.TEXT).examples("train")) == [
    "first doc line one\nline two",
    "second doc",
    "third doc",
  ]
  _write(tmp_path / "c.jsonl", json.dumps({"body": "a doc"}) + "\n\n" + json.dumps({"body": "b doc"}) + "\n")
  data = _config(tmp_path, "encoder_only", train_files=str(tmp_path / "c.jsonl"), text_field="body").data
  assert list(make_source(data, D.TEXT).examples("train")) == ["a doc", "b doc"]


def test_text_stream_windows_and_document_starts(tmp_path):
  docs = [f"document {i} " + "word " * (i % 5) for i in range(300)]
  _write(tmp_path / "docs.txt", "\n\n".join(docs) + "\n")
  config = _config(tmp_path, "decoder_only", train_files=str(tmp_path / "docs.txt"), max_length=16)
  source = make_source(config.data, D.TEXT)
  tokenizer = D.train_tokenizer(docs, 60, "bpe")
  old = prep.CHUNK_TOKENS
  prep.CHUNK_TOKENS = 50  # many records, so windows cross record boundaries
  try:
    stream = prep.prepare_text(source, "train", tokenizer, tmp_path / "cache", eos_id=D.EOS_ID)
  finally:
    prep.CHUNK_TOKENS = old
  flat = np.concatenate([tokenizer.encode(d) + [D.EOS_ID] for d in docs]).astype(np.int32)
  assert len(stream) == len(flat) and len(stream.meta["shards"]) == 1
  np.testing.assert_array_equal(stream.read(), flat)
  starts = np.array([0, 49, 50, 333, len(flat) - 20])
  np.testing.assert_array_equal(stream.windows(starts, 20), flat[starts[:, None] + np.arange(20)])
  lengths = [len(tokenizer.encode(d)) + 1 for d in docs]
  np.testing.assert_array_equal(stream.doc_starts, np.cumsum([0] + lengths[:-1]))
  tail = stream.subset(100, 160)
  np.testing.assert_array_equal(tail.read(), flat[100:160])
  assert tail.doc_starts[0] == 0 and all(flat[99 + s] == D.EOS_ID for s in tail.doc_starts[1:])
  # Records come through an LRU cache: with room for three 200-byte records, random windows stay
  # exact while it evicts, and it never holds more than its budget.
  records = prep._Records(stream.folder, stream.meta["shards"], cache_bytes=600)
  stream._records = records
  rng = np.random.default_rng(0)
  for _ in range(30):
    starts = rng.integers(0, len(flat) - 20, 4)
    np.testing.assert_array_equal(stream.windows(starts, 20), flat[starts[:, None] + np.arange(20)])
    assert records._cached_bytes == sum(map(len, records._cache.values())) <= 600
  np.testing.assert_array_equal(stream.windows(np.array([5]), 20)[0], flat[5:25])
  assert len(records._cache) == 3 and 0 in records._cache
  np.testing.assert_array_equal(stream.read(), flat)  # a request larger than the budget
  assert records._cached_bytes <= 600


def _error(tmp_path, kind="encoder_decoder", **data) -> str:
  with pytest.raises((DataError, FileNotFoundError, ConfigError)) as info:
    get_task(_config(tmp_path, kind, **data)).load_data()
  message = str(info.value)
  assert "\n" not in message
  return message


def test_bad_input_gets_one_clear_line(tmp_path, pair_files):
  assert "data.train_files: the file 'nope.xx' does not exist" in _error(tmp_path, train_files="nope.xx,nope.yy")
  assert "matches no file" in _error(tmp_path, "decoder_only", train_files=str(tmp_path / "*.none"))
  short = _write(tmp_path / "short.yy", "un\ndeux\n")
  src = pair_files["aligned"].split(",")[0]
  assert f"has 60 lines but {short} has 2" in _error(tmp_path, train_files=f"{src},{short}")
  bad = tmp_path / "bad.xx"
  bad.write_bytes(b"fine line\nbad \xff byte\n")
  assert f"{bad}:2: not valid UTF-8 (byte 0xff at column 5)" in _error(tmp_path, train_files=f"{bad},{short}")
  broken = _write(tmp_path / "broken.jsonl", '{"xx": "a", "yy": "b"}\n{"xx": oops}\n')
  assert f"{broken}:2: not valid JSON" in _error(tmp_path, train_files=broken)
  assert "no field 'de'; the fields are xx, yy, id" in _error(
    tmp_path, train_files=pair_files["jsonl"], target_field="de"
  )
  assert "no column 'de'; the header has id, xx, yy" in _error(
    tmp_path, train_files=pair_files["tsv"], target_field="de"
  )
  assert "two aligned files SRC,TGT or one .jsonl/.tsv file; got 3" in _error(
    tmp_path, train_files=f"{src},{src},{src}"
  )
  assert "does not exist" in _error(tmp_path, train_files=pair_files["jsonl"], tokenizer_model="none.model")
  big = D.train_tokenizer([s for p in PAIRS for s in p], 100, "bpe")
  big.save(tmp_path / "big.model")
  given = get_task(_config(tmp_path, train_files=pair_files["jsonl"], tokenizer_model=str(tmp_path / "big.model")))
  assert given.load_data()[0].target.serialized == big.serialized  # an existing model is used as it is
  with pytest.raises(DataError, match="has 100 ids but model.vocab_size=50 .*set model.vocab_size=100"):
    config = config_from_dict(
      {
        "model": {**TINY_MODEL, "vocab_size": 50},
        "data": {
          "dataset": "files",
          "train_files": pair_files["jsonl"],
          "source_lang": "xx",
          "target_lang": "yy",
          "tokenizer_model": str(tmp_path / "big.model"),
          "data_dir": str(tmp_path / "cache"),
        },
      }
    )
    get_task(config).load_data()
  with pytest.raises(ConfigError, match="data.dataset='wmt' is unknown"):
    _config(tmp_path, dataset="wmt")
  with pytest.raises(ConfigError, match="needs data.train_files"):
    _config(tmp_path)


def test_a_vocabulary_too_large_for_the_text_trains_at_the_largest_size_that_works(capsys):
  from jaxformer.data.vocab import train_fitting

  texts = ["cat dog bird fish", "horse cow sheep goat", "duck frog"] * 10
  for model_type in ("bpe", "unigram"):
    tokenizer = train_fitting(texts, 300, model_type)
    assert 8 < tokenizer.vocab_size < 300 and tokenizer.decode(tokenizer.encode("duck frog")) == "duck frog"
    line = capsys.readouterr().err.strip()
    assert line == (
      f"the train split supports {tokenizer.vocab_size} SentencePiece pieces, fewer than the 300 "
      f"asked for: trained {tokenizer.vocab_size} (model.vocab_size can be lowered to match)"
    )


def test_separate_vocabularies_encode_each_side_with_its_own_model(tmp_path, pair_files):
  with pytest.raises(ConfigError, match="set model.tie_embeddings=false"):
    _config(tmp_path, train_files=pair_files["jsonl"], shared_vocab=False)
  config = config_from_dict(
    {
      "model": {**TINY_MODEL, "tie_embeddings": False},
      "data": {
        "dataset": "files",
        "train_files": pair_files["jsonl"],
        "source_lang": "xx",
        "target_lang": "yy",
        "tokenizer": "bpe",
        "shared_vocab": False,
        "data_dir": str(tmp_path / "cache"),
      },
    }
  )
  vocab, splits = get_task(config).load_data()
  assert not vocab.shared and vocab.source.serialized != vocab.target.serialized
  src, tgt = splits["train"].fetch([4])
  assert vocab.source.decode(src[0]) == PAIRS[4][0] and vocab.target.decode(tgt[0]) == PAIRS[4][1]
  assert src[0][:-1].tolist() == vocab.source.encode(PAIRS[4][0]) != vocab.target.encode(PAIRS[4][0])


def test_more_bad_input_and_messy_files(tmp_path, pair_files, capsys):
  notgz = _write(tmp_path / "plain.xx", "a\nb\n")
  (tmp_path / "fake.xx.gz").write_bytes(Path(notgz).read_bytes())
  good = gzip.compress(("cat\n" * 2000).encode())
  (tmp_path / "cut.xx.gz").write_bytes(good[: len(good) // 2])
  yy = _write(tmp_path / "b.yy", "x\n" * 2000)
  assert "fake.xx.gz: not a valid or complete gzip file" in _error(tmp_path, train_files=f"{tmp_path}/fake.xx.gz,{yy}")
  assert "cut.xx.gz: not a valid or complete gzip file" in _error(tmp_path, train_files=f"{tmp_path}/cut.xx.gz,{yy}")
  assert "is a directory; give files" in _error(tmp_path, train_files=f"{tmp_path},{yy}")
  listed = _write(tmp_path / "list.jsonl", json.dumps({"xx": ["a"], "yy": "b"}) + "\n")
  assert "list.jsonl:1: field 'xx' holds a JSON list, not text" in _error(tmp_path, train_files=listed)
  with pytest.raises(ConfigError, match="data.train_files is set but data.dataset=multi30k; add data.dataset=files"):
    config_from_dict({"data": {"train_files": "a.xx,a.yy"}})
  # null is an empty side (dropped and counted); blank TSV lines and a byte-order mark are not text.
  nulls = _write(
    tmp_path / "nulls.jsonl",
    "".join(json.dumps({"xx": s, "yy": None if i == 3 else t}) + "\n" for i, (s, t) in enumerate(PAIRS)),
  )
  source = make_source(_config(tmp_path, train_files=nulls).data, D.PAIRS)
  assert list(source.examples("train"))[3] == (PAIRS[3][0], "")
  tsv = tmp_path / "bom.tsv"
  tsv.write_bytes(b"\xef\xbb\xbfxx\tyy\n" + "".join(f"{s}\t{t}\n" for s, t in PAIRS[:5]).encode() + b"\n\n")
  assert list(make_source(_config(tmp_path, train_files=str(tsv)).data, D.PAIRS).examples("train")) == PAIRS[:5]
  # Overlong pairs are reported, and a killed preparation's temporary folder is removed later.
  tokenizer = D.train_tokenizer([s for p in PAIRS for s in p], 60, "bpe")
  abandoned = tmp_path / "cache" / "prepared" / "files-train-0.incomplete-999999999"
  abandoned.mkdir(parents=True)
  source = make_source(_config(tmp_path, train_files=pair_files["aligned"]).data, D.PAIRS)
  capsys.readouterr()
  short = prep.prepare_pairs(source, "train", D.Vocabulary(tokenizer, tokenizer), tmp_path / "cache", 14, "drop")
  assert (
    0 < len(short) < 60
    and f"dropped {60 - len(short)} of 60 train pairs longer than data.max_length=14" in capsys.readouterr().err
  )
  prep._remove_abandoned(tmp_path / "cache" / "prepared" / "files-train-0")
  assert not abandoned.exists()


def test_decode_skips_ids_beyond_the_tokenizer():
  tokenizer = D.train_tokenizer([s for p in PAIRS for s in p], 60, "bpe")
  ids = tokenizer.encode("the cat")
  assert tokenizer.decode(ids[:1] + [tokenizer.vocab_size, tokenizer.vocab_size + 5] + ids[1:]) == "the cat"
