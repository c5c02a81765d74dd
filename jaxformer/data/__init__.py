"""Data: sources (a registry), streaming preparation, tokenizers, batches, and the global batch.

The run's data path: `make_source` (what `data.dataset` names) -> `make_vocabulary` ->
`prepare_pairs` / `prepare_text` (cached ArrayRecord shards) -> batches
(`TrainBatches`/`PackedBatches`/`eval_batches` for sentence pairs, `WindowBatches` /
`window_eval_batches` for language models) -> `global_batch` (each process's rows into one
sharded array). Tasks (`jaxformer/tasks/`) call `load_data` with the kind of examples they
need and pick the batches.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.data.binpack import first_fit
from jaxformer.data.packing import PackedBatches, pack_rows
from jaxformer.data.pipeline import (
  DEFAULT_BUCKETS,
  TokenizedSplit,
  TrainBatches,
  eval_batches,
  make_buckets,
  padding_fraction,
  shard_rows,
  stack_batches,
  tokenize_split,
)
from jaxformer.data.prepare import PreparedPairs, PreparedText, prepare_pairs, prepare_text
from jaxformer.data.sources import PAIRS, SOURCES, SPLITS, TEXT, make_source, source_key
from jaxformer.data.tokenizer import (
  BOS_ID,
  EOS_ID,
  PAD_ID,
  UNK_ID,
  CharTokenizer,
  Tokenizer,
  tokenizer_from_bytes,
  train_tokenizer,
)
from jaxformer.data.vocab import Vocabulary, fit_vocab_size, make_vocabulary
from jaxformer.data.windows import ArrayStream, WindowBatches, window_eval_batches
from jaxformer.errors import DataError

HELD_OUT_PAIRS = 1000  # validation pairs taken from the end of train when no validation split is given
HELD_OUT_TEXT_FRACTION = 0.1  # the same for text: this share of the train tokens


def load_data(
  config, kind: str, reserved_ids: int = 0, vocab: Vocabulary | None = None, only: tuple[str, ...] | None = None
) -> tuple[Vocabulary, dict[str, Any]]:
  """The vocabulary and prepared splits of the configured dataset.

  Args:
    config: the run's `Config`.
    kind: `PAIRS` (sentence pairs) or `TEXT` (a token stream), as the task needs.
    reserved_ids: ids the model keeps after the tokenizer's (the masked LM's [MASK]).
    vocab: the tokenizers to use (a workdir's, when resuming or evaluating); None makes or
      loads them from the data settings.
    only: the splits wanted (default: all the source has); a held-out validation split
      also prepares train.

  Returns:
    `(Vocabulary, {"train": ..., "validation": ..., ["test": ...]})`: `PreparedPairs` or
    `PreparedText` per split (of those wanted). Without a validation split, the end of train
    is held out (`HELD_OUT_PAIRS` pairs, at most a tenth, or `HELD_OUT_TEXT_FRACTION` of the
    tokens).

  Raises:
    DataError, FileNotFoundError: bad data or settings (one line).
  """
  data = config.data
  source = make_source(data, kind)
  root = Path(data.data_dir).expanduser()
  if vocab is None:
    vocab = make_vocabulary(data, source, config.model.vocab_size - reserved_ids, root, reserved_ids)
  available = source.splits()
  wanted = set(available) | {"validation"} if only is None else set(only)
  if "validation" in wanted and "validation" not in available:
    wanted.add("train")
  splits: dict[str, Any] = {}
  for split in (s for s in available if s in wanted):
    if kind == PAIRS:
      overlong = data.overlong if split == "train" else "truncate"
      splits[split] = prepare_pairs(source, split, vocab, root, data.max_length, overlong, config.model.eos_id)
    else:
      eos = vocab.target.special_ids.eos
      splits[split] = prepare_text(source, split, vocab.target, root, eos_id=eos if eos >= 0 else None)
  if "validation" in wanted and "validation" not in available:
    train = splits["train"]
    n = len(train)
    held = min(HELD_OUT_PAIRS, n // 10) if kind == PAIRS else int(n * HELD_OUT_TEXT_FRACTION)
    if held < 1:
      raise DataError(
        f"the train split has {n} {'pairs' if kind == PAIRS else 'tokens'}, too few to hold out "
        "a validation split; give data.validation_files"
      )
    splits["train"], splits["validation"] = train.subset(0, n - held), train.subset(n - held, n)
    print(
      f"no validation split: holding out the last {held} {'pairs' if kind == PAIRS else 'tokens'} of train",
      file=sys.stderr,
      flush=True,
    )
  return vocab, splits


def absolute_paths(config):
  """`config` with its data paths (files, tokenizer model, data dirs) made absolute, so the
  config saved in a workdir works from any directory."""
  import dataclasses  # noqa: PLC0415

  data = config.data

  def absolute(spec: str) -> str:
    return ",".join(os.path.abspath(os.path.expanduser(p.strip())) for p in spec.split(",") if p.strip())

  keys = ("train_files", "validation_files", "test_files", "tokenizer_model", "data_dir", "tfds_data_dir")
  return dataclasses.replace(
    config, data=dataclasses.replace(data, **{k: absolute(getattr(data, k)) for k in keys if getattr(data, k)})
  )


def pair_batches(config, splits, process_index: int = 0, process_count: int = 1):
  """(training batches with `.iterate(start_step)`, list of validation batches) of sentence
  pairs for this process: packed rows (`data.packing`) or length buckets shuffled in runs
  of `train.steps_per_call` similar-length batches."""
  process = dict(process_index=process_index, process_count=process_count, pad_id=config.model.pad_id)
  data, batch_size, seed = config.data, config.train.batch_size, config.runtime.seed
  if data.packing:
    train = PackedBatches(splits["train"], batch_size, data.max_length, seed=seed, **process)
  else:
    train = TrainBatches(
      splits["train"], batch_size, data.buckets, seed=seed, group=config.train.steps_per_call, **process
    )
  return train, eval_batches(splits["validation"], batch_size, data.buckets, **process)


def window_batches(config, splits, shift: bool, process_index: int = 0, process_count: int = 1):
  """(training batches, validation batches) of token windows of `data.max_length` for this
  process; `shift`: targets one token ahead (causal LM), else the inputs (masked LM)."""
  kw = dict(
    shift=shift,
    packing=config.data.packing,
    process_index=process_index,
    process_count=process_count,
    pad_id=config.model.pad_id,
  )
  train = WindowBatches(
    splits["train"], config.train.batch_size, config.data.max_length, seed=config.runtime.seed, **kw
  )
  return train, lm_eval_batches(config, splits["validation"], shift, process_index, process_count)


def lm_eval_batches(config, split, shift: bool, process_index: int = 0, process_count: int = 1):
  """A whole split once in consecutive windows of `data.max_length` (`window_eval_batches`)."""
  return window_eval_batches(
    split,
    config.train.batch_size,
    config.data.max_length,
    shift=shift,
    packing=config.data.packing,
    process_index=process_index,
    process_count=process_count,
    pad_id=config.model.pad_id,
  )


def global_batch(local: dict[str, np.ndarray], mesh, rules=None) -> dict[str, Any]:
  """The global `[batch, length]` (or stacked `[steps, batch, length]`) arrays of every
  batch key, assembled from each process's rows and sharded over the data axes by `rules`
  (the run's `sharding.rules_for(config.mesh)`; None: the default rules)."""
  import jax  # noqa: PLC0415

  from jaxformer import sharding as sh  # noqa: PLC0415

  sharding = sh.batch_sharding(mesh, stacked=local["inputs"].ndim == 3, rules=rules or sh.LOGICAL_RULES)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items() if k != "index"}


__all__ = [
  "BOS_ID",
  "DEFAULT_BUCKETS",
  "EOS_ID",
  "HELD_OUT_PAIRS",
  "PAD_ID",
  "PAIRS",
  "SOURCES",
  "SPLITS",
  "TEXT",
  "UNK_ID",
  "ArrayStream",
  "absolute_paths",
  "CharTokenizer",
  "PackedBatches",
  "PreparedPairs",
  "PreparedText",
  "TokenizedSplit",
  "Tokenizer",
  "TrainBatches",
  "Vocabulary",
  "WindowBatches",
  "eval_batches",
  "first_fit",
  "fit_vocab_size",
  "global_batch",
  "lm_eval_batches",
  "load_data",
  "make_buckets",
  "make_source",
  "make_vocabulary",
  "pack_rows",
  "padding_fraction",
  "pair_batches",
  "prepare_pairs",
  "prepare_text",
  "shard_rows",
  "source_key",
  "stack_batches",
  "tokenize_split",
  "tokenizer_from_bytes",
  "train_tokenizer",
  "window_batches",
]
