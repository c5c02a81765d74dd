"""Data: Multi30k via TFDS/ArrayRecord, SentencePiece tokenizer, batches.

The one call the CLI needs is :func:`prepare_translation_data`; batches come
from :class:`TrainBatches` and :func:`eval_batches` (``pipeline``).
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxformer.data import multi30k
from jaxformer.data.pipeline import (DEFAULT_BUCKETS, TokenizedSplit,
                                     TrainBatches, eval_batches, make_buckets,
                                     padding_fraction, stack_batches,
                                     tokenize_split)
from jaxformer.data.tokenizer import (BOS_ID, EOS_ID, PAD_ID, UNK_ID,
                                      Tokenizer, load_or_train_tokenizer,
                                      train_tokenizer)

SPLITS = ("train", "validation", "test")


def prepare_translation_data(
    data_dir: str | os.PathLike, vocab_size: int = 8000, max_length: int = 64,
    *, model_type: str = "unigram", source_lang: str = "en",
    target_lang: str = "de", train_overlong: str = "drop",
    tokenizer_dir: str | os.PathLike | None = None,
) -> tuple[Tokenizer, dict[str, TokenizedSplit]]:
  """Prepare Multi30k, train/load the shared tokenizer, tokenize all splits.

  Args:
    data_dir: TFDS data directory (ArrayRecord files are written here once).
    vocab_size: shared En+De SentencePiece vocabulary size.
    max_length: max tokens per side incl. EOS (last bucket).
    model_type: ``"unigram"``, ``"bpe"`` or ``"char"``.
    source_lang, target_lang: ``"en"``/``"de"`` (either direction).
    train_overlong: ``"drop"`` or ``"truncate"`` for the train split; the
      evaluation splits are always truncated so every sentence is kept.
    tokenizer_dir: where the tokenizer model is cached; default
      ``<data_dir>/tokenizers`` (file ``spm_<model_type>_<vocab_size>.model``).

  Returns:
    ``(tokenizer, {"train": TokenizedSplit, "validation": ..., "test": ...})``
    where each split holds ``inputs``/``targets`` (lists of int32 id arrays
    ending in EOS), ``source_texts``/``target_texts`` (raw strings, for
    BLEU) and ``index`` (position in the raw split).
  """
  langs = set(multi30k.LANGUAGES)
  if source_lang not in langs or target_lang not in langs or (
      source_lang == target_lang):
    raise ValueError(f"source_lang={source_lang!r}, target_lang="
                     f"{target_lang!r} is invalid; use 'en' and 'de'.")
  data_dir = Path(data_dir).expanduser()
  multi30k.prepare(data_dir)
  records = {s: multi30k.load_split(data_dir, s).read_all() for s in SPLITS}
  train = records["train"]
  cache = (Path(tokenizer_dir).expanduser() if tokenizer_dir
           else data_dir / "tokenizers")
  tokenizer = load_or_train_tokenizer(
      cache, lambda: [r["en"] for r in train] + [r["de"] for r in train],
      vocab_size, model_type)
  splits = {}
  for split, recs in records.items():
    splits[split] = tokenize_split(
        tokenizer, [r[source_lang] for r in recs],
        [r[target_lang] for r in recs], max_length,
        overlong=train_overlong if split == "train" else "truncate")
  return tokenizer, splits


__all__ = [
    "BOS_ID", "DEFAULT_BUCKETS", "EOS_ID", "PAD_ID", "SPLITS", "UNK_ID",
    "TokenizedSplit", "Tokenizer", "TrainBatches", "eval_batches",
    "load_or_train_tokenizer", "make_buckets", "multi30k", "padding_fraction",
    "prepare_translation_data", "stack_batches", "tokenize_split",
    "train_tokenizer",
]
