"""`data.dataset=files`: the user's own corpus, from `data.{train,validation,test}_files`.

Translation (kind pairs), per split either
  * two aligned plain-text files `SRC,TGT` (one sentence per line; `.gz` allowed), or
  * one `.jsonl` file (one object per line; a null value is an empty side) or `.tsv` file (a
    header row naming the columns; cells split at tabs, without quoting; blank lines
    skipped) with the fields `data.source_field` / `data.target_field` (default: the
    language labels `data.source_lang` / `data.target_lang`).
Language models (kind text): one or more paths or globs of plain-text files, whose documents
are separated by blank lines, or `.jsonl` files with the field `data.text_field`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxformer.data.sources.base import (
  PAIRS,
  Source,
  chat_messages,
  expand_paths,
  field,
  file_fingerprint,
  read_jsonl,
  read_lines,
)
from jaxformer.errors import DataError

_SPLIT_KEYS = {"train": "train_files", "validation": "validation_files", "test": "test_files"}


def _suffix(path: Path) -> str:
  """`.jsonl`, `.tsv` or `.txt`-like, ignoring a trailing `.gz`."""
  name = path.name[:-3] if path.name.endswith(".gz") else path.name
  return Path(name).suffix


class Files(Source):
  """Sentence pairs or documents from local files; see the module docstring."""

  name = "files"

  @classmethod
  def validate_settings(cls, data: Any) -> None:
    """`Source.validate_settings`: `data.train_files` is required.

    Raises:
      DataError: `data.train_files` is empty.
    """
    if not data.train_files:
      raise DataError("data.dataset=files needs data.train_files, e.g. data.train_files=train.fr,train.en")

  def splits(self) -> tuple[str, ...]:
    """`Source.splits`: train plus each split whose `data.*_files` is set.

    Raises:
      DataError: `data.train_files` is empty.
    """
    self.validate_settings(self.data)
    return tuple(s for s, key in _SPLIT_KEYS.items() if getattr(self.data, key))

  def _paths(self, split: str) -> list[Path]:
    key = _SPLIT_KEYS[split]
    paths = expand_paths(getattr(self.data, key), f"data.{key}")
    if self.kind == PAIRS and not (len(paths) == 2 or (len(paths) == 1 and _suffix(paths[0]) in (".jsonl", ".tsv"))):
      raise DataError(
        f"data.{key} must be two aligned files SRC,TGT or one .jsonl/.tsv file; got {len(paths)} "
        f"file(s): {', '.join(map(str, paths))}"
      )
    return paths

  def fingerprint(self, split: str) -> dict:
    """`Source.fingerprint`: the files' sizes and times, the field names and the languages."""
    d = self.data
    sft = [d.prompt_field, d.completion_field, d.messages_field]
    return {
      "files": file_fingerprint(self._paths(split)),
      # the fine-tuning fields only when set: plain runs keep their cache keys
      "fields": [d.source_field, d.target_field, d.text_field] + (sft if any(sft) else []),
      "langs": [d.source_lang, d.target_lang],
    }

  def describe(self, split: str) -> str:
    """`Source.describe`: the split's file paths."""
    return ", ".join(map(str, self._paths(split)))

  def examples(self, split: str) -> Iterator:
    """`Source.examples`: aligned lines or .jsonl/.tsv records (pairs), or documents (text)."""
    paths = self._paths(split)
    if self.kind == PAIRS:
      return self._aligned(*paths) if len(paths) == 2 else self._records(paths[0], split)
    return itertools.chain.from_iterable(self._documents(p) for p in paths)

  def _keys(self) -> tuple[str, str]:
    d = self.data
    return d.source_field or d.source_lang, d.target_field or d.target_lang

  def _aligned(self, src: Path, tgt: Path) -> Iterator[tuple[str, str]]:
    src_lines, tgt_lines = read_lines(src), read_lines(tgt)
    count = 0
    for a, b in itertools.zip_longest(src_lines, tgt_lines):
      if a is None or b is None:  # one file ended first: count both and say so
        n_src = count + (a is not None) + sum(1 for _ in src_lines)
        n_tgt = count + (b is not None) + sum(1 for _ in tgt_lines)
        raise DataError(f"{src} has {n_src} lines but {tgt} has {n_tgt}; parallel files must be line-aligned")
      count += 1
      yield a[1], b[1]

  def _records(self, path: Path, split: str) -> Iterator[tuple[str, str]]:
    src_key, tgt_key = self._keys()
    setting = "data.source_field and data.target_field"
    if _suffix(path) == ".jsonl":
      for number, record in read_jsonl(path):
        where = f"{path}:{number}"
        yield field(record, src_key, where, setting), field(record, tgt_key, where, setting)
      return
    lines = read_lines(path)
    header = next(lines, None)
    if header is None:
      raise DataError(f"{path} is empty; a .tsv file needs a header row naming its columns")
    columns = header[1].split("\t")
    for key in (src_key, tgt_key):
      if key not in columns:
        raise DataError(f"{path}: no column {key!r}; the header has {', '.join(columns)}; set {setting}")
    i, j = columns.index(src_key), columns.index(tgt_key)
    for number, line in lines:
      if not line.strip():  # blank lines (a trailing one, say) hold no pair
        continue
      cells = line.split("\t")
      if len(cells) != len(columns):
        raise DataError(f"{path}:{number}: {len(cells)} tab-separated cells, but the header has {len(columns)}")
      yield cells[i], cells[j]

  def _documents(self, path: Path) -> Iterator[str | dict]:
    d = self.data
    if _suffix(path) == ".jsonl":
      for number, record in read_jsonl(path):
        where = f"{path}:{number}"
        if d.messages_field:
          yield {"messages": chat_messages(record, d.messages_field, where)}
        elif d.prompt_field:
          setting = "data.prompt_field and data.completion_field"
          yield {
            "prompt": field(record, d.prompt_field, where, setting),
            "completion": field(record, d.completion_field, where, setting),
          }
        else:
          yield field(record, d.text_field, where, "data.text_field")
      return
    if d.messages_field or d.prompt_field:
      raise DataError(
        f"{path}: data.prompt_field/completion_field/messages_field read .jsonl files; "
        "give fine-tuning rows as one JSON object per line"
      )
    lines: list[str] = []
    for _, line in read_lines(path):
      if line.strip():
        lines.append(line)
      elif lines:
        yield "\n".join(lines)
        lines = []
    if lines:
      yield "\n".join(lines)
