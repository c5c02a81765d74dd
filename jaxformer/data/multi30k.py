"""Multi30k (En-De) as an offline TFDS dataset stored in ArrayRecord files.

The raw data ships inside the package (``jaxformer/data/raw/multi30k/*.gz``,
one sentence per line, the ``.en`` and ``.de`` files line-aligned). The
:class:`Multi30k` builder turns them into a TFDS dataset without any network
access, and without TensorFlow: TFDS >= 4.9 writes the ``array_record`` file
format through the ``array_record`` package alone, and reads it back through
``builder.as_data_source`` (random access, no ``tf.data``).

Splits: ``train`` (29000 pairs), ``validation`` (1014), ``test`` (1000, the
``test_2016_flickr`` set). Records keep the original line order
(``disable_shuffling=True``), so record ``i`` is line ``i`` of the raw files.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Iterator, Sequence

import tensorflow_datasets as tfds
from etils import epath

RAW_DIR = Path(__file__).resolve().parent / "raw" / "multi30k"
SPLIT_FILES = {"train": "train", "validation": "val", "test": "test_2016_flickr"}
LANGUAGES = ("en", "de")
FILE_FORMAT = "array_record"


def read_lines(path: str | os.PathLike) -> list[str]:
  """Read a (optionally gzip-compressed) UTF-8 text file into stripped lines.

  Args:
    path: a ``.gz`` or plain text file.

  Returns:
    One ``str`` per line, with surrounding whitespace removed.

  Raises:
    FileNotFoundError: the file does not exist.
    ValueError: the file is empty.
  """
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(
        f"data file {path} is missing or empty: it does not exist; reinstall "
        "jaxformer or restore the file from the repository.")
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rt", encoding="utf-8") as f:
    lines = [line.strip() for line in f]
  while lines and not lines[-1]:  # Tolerate trailing blank lines only.
    lines.pop()
  if not lines:
    raise ValueError(
        f"data file {path} is missing or empty: it has no lines; reinstall "
        "jaxformer or restore the file from the repository.")
  return lines


def read_raw_split(split: str,
                   raw_dir: str | os.PathLike | None = None
                   ) -> tuple[list[str], list[str]]:
  """Read one split straight from the raw files (no TFDS).

  Args:
    split: ``"train"``, ``"validation"`` or ``"test"``.
    raw_dir: folder with the ``*.{en,de}.gz`` files; default: shipped data.

  Returns:
    ``(english_lines, german_lines)``, equally long lists of ``str``.

  Raises:
    ValueError: unknown split or the two sides have different line counts.
    FileNotFoundError: a raw file is missing.
  """
  if split not in SPLIT_FILES:
    raise ValueError(f"unknown Multi30k split {split!r}; use one of "
                     f"{sorted(SPLIT_FILES)}.")
  raw_dir = Path(raw_dir) if raw_dir is not None else RAW_DIR
  stem = SPLIT_FILES[split]
  en = read_lines(raw_dir / f"{stem}.en.gz")
  de = read_lines(raw_dir / f"{stem}.de.gz")
  if len(en) != len(de):
    raise ValueError(
        f"Multi30k split {split!r} in {raw_dir} is misaligned: {len(en)} "
        f"English vs {len(de)} German lines; restore the original files.")
  return en, de


class Multi30k(tfds.core.GeneratorBasedBuilder):
  """Multi30k English-German captions, generated offline from shipped files.

  Pass ``raw_dir=`` to the constructor to generate from other files (tests);
  note the prepared dataset on disk is not keyed on ``raw_dir``.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release from the shipped gz files."}

  # TFDS's default `code_path` lookup imports the optional `importlib_resources`
  # package (absent here) for classes defined inside a package; point it at
  # this file directly. It is only used to look for a (non-existent)
  # `checksums.tsv` next to the module.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(__file__)

  def __init__(self, *, raw_dir: str | os.PathLike | None = None, **kwargs):
    self._raw_dir = Path(raw_dir) if raw_dir is not None else RAW_DIR
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="Multi30k En-De (WMT16 multimodal task 1).",
        features=tfds.features.FeaturesDict({
            "en": tfds.features.Text(),
            "de": tfds.features.Text(),
        }),
        supervised_keys=("en", "de"),
        homepage="https://github.com/multi30k/dataset",
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Offline: nothing to download.
    return {split: self._generate_examples(split) for split in SPLIT_FILES}

  def _generate_examples(self, split: str) -> Iterator[tuple[int, dict]]:
    en, de = read_raw_split(split, self._raw_dir)
    for i, (e, d) in enumerate(zip(en, de)):
      yield i, {"en": e, "de": d}


def _builder(data_dir: str | os.PathLike, **kwargs) -> Multi30k:
  data_dir = os.path.expanduser(os.fspath(data_dir))
  return Multi30k(data_dir=data_dir, file_format=FILE_FORMAT,
                  **kwargs)


def prepare(data_dir: str | os.PathLike,
            raw_dir: str | os.PathLike | None = None) -> None:
  """Generate the ArrayRecord dataset under ``data_dir`` unless already there.

  Idempotent. TFDS writes into ``<data_dir>/multi30k/incomplete.*`` and
  renames to ``<data_dir>/multi30k/1.0.0`` only when complete, so an
  interrupted run leaves no half dataset (the next call regenerates).

  Args:
    data_dir: TFDS data directory (created if needed; ``~`` is expanded).
    raw_dir: optional folder with raw ``*.{en,de}.gz`` files.
  """
  builder = _builder(data_dir, raw_dir=raw_dir)
  builder.download_and_prepare(
      file_format=FILE_FORMAT,
      download_config=tfds.download.DownloadConfig(
          download_mode=tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS))


class DecodedSource(Sequence):
  """Random-access view of one split; items are ``{"en": str, "de": str}``."""

  def __init__(self, source):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def _decode(self, record) -> dict[str, str]:
    return {k: (v.decode("utf-8") if isinstance(v, bytes) else str(v))
            for k, v in record.items()}

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(len(self)))]
    return self._decode(self._source[index])

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, str]]:
    return [self._decode(r) for r in self._source.__getitems__(list(indices))]

  def read_all(self) -> list[dict[str, str]]:
    """All records in order (fast batched read)."""
    return self.__getitems__(range(len(self)))


def load_split(data_dir: str | os.PathLike, split: str) -> DecodedSource:
  """Open a prepared split as a random-access source (no TensorFlow needed).

  Args:
    data_dir: the directory given to :func:`prepare`.
    split: ``"train"``, ``"validation"`` or ``"test"``.

  Returns:
    A :class:`DecodedSource`: ``len()`` and ``[i] -> {"en": str, "de": str}``.

  Raises:
    FileNotFoundError: the dataset was not prepared in ``data_dir``.
    ValueError: unknown split.
  """
  if split not in SPLIT_FILES:
    raise ValueError(f"unknown Multi30k split {split!r}; use one of "
                     f"{sorted(SPLIT_FILES)}.")
  builder = _builder(data_dir)
  if not builder.is_prepared():
    raise FileNotFoundError(
        f"Multi30k is not prepared in {data_dir}; call "
        "jaxformer.data.multi30k.prepare(data_dir) first.")
  return DecodedSource(builder.as_data_source(split=split))
