"""`data.dataset=multi30k`: Multi30k English-German captions (WMT16 multimodal task 1).

The raw files ship inside the package (`jaxformer/data/raw/multi30k/*.gz`, one sentence
per line, `.en` and `.de` line-aligned). Splits: `train` (29,000 pairs), `validation`
(1,014) and `test` (1,000, the test_2016_flickr set). Either direction trains
(`data.source_lang` / `data.target_lang` = en, de). A language model reads the source-side
sentences, one document each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from jaxformer.data.sources.base import PAIRS, Source, file_fingerprint, read_lines
from jaxformer.errors import DataError

RAW_DIR = Path(__file__).resolve().parent.parent / "raw" / "multi30k"
SPLIT_FILES = {"train": "train", "validation": "val", "test": "test_2016_flickr"}
LANGUAGES = ("en", "de")


class Multi30k(Source):
  """The shipped Multi30k files; see the module docstring."""

  name = "multi30k"
  raw_dir = RAW_DIR

  def __init__(self, data, kind: str):
    super().__init__(data, kind)
    if {data.source_lang, data.target_lang} != set(LANGUAGES):
      raise DataError(
        f"data.dataset=multi30k has en and de; got data.source_lang={data.source_lang!r}, "
        f"data.target_lang={data.target_lang!r} (use en,de or de,en)"
      )

  def splits(self) -> tuple[str, ...]:
    """`Source.splits`: the shipped train, validation and test2016 files."""
    return tuple(SPLIT_FILES)

  def _paths(self, split: str) -> list[Path]:
    langs = (self.data.source_lang, self.data.target_lang)
    paths = [self.raw_dir / f"{SPLIT_FILES[split]}.{lang}.gz" for lang in langs]
    for p in paths:
      if not p.is_file():
        raise FileNotFoundError(f"Multi30k file {p} is missing; reinstall jaxformer or restore it from the repository")
    return paths

  def fingerprint(self, split: str) -> dict:
    """`Source.fingerprint`: the split's two files (size and modification time)."""
    return {"files": file_fingerprint(self._paths(split))}

  def examples(self, split: str) -> Iterator:
    """`Source.examples`: aligned `(source, target)` lines of the split.

    Raises:
      DataError: the two files have different numbers of lines.
    """
    src, tgt = (list(line for _, line in read_lines(p)) for p in self._paths(split))
    while src and not src[-1] and tgt and not tgt[-1]:  # trailing blank lines
      src.pop(), tgt.pop()
    if len(src) != len(tgt):
      raise DataError(f"Multi30k split {split!r} is misaligned ({len(src)} vs {len(tgt)} lines); restore the files")
    if self.kind == PAIRS:
      return iter(zip(src, tgt))
    return iter(src)
