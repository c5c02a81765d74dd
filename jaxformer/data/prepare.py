"""Streaming preparation: tokenize a source's split once into ArrayRecord shards, cached.

Preparation reads the source's examples in chunks, tokenizes each chunk and appends it to
the shards, so peak memory does not grow with the corpus. The result lives in
`<data_dir>/prepared/<source>-<split>-<key>/`, where the key hashes the source's
fingerprint (its files' sizes and modification times, or the TFDS dataset's stamp), the
tokenizer and the settings: a changed input is prepared again, never silently reused. The
folder is written under a temporary name and renamed when complete, so an interrupted
preparation never leaves a cache that a later run takes as complete.

Two layouts:
  * pairs (`PreparedPairs`): one record per kept sentence pair: int32 header
    `[n_src, n_tgt, src_bytes, tgt_bytes]`, the source ids, the target ids (each ending in
    EOS) and the two UTF-8 texts; `lengths.bin` holds int32 `[n, 2]` token counts for
    length bucketing without reading the records. Pairs with an empty side are dropped
    and counted; overlong pairs are dropped or truncated (`data.overlong`).
  * text (`PreparedText`): the documents' ids concatenated (SentencePiece documents end in
    EOS) and cut into records of `CHUNK_TOKENS` int32 ids; `doc_starts.bin` holds int64
    offsets of the documents, for packing's segment ids.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import shutil
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.data.pipeline import sentence_ids
from jaxformer.data.sft import encode_example
from jaxformer.data.sources.base import PAIRS, Source
from jaxformer.data.tokenizer import EOS_ID

CHUNK_TOKENS = 16384  # text: ids per record
ENCODE_CHUNK = 4096  # examples tokenized per batch
RECORDS_PER_SHARD = 500_000
FORMAT_VERSION = 1


def _writer(path: Path):
  from array_record.python.array_record_module import ArrayRecordWriter  # noqa: PLC0415

  return ArrayRecordWriter(str(path), "group_size:1")


def _chunks(items: Iterable, size: int) -> Iterator[list]:
  it = iter(items)
  while chunk := list(itertools.islice(it, size)):
    yield chunk


def cache_key(*parts: Any) -> str:
  """A short hash of JSON-serialisable `parts`."""
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class _ShardWriter:
  """Appends records to numbered ArrayRecord shards in `folder`."""

  def __init__(self, folder: Path):
    self.folder, self.shards, self.count, self._writer = folder, [], 0, None

  def write(self, record: bytes) -> None:
    if self._writer is None or self.count % RECORDS_PER_SHARD == 0 and self.count:
      self.close()
      name = f"shard-{len(self.shards):05d}.array_record"
      self.shards.append(name)
      self._writer = _writer(self.folder / name)
    self._writer.write(record)
    self.count += 1

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


def _build(final: Path, fill) -> Path:
  """Runs `fill(tmp_folder) -> meta` and renames the folder to `final` once complete."""
  if (final / "meta.json").is_file():
    return final
  final.parent.mkdir(parents=True, exist_ok=True)
  _remove_abandoned(final)
  tmp = final.with_name(f"{final.name}.incomplete-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir()
  try:
    meta = fill(tmp)
    (tmp / "meta.json").write_text(json.dumps({"format": FORMAT_VERSION, **meta}, indent=1))
    try:
      os.replace(tmp, final)
    except OSError:  # another process finished the same preparation first
      if not (final / "meta.json").is_file():
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return final


def _remove_abandoned(final: Path) -> None:
  """Deletes temporary folders of `final` whose process is gone (killed or interrupted)."""
  for tmp in final.parent.glob(f"{final.name}.incomplete-*"):
    pid = tmp.name.rsplit("-", 1)[-1]
    try:
      os.kill(int(pid), 0)  # signal 0: does the process exist?
    except (ValueError, ProcessLookupError):
      shutil.rmtree(tmp, ignore_errors=True)
    except PermissionError:  # alive, someone else's
      pass


def prepare_pairs(
  source: Source, split: str, vocab, root: Path, max_length: int, overlong: str = "truncate", eos_id: int | None = None
) -> PreparedPairs:
  """Tokenized sentence pairs of `split` (cached; see the module docstring).

  Args:
    vocab: a `vocab.Vocabulary` (`source` encodes the sources, `target` the targets).
    max_length: tokens per side including EOS; longer pairs are dropped
      (`overlong="drop"`) or cut to `max_length - 1` tokens plus EOS (`"truncate"`).
    eos_id: the EOS ending each side (the model's `model.eos_id`); None: each tokenizer's.
  """
  src_tok, tgt_tok = vocab.source, vocab.target
  key = cache_key(
    source.fingerprint(split),
    *(hashlib.sha256(t.serialized).hexdigest() for t in (src_tok, tgt_tok)),
    max_length,
    overlong,
    FORMAT_VERSION,
    *([eos_id] if eos_id not in (None, EOS_ID) else []),
  )  # our EOS: the keys of earlier caches
  final = root / "prepared" / f"{source.name}-{split}-{key}"

  def fill(folder: Path) -> dict:
    _log(f"preparing {split} pairs from {source.describe(split)} into {final}")
    shards = _ShardWriter(folder)
    counts = {"empty": 0, "dropped": 0, "truncated": 0, "read": 0}
    with open(folder / "lengths.bin", "wb") as lengths:
      for chunk in _chunks(source.examples(split), ENCODE_CHUNK):
        counts["read"] += len(chunk)
        kept = [(s.strip(), t.strip()) for s, t in chunk if s.strip() and t.strip()]
        counts["empty"] += len(chunk) - len(kept)
        if not kept:
          continue
        src_ids, src_eos = sentence_ids(src_tok, [s for s, _ in kept], eos_id)
        tgt_ids, tgt_eos = sentence_ids(tgt_tok, [t for _, t in kept], eos_id)
        pair_lengths = []
        for (s_text, t_text), s, t in zip(kept, src_ids, tgt_ids):
          if len(s) >= max_length or len(t) >= max_length:
            if overlong == "drop":
              counts["dropped"] += 1
              continue
            counts["truncated"] += 1
            s, t = s[: max_length - 1], t[: max_length - 1]
          s_bytes, t_bytes = s_text.encode(), t_text.encode()
          header = np.array([len(s) + 1, len(t) + 1, len(s_bytes), len(t_bytes)], np.int32)
          ids = np.array(s + [src_eos] + t + [tgt_eos], np.int32)
          shards.write(header.tobytes() + ids.tobytes() + s_bytes + t_bytes)
          pair_lengths.append((len(s) + 1, len(t) + 1))
        lengths.write(np.asarray(pair_lengths, np.int32).reshape(-1, 2).tobytes())
    shards.close()
    if counts["empty"]:
      _log(f"dropped {counts['empty']} of {counts['read']} {split} pairs with an empty side ({source.describe(split)})")
    if counts["dropped"] or counts["truncated"]:
      done = "dropped" if counts["dropped"] else "truncated"
      _log(
        f"{done} {counts[done]} of {counts['read']} {split} pairs longer than data.max_length={max_length} "
        "tokens (data.overlong)"
      )
    if shards.count == 0:
      raise ValueError(
        f"the {split} split of {source.describe(split)} has no usable sentence pairs "
        f"(read {counts['read']}, empty {counts['empty']}, too long {counts['dropped']})"
      )
    return {
      "kind": PAIRS,
      "num_examples": shards.count,
      "shards": shards.shards,
      "max_length": max_length,
      **{f"num_{k}": v for k, v in counts.items()},
    }

  return PreparedPairs(_build(final, fill))


def prepare_text(source: Source, split: str, tokenizer, root: Path, eos_id: int | None) -> PreparedText:
  """The documents of `split` as one token stream (cached; see the module docstring).

  `eos_id`: the id ending every document (the tokenizer's EOS), or None (the character
  vocabulary has none). Fine-tuning rows (dicts from `data.prompt_field`/`messages_field`) are
  stored with their loss mask in the ids' sign (`sft.masked_ids`; meta `loss_mask`).
  """
  # The key's third part was a bool before ids were data (True for EOS 3): the same for old caches.
  eos_key = True if eos_id == EOS_ID else (False if eos_id is None else eos_id)
  key = cache_key(
    source.fingerprint(split), hashlib.sha256(tokenizer.serialized).hexdigest(), eos_key, CHUNK_TOKENS, FORMAT_VERSION
  )
  final = root / "prepared" / f"{source.name}-{split}-{key}"

  def fill(folder: Path) -> dict:
    _log(f"preparing {split} text from {source.describe(split)} into {final}")
    shards = _ShardWriter(folder)
    buffer = np.zeros(0, np.int32)
    masked = False
    total = docs = 0
    with open(folder / "doc_starts.bin", "wb") as starts:
      for chunk in _chunks(source.examples(split), 256):
        chunk = [d for d in chunk if d]
        if not chunk:
          continue
        if isinstance(chunk[0], dict):  # fine-tuning rows: the loss mask travels in the ids' sign (`sft`)
          ids = [encode_example(x, tokenizer, eos_id) for x in chunk]
          masked = True
        else:
          ids = [np.asarray(x if eos_id is None else x + [eos_id], np.int32) for x in tokenizer.encode_batch(chunk)]
        offsets = total + len(buffer) + np.cumsum([0] + [len(x) for x in ids[:-1]])
        starts.write(offsets.astype(np.int64).tobytes())
        docs += len(ids)
        buffer = np.concatenate([buffer, *ids])
        while len(buffer) >= CHUNK_TOKENS:
          shards.write(buffer[:CHUNK_TOKENS].tobytes())
          buffer, total = buffer[CHUNK_TOKENS:], total + CHUNK_TOKENS
      if len(buffer):
        shards.write(buffer.tobytes())
        total += len(buffer)
    shards.close()
    if total == 0:
      raise ValueError(f"the {split} split of {source.describe(split)} has no text")
    return {
      "kind": "text",
      "num_tokens": total,
      "num_documents": docs,
      "shards": shards.shards,
      "chunk_tokens": CHUNK_TOKENS,
      "loss_mask": masked,
    }

  return PreparedText(_build(final, fill))


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


class _Records:
  """Batched random access to ArrayRecord shards (one read of many records is far faster than many
  reads), through a least-recently-used cache of at most `cache_bytes` of records: a small corpus
  (Tiny Shakespeare's 68 records of 64 KB, Multi30k's pairs) is read from disk once, and a
  batch of a character LM costs a dictionary lookup instead of a read through the reader's
  thread pool (3.5 ms, 8% of that model's step on 2 cores). Safe to call from several threads."""

  def __init__(self, folder: Path, shards: list[str], cache_bytes: int = 64 << 20):
    import grain  # noqa: PLC0415

    self._source = grain.sources.ArrayRecordDataSource([str(folder / s) for s in shards])
    self._cache: collections.OrderedDict[int, bytes] = collections.OrderedDict()
    self._cache_bytes, self._cached_bytes = cache_bytes, 0
    self._lock = threading.Lock()

  def get(self, indices: list[int]) -> list[bytes]:
    """The records at `indices`, in order."""
    with self._lock:
      found = {i: self._cache[i] for i in indices if i in self._cache}
    missing = list(dict.fromkeys(i for i in indices if i not in found))
    found.update(zip(missing, self._source.__getitems__(missing) if missing else []))
    with self._lock:
      for i in dict.fromkeys(indices):
        if i not in self._cache:
          self._cached_bytes += len(found[i])
        self._cache[i] = found[i]
        self._cache.move_to_end(i)
      # The request's records are in `found` already: the cache keeps only what fits the budget.
      while self._cached_bytes > self._cache_bytes:
        self._cached_bytes -= len(self._cache.popitem(last=False)[1])
    return [found[i] for i in indices]


class PreparedPairs:
  """Random access to prepared sentence pairs, or to the range `[start, stop)` of them.

  `lengths`: int32 `[n]`, max(source, target) tokens per pair (`side_lengths`: `[n, 2]`);
  `num_dropped` / `num_truncated`: overlong pairs of the whole split; `fetch(ids)` reads the token
  arrays of example ids (each process reads only the rows it needs); `source_texts` and
  `target_texts` read every text (for evaluation splits).
  """

  def __init__(self, folder: Path, start: int = 0, stop: int | None = None):
    self.folder = Path(folder)
    self.meta = json.loads((self.folder / "meta.json").read_text())
    n = self.meta["num_examples"]
    self.start, self.stop = start, n if stop is None else stop
    self.max_length = self.meta["max_length"]
    self.num_dropped, self.num_truncated = self.meta["num_dropped"], self.meta["num_truncated"]
    self._records = _Records(self.folder, self.meta["shards"])
    pairs = np.memmap(self.folder / "lengths.bin", np.int32, "r", shape=(n, 2))[self.start : self.stop]
    self.side_lengths = np.asarray(pairs)
    self.lengths = self.side_lengths.max(axis=1)

  def __len__(self) -> int:
    return self.stop - self.start

  def subset(self, start: int, stop: int) -> PreparedPairs:
    """The pairs `[start, stop)` of this view."""
    return PreparedPairs(self.folder, self.start + start, self.start + stop)

  def _read(self, ids) -> list[tuple[np.ndarray, np.ndarray, bytes, bytes]]:
    """(source ids, target ids, UTF-8 source text, UTF-8 target text) of each example in
    `ids` (one batched read; see the module docstring for the record layout)."""
    out = []
    for r in self._records.get([self.start + int(i) for i in ids]):
      n_src, n_tgt, src_bytes, _ = (int(x) for x in np.frombuffer(r, np.int32, 4))
      ids_ = np.frombuffer(r, np.int32, n_src + n_tgt, 16)
      text = r[16 + 4 * (n_src + n_tgt) :]
      out.append((ids_[:n_src], ids_[n_src:], text[:src_bytes], text[src_bytes:]))
    return out

  def fetch(self, ids) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(source id arrays, target id arrays) of example `ids`, each ending in EOS."""
    records = self._read(ids)
    return [r[0] for r in records], [r[1] for r in records]

  def texts(self, ids) -> tuple[list[str], list[str]]:
    """(source texts, target texts) of example `ids`."""
    records = self._read(ids)
    return [r[2].decode() for r in records], [r[3].decode() for r in records]

  @property
  def source_texts(self) -> list[str]:
    """The source side of every pair in this view, as text."""
    return self.texts(range(len(self)))[0]

  @property
  def target_texts(self) -> list[str]:
    """The target side of every pair in this view, as text."""
    return self.texts(range(len(self)))[1]


class PreparedText:
  """A prepared token stream, or its range `[start, stop)` of tokens.

  `windows(starts, length)` reads int32 `[len(starts), length]` token windows;
  `doc_starts` are the int64 offsets (within the view) where documents begin.
  """

  def __init__(self, folder: Path, start: int = 0, stop: int | None = None):
    self.folder = Path(folder)
    self.meta = json.loads((self.folder / "meta.json").read_text())
    self.start, self.stop = start, self.meta["num_tokens"] if stop is None else stop
    self._chunk = self.meta["chunk_tokens"]
    self._records = _Records(self.folder, self.meta["shards"])
    self.masked = self.meta.get("loss_mask", False)  # values are `sft.masked_ids`
    starts = np.memmap(self.folder / "doc_starts.bin", np.int64, "r")
    inside = np.asarray(starts[(starts >= self.start) & (starts < self.stop)]) - self.start
    self.doc_starts = inside if len(inside) and inside[0] == 0 else np.concatenate([[0], inside]).astype(np.int64)

  def __len__(self) -> int:
    return self.stop - self.start

  def subset(self, start: int, stop: int) -> PreparedText:
    """The tokens `[start, stop)` of this view."""
    return PreparedText(self.folder, self.start + start, self.start + stop)

  def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
    """int32 `[len(starts), length]`: row i holds tokens `starts[i] .. starts[i] + length - 1`."""
    absolute = np.asarray(starts, np.int64) + self.start
    first, last = absolute // self._chunk, (absolute + length - 1) // self._chunk
    needed = sorted(set(itertools.chain.from_iterable(range(a, b + 1) for a, b in zip(first, last))))
    chunks = dict(zip(needed, (np.frombuffer(r, np.int32) for r in self._records.get(needed))))
    out = np.empty((len(absolute), length), np.int32)
    for row, (a, lo, hi) in enumerate(zip(absolute, first, last)):
      joined = np.concatenate([chunks[c] for c in range(lo, hi + 1)])
      offset = a - lo * self._chunk
      out[row] = joined[offset : offset + length]
    return out

  def read(self) -> np.ndarray:
    """The whole view as int32 `[len(self)]` (evaluation splits)."""
    return self.windows(np.array([0]), len(self))[0]
