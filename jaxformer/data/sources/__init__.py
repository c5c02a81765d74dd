"""The source registry: `data.dataset` -> the class that yields its raw examples.

Adding a source is one new module with a `Source` subclass (`sources/base.py`) and one line
here. Modules are imported on first use, so a run pays only for the source it reads.
"""

from __future__ import annotations

import importlib

from jaxformer.data.sources.base import PAIRS, SPLITS, TEXT, Source
from jaxformer.errors import DataError

SOURCES = {
  "multi30k": "jaxformer.data.sources.multi30k:Multi30k",
  "tinyshakespeare": "jaxformer.data.sources.tinyshakespeare:TinyShakespeare",
  "files": "jaxformer.data.sources.files:Files",
  "tfds": "jaxformer.data.sources.tfds:Tfds",  # data.dataset=tfds:NAME
}


def _source_class(key: str) -> type[Source]:
  module, cls = SOURCES[key].split(":")
  return getattr(importlib.import_module(module), cls)


def source_key(dataset: str) -> str:
  """The registry key of a `data.dataset` value: the part before `:` (`tfds:NAME` -> `tfds`).

  Raises:
    DataError: the dataset is not registered, or is given an argument it does not take (or
      lacks one it needs); lists the valid forms.
  """
  key = dataset.split(":", 1)[0]
  if key not in SOURCES or bool(_source_class(key).argument) != (":" in dataset):
    forms = [f"{k}:{_source_class(k).argument}" if _source_class(k).argument else k for k in SOURCES]
    raise DataError(f"data.dataset={dataset!r} is unknown; use one of {', '.join(forms)}")
  return key


def validate_settings(data) -> None:
  """Checks `data` (a `DataConfig`) as its `data.dataset`'s source requires (`Source.validate_settings`).

  Raises:
    DataError: an unknown dataset, or a setting that source refuses or lacks (one line).
  """
  _source_class(source_key(data.dataset)).validate_settings(data)


def make_source(data, kind: str) -> Source:
  """The source of `data.dataset` (a `DataConfig`), yielding `kind` (`PAIRS` or `TEXT`) examples."""
  return _source_class(source_key(data.dataset))(data, kind)


__all__ = ["PAIRS", "SOURCES", "SPLITS", "TEXT", "Source", "make_source", "source_key", "validate_settings"]
