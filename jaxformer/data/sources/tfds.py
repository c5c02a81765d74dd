"""`data.dataset=tfds:NAME`: any TFDS dataset prepared beforehand, read without TensorFlow.

`NAME` is what `tfds.builder` takes (`wmt14_translate/de-en`, `lm1b`, `name/config:1.0.0`);
`data.tfds_data_dir` is the TFDS data dir it was prepared in (default: TFDS's own,
`~/tensorflow_datasets`). Records are read with `tfds.data_source`, which needs the dataset
in the `array_record` file format. Training never downloads: a dataset that is not prepared
gets one line naming the command that prepares it. Features: `data.source_field` /
`data.target_field` (default: the language labels) for translation, `data.text_field` for
language models. The split `validation` is also found as `dev`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from jaxformer.data.sources.base import PAIRS, Source, field
from jaxformer.errors import DataError

_READ_CHUNK = 1024  # records per batched read
_SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "dev", "valid"), "test": ("test",)}


def _prepare_hint(name: str, data_dir: str) -> str:
  where = f" --data_dir {data_dir}" if data_dir else ""
  return f"tfds build {name}{where} --file_format array_record"


class Tfds(Source):
  """A prepared TFDS dataset; see the module docstring."""

  name = "tfds"
  argument = "NAME"

  def __init__(self, data, kind: str):
    super().__init__(data, kind)
    import tensorflow_datasets as tfds  # noqa: PLC0415  heavy; only runs that use TFDS pay for it

    self._tfds = tfds
    self.dataset = data.dataset.split(":", 1)[1]
    if not self.dataset:
      raise DataError("data.dataset=tfds: needs a dataset name, e.g. tfds:wmt14_translate/de-en")
    data_dir = os.path.expanduser(data.tfds_data_dir) if data.tfds_data_dir else None
    self._data_dir = data_dir
    hint = _prepare_hint(self.dataset, data.tfds_data_dir)
    try:
      self._builder = tfds.builder(self.dataset, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
      raise DataError(
        f"TFDS has no dataset {self.dataset!r} registered here, nor prepared in "
        f"{data_dir or 'the default data dir'}; check the name, or prepare it: {hint}"
      ) from None
    except Exception as e:  # noqa: BLE001  tfds raises many kinds for a bad name or config
      raise DataError(f"cannot load TFDS dataset {self.dataset!r} ({str(e).splitlines()[0]}); check the name") from None
    if not self._builder.is_prepared():
      raise DataError(
        f"TFDS dataset {self.dataset!r} is not prepared in {self._builder.data_dir}; "
        f"prepare it first (training never downloads): {hint}"
      )
    formats = self._builder.info.file_format
    if formats is not None and "array_record" not in str(getattr(formats, "value", formats)).lower():
      raise DataError(
        f"TFDS dataset {self.dataset!r} is stored as {formats}; reading without TensorFlow needs array_record: {hint}"
      )
    self._splits = {}
    available = set(self._builder.info.splits.keys())
    for split, aliases in _SPLIT_ALIASES.items():
      found = next((a for a in aliases if a in available), None)
      if found:
        self._splits[split] = found
    if "train" not in self._splits:
      raise DataError(f"TFDS dataset {self.dataset!r} has no train split (it has {', '.join(sorted(available))})")

  def splits(self) -> tuple[str, ...]:
    """`Source.splits`: the splits of the TFDS dataset this source maps."""
    return tuple(self._splits)

  def fingerprint(self, split: str) -> dict:
    """`Source.fingerprint`: the dataset, its folder, version and `dataset_info.json` time, and the fields."""
    info = Path(self._builder.data_dir) / "dataset_info.json"
    stamp = info.stat().st_mtime_ns if info.is_file() else 0
    d = self.data
    return {
      "dataset": self.dataset,
      "dir": str(self._builder.data_dir),
      "version": str(self._builder.version),
      "stamp": stamp,
      "split": self._splits[split],
      "fields": [d.source_field, d.target_field, d.text_field],
      "langs": [d.source_lang, d.target_lang],
    }

  def describe(self, split: str) -> str:
    """`Source.describe`: the TFDS dataset, split and folder."""
    return f"TFDS {self.dataset} [{self._splits[split]}] in {self._builder.data_dir}"

  def examples(self, split: str) -> Iterator:
    """`Source.examples`: the split's records as `(source, target)` pairs or document strings."""
    source = self._builder.as_data_source(split=self._splits[split])
    d = self.data
    where = f"TFDS {self.dataset}"
    features = list(self._builder.info.features.keys())
    if self.kind == PAIRS:
      keys, setting = (
        (d.source_field or d.source_lang, d.target_field or d.target_lang),
        "data.source_field and data.target_field",
      )
    else:
      keys, setting = (d.text_field,), "data.text_field"
    for key in keys:
      if key not in features:
        raise DataError(f"{where}: no feature {key!r}; the features are {', '.join(features)}; set {setting}")
    for start in range(0, len(source), _READ_CHUNK):
      for record in source.__getitems__(list(range(start, min(start + _READ_CHUNK, len(source))))):
        values = tuple(field(record, k, where, setting) for k in keys)
        yield values if self.kind == PAIRS else values[0]
