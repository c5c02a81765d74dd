"""`data.dataset=tinyshakespeare`: 1,115,394 characters of Shakespeare, for language models.

The text ships with the package (`jaxformer/data/raw/tinyshakespeare/input.txt.gz`). It is
split by character position, as is customary for this corpus: the first 90% is the train
split, the last 10% the validation split; each split is one document.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

from jaxformer.data.sources.base import PAIRS, Source, file_fingerprint
from jaxformer.errors import DataError

RAW_FILE = Path(__file__).resolve().parent.parent / "raw" / "tinyshakespeare" / "input.txt.gz"
TRAIN_FRACTION = 0.9


def read_text(path: Path = RAW_FILE) -> str:
  """The whole corpus as one string.

  Raises:
    FileNotFoundError: the file is missing.
  """
  if not path.is_file():
    raise FileNotFoundError(f"Tiny Shakespeare file {path} is missing; reinstall jaxformer or restore it")
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return f.read()


def split_text(text: str, train_fraction: float = TRAIN_FRACTION) -> tuple[str, str]:
  """(train, validation): the first `int(len * train_fraction)` characters, and the rest."""
  n = int(len(text) * train_fraction)
  return text[:n], text[n:]


class TinyShakespeare(Source):
  """The shipped Tiny Shakespeare text; see the module docstring."""

  name = "tinyshakespeare"

  def __init__(self, data, kind: str):
    super().__init__(data, kind)
    if kind == PAIRS:
      raise DataError(
        "data.dataset=tinyshakespeare is plain text for language models; "
        "a translation model needs multi30k, files or a tfds: dataset"
      )

  def splits(self) -> tuple[str, ...]:
    """`Source.splits`: train and validation (a split of the one shipped text)."""
    return ("train", "validation")

  def fingerprint(self, split: str) -> dict:
    """`Source.fingerprint`: the shipped file and the train fraction."""
    return {"files": file_fingerprint([RAW_FILE]), "train_fraction": TRAIN_FRACTION}

  def examples(self, split: str) -> Iterator[str]:
    """`Source.examples`: the split's text as one document."""
    train, validation = split_text(read_text())
    yield train if split == "train" else validation
