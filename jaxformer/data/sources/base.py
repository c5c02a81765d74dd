"""What a data source is: raw text examples per split, and a fingerprint of their content.

A source yields either sentence pairs (`kind="pairs"`: `(source, target)` strings, for
translation) or documents (`kind="text"`: one string per document, for language models),
streamed, so a corpus larger than memory is never held whole. The task asks for the kind
it needs; preparation (`data/prepare.py`) tokenizes what the source yields and caches the
result under a key that includes `fingerprint(split)`, so a changed input file is prepared
again instead of silently reused.

Helpers here read user files line by line, with one-line errors that name the file and
line (`DataError`) for text that is not UTF-8 or JSON that does not parse.
"""

from __future__ import annotations

import abc
import glob
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxformer.errors import DataError

PAIRS, TEXT = "pairs", "text"
SPLITS = ("train", "validation", "test")


class Source(abc.ABC):
  """Base class of the registered sources (`data/sources/__init__.py`).

  Subclasses are built as `cls(data, kind)` from the run's `DataConfig` and the kind the
  task needs (`PAIRS` or `TEXT`), and implement `splits`, `examples` and `fingerprint`.
  `name` is a short label used in cache folder names and messages; `argument` names what a
  source takes after a colon in `data.dataset` (empty: nothing).
  """

  name = "source"
  argument = ""  # what follows `NAME:` in data.dataset (e.g. tfds:NAME), if the source takes one

  def __init__(self, data: Any, kind: str):
    self.data, self.kind = data, kind

  @classmethod
  def validate_settings(cls, data: Any) -> None:
    """Checks the `DataConfig` settings that belong to sources; this one reads no files of the user's,
    so it refuses `data.*_files` and the JSONL field names (`Files` takes them).

    Raises:
      DataError: one line naming the setting and the fix.
    """
    given = [k for k in ("train_files", "validation_files", "test_files") if getattr(data, k)]
    if given:
      raise DataError(
        f"data.{given[0]} is set but data.dataset={data.dataset}; add data.dataset=files to train "
        "on your files, or drop data.*_files"
      )
    if data.messages_field or data.prompt_field or data.completion_field:
      raise DataError(
        "data.prompt_field/completion_field/messages_field read your JSONL files: "
        "set data.dataset=files and data.train_files=FILE.jsonl"
      )

  @abc.abstractmethod
  def splits(self) -> tuple[str, ...]:
    """The splits this source has, a subset of `SPLITS` that includes `train`."""

  @abc.abstractmethod
  def examples(self, split: str) -> Iterator[Any]:
    """`(source, target)` str pairs (kind pairs) or document strings (kind text), in a fixed order."""

  @abc.abstractmethod
  def fingerprint(self, split: str) -> dict[str, Any]:
    """JSON-serialisable facts that change whenever the split's content may have changed."""

  def describe(self, split: str) -> str:
    """Where the split comes from, for log lines."""
    return f"{self.name} {split}"


def file_fingerprint(paths: list[Path]) -> list[list[Any]]:
  """(path, size in bytes, modification time in ns) of each file."""
  return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def expand_paths(spec: str, key: str) -> list[Path]:
  """Comma-separated paths or globs -> existing files, in order (a glob's matches sorted).

  Raises:
    FileNotFoundError: a path does not exist or a glob matches nothing (one line naming `key`).
  """
  out: list[Path] = []
  for item in (s.strip() for s in spec.split(",")):
    if not item:
      continue
    pattern = os.path.expanduser(item)
    if glob.has_magic(pattern):
      matches = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
      if not matches:
        raise FileNotFoundError(f"{key}: the glob {item!r} matches no file; check the pattern")
      out += matches
    elif Path(pattern).is_file():
      out.append(Path(pattern))
    elif Path(pattern).is_dir():
      raise FileNotFoundError(f"{key}: {item!r} is a directory; give files, or a glob such as {item.rstrip('/')}/*.txt")
    else:
      raise FileNotFoundError(f"{key}: the file {item!r} does not exist; check the path")
  return out


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
  """(1-based line number, line without its newline) of a UTF-8 text file, gzip if `.gz`.

  Raises:
    DataError: a line is not valid UTF-8 (names the file, line and byte).
  """
  opener = gzip.open if path.suffix == ".gz" else open
  number = 0
  try:
    with opener(path, "rb") as f:
      for number, raw in enumerate(f, 1):
        try:
          line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark is not text
        except UnicodeDecodeError as e:
          raise DataError(
            f"{path}:{number}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
            "convert the file to UTF-8, e.g. with iconv"
          ) from None
        yield number, line.rstrip("\r\n")
  except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a truncated .gz ends in EOFError
    kind = "not a valid or complete gzip file" if path.suffix == ".gz" else "cannot be read"
    raise DataError(f"{path}: {kind} (after line {number}: {e}); check the file") from None


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
  """(line number, object) of each non-blank line of a JSON-lines file.

  Raises:
    DataError: a line is not a JSON object (names the file and line).
  """
  for number, line in read_lines(path):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(
        f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object"
      ) from None
    if not isinstance(record, dict):
      raise DataError(
        f"{path}:{number}: a JSON {type(record).__name__}, not an object; each line must be one JSON object"
      )
    yield number, record


def field(record: dict, key: str, where: str, setting: str) -> str:
  """`record[key]` as a string; null is the empty string (an empty side is dropped and counted).

  Raises:
    DataError: the key is missing (lists the keys that exist and the setting to change), or
      its value is a list or an object rather than text.
  """
  if key not in record:
    raise DataError(f"{where}: no field {key!r}; the fields are {', '.join(map(str, record)) or 'none'}; set {setting}")
  value = record[key]
  if value is None:
    return ""
  if isinstance(value, (list, dict)):
    raise DataError(
      f"{where}: field {key!r} holds a JSON {'list' if isinstance(value, list) else 'object'}, "
      f"not text; point {setting} at a text field"
    )
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def chat_messages(record: dict, key: str, where: str) -> list[dict[str, str]]:
  """`record[key]` as an OpenAI-style chat: a non-empty list of `{"role": str, "content": str}`.

  Raises:
    DataError: the key is missing, or the value is not such a list (names `where`, file:line).
  """
  if key not in record:
    raise DataError(
      f"{where}: no field {key!r}; the fields are {', '.join(map(str, record)) or 'none'}; set data.messages_field"
    )
  chat = record[key]
  if (
    not isinstance(chat, list)
    or not chat
    or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in chat
    )
  ):
    raise DataError(
      f'{where}: field {key!r} must be a non-empty list of {{"role": ..., "content": ...}} objects with text values'
    )
  return [{"role": m["role"], "content": m["content"]} for m in chat]
