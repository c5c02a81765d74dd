"""Tiny Shakespeare for language modelling: tokenizers, the 90/10 split and window batches.

The text ships with the package (``raw/tinyshakespeare/input.txt.gz``, 1,115,394
characters). It is split by character position: the first 90% is the train split, the
last 10% the validation split (as is customary for this corpus). Two tokenizers:

  * ``char``: one id per distinct character of the whole text, ``PAD_ID=0`` reserved
    (:class:`CharTokenizer`); 65 characters give 66 ids.
  * ``bpe`` (or ``unigram``): a SentencePiece model (``data/tokenizer.py``) trained on
    the train split's paragraphs, cached in ``data_dir``.

Training batches (:class:`WindowBatches`) are windows of ``context + 1`` tokens at
random offsets of the train split; batch ``k`` is a pure function of ``(seed, k)``.
Validation (:func:`window_eval_batches`) covers the whole validation split once in
consecutive non-overlapping windows.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator

import numpy as np

from jaxformer.data.pipeline import _shard_rows
from jaxformer.data.tokenizer import PAD_ID, Tokenizer, load_or_train_tokenizer

RAW_FILE = Path(__file__).resolve().parent / "raw" / "tinyshakespeare" / "input.txt.gz"
TRAIN_FRACTION = 0.9


def read_text(path: str | Path = RAW_FILE) -> str:
  """The whole corpus as one string (gzip or plain UTF-8).

  Raises:
    FileNotFoundError: the file is missing.
  """
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"Tiny Shakespeare file {path} is missing; reinstall jaxformer or restore it")
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rt", encoding="utf-8") as f:
    return f.read()


def split_text(text: str, train_fraction: float = TRAIN_FRACTION) -> tuple[str, str]:
  """(train, validation): the first `int(len * train_fraction)` characters, and the rest."""
  n = int(len(text) * train_fraction)
  return text[:n], text[n:]


class CharTokenizer:
  """Character vocabulary: `PAD_ID=0`, then one id per character in sorted order.

  Same interface as the SentencePiece `Tokenizer` (encode, decode, vocab_size,
  serialized), so workdirs store either one as their tokenizer file.
  """

  def __init__(self, chars: str):
    if len(set(chars)) != len(chars) or not chars:
      raise ValueError("CharTokenizer needs a non-empty string of distinct characters")
    self.chars = chars
    self._ids = {c: i + 1 for i, c in enumerate(chars)}
    self._table = np.array([""] + list(chars), dtype=object)

  @classmethod
  def from_text(cls, text: str) -> "CharTokenizer":
    return cls("".join(sorted(set(text))))

  @classmethod
  def from_bytes(cls, serialized: bytes) -> "CharTokenizer":
    try:
      return cls(json.loads(serialized.decode("utf-8"))["chars"])
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"invalid character tokenizer file ({e}); retrain in a new workdir") from None

  @property
  def serialized(self) -> bytes:
    return json.dumps({"type": "char", "chars": self.chars}).encode("utf-8")

  @property
  def vocab_size(self) -> int:
    """Characters + PAD."""
    return len(self.chars) + 1

  def encode(self, text: str) -> list[int]:
    """Ids of `text`. Raises ValueError naming the first unknown character."""
    try:
      return [self._ids[c] for c in text]
    except KeyError as e:
      raise ValueError(f"character {e.args[0]!r} is not in the vocabulary of {len(self.chars)} characters") from None

  def decode(self, ids) -> str:
    """Text of `ids` (PAD and out-of-range ids are skipped)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ids = ids[(ids > 0) & (ids < self.vocab_size)]
    return "".join(self._table[ids].tolist())


def tokenizer_from_bytes(kind: str, serialized: bytes):
  """The workdir's tokenizer: `CharTokenizer` for kind `char`, else SentencePiece."""
  return CharTokenizer.from_bytes(serialized) if kind == "char" else Tokenizer.from_bytes(serialized)


def prepare_shakespeare(data_dir: str | Path, tokenizer: str = "char", vocab_size: int = 0):
  """Tokenizer and token arrays of the two splits.

  Args:
    data_dir: cache folder for the SentencePiece model and the encoded splits.
    tokenizer: `char`, `bpe` or `unigram`.
    vocab_size: SentencePiece vocabulary size (ignored for `char`).
  Returns:
    `(tokenizer, {"train": int32 [n_train], "validation": int32 [n_val]})`.
  """
  train_text, val_text = split_text(read_text())
  if tokenizer == "char":
    tok = CharTokenizer.from_text(train_text + val_text)
    return tok, {"train": np.array(tok.encode(train_text), np.int32),
                 "validation": np.array(tok.encode(val_text), np.int32)}
  cache = Path(data_dir).expanduser() / "tinyshakespeare"
  paragraphs = [p + "\n\n" for p in train_text.split("\n\n")]
  tok = load_or_train_tokenizer(cache, lambda: paragraphs, vocab_size, tokenizer)
  splits = {}
  for name, text in (("train", train_text), ("validation", val_text)):
    path = cache / f"{tokenizer}_{vocab_size}_{name}.npy"
    if not path.is_file():  # encoding the whole text as one string keeps decode(encode(t)) == t
      np.save(path, np.array(tok.encode(text), np.int32))
    splits[name] = np.load(path)
  return tok, splits


def windows(tokens: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  """int32 `[len(starts), length]`: row i is `tokens[starts[i]:starts[i] + length]`."""
  return tokens[starts[:, None] + np.arange(length)]


class WindowBatches:
  """Training batches of random windows; `batches[k]` is this process's rows of global
  batch k: `inputs` int32 `[batch_size // process_count, context]` and `targets` the same
  windows shifted one token ahead (`shift=True`, causal LM) or equal to `inputs`
  (`shift=False`, masked LM). Offsets come from `np.random.default_rng((seed, k))`.
  """

  def __init__(self, tokens: np.ndarray, batch_size: int, context: int, *, seed: int = 0, shift: bool = True,
               process_index: int = 0, process_count: int = 1):
    if len(tokens) < context + 2:
      raise ValueError(f"the training split has {len(tokens)} tokens, too few for windows of {context + 1}")
    self._tokens = np.asarray(tokens, np.int32)
    self._rows = _shard_rows(batch_size, process_index, process_count)
    self.batch_size, self.context, self.seed, self.shift = batch_size, context, seed, shift

  def __getitem__(self, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((self.seed, int(step)))
    starts = rng.integers(0, len(self._tokens) - self.context, self.batch_size)[self._rows]
    w = windows(self._tokens, starts, self.context + 1)
    return {"inputs": w[:, :-1], "targets": w[:, 1:] if self.shift else w[:, :-1]}

  def iterate(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    step = start_step
    while True:
      yield self[step]
      step += 1


def window_eval_batches(tokens: np.ndarray, batch_size: int, context: int, *, shift: bool = True,
                        process_index: int = 0, process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """The whole split once, in consecutive non-overlapping windows of `context` tokens.

  With `shift`, window i has inputs `tokens[i*context : (i+1)*context]` and targets one
  token ahead, so every token but the first is predicted exactly once; without it
  (masked LM) inputs = targets = the window. The last window and the last batch are
  padded with PAD (weight 0 in the loss). Returns this process's rows of each batch.
  """
  tokens = np.asarray(tokens, np.int32)
  n = len(tokens) - 1 if shift else len(tokens)   # predicted (or maskable) tokens
  # Padding targets have weight 0; the last real input token has a PAD target.
  num_windows = -(-n // context)
  padded_windows = -(-num_windows // batch_size) * batch_size
  flat = np.full(padded_windows * context + 1, PAD_ID, np.int32)
  flat[:len(tokens)] = tokens
  starts = np.arange(padded_windows) * context
  inputs = windows(flat, starts, context)
  targets = windows(flat, starts + 1, context) if shift else inputs.copy()
  rows = _shard_rows(batch_size, process_index, process_count)
  return [{"inputs": inputs[s:s + batch_size][rows], "targets": targets[s:s + batch_size][rows]}
          for s in range(0, padded_windows, batch_size)]
