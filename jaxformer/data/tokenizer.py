"""SentencePiece tokenizer with fixed special ids, trained in memory.

Ids: ``PAD_ID=0``, ``UNK_ID=1``, ``BOS_ID=2``, ``EOS_ID=3``. Training uses the
``identity`` normalization rule and keeps whitespace as is, so
``decode(encode(text)) == text`` for any text whose characters were seen in
training (and for *any* text when byte fallback is on, the default for
vocabularies of at least 1024 pieces).
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from jaxformer.data.special_ids import SpecialIds
from jaxformer.errors import VocabularyTooLarge

# Our tokenizers' special ids (`SpecialIds`' defaults): where they are defined for the package.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = SpecialIds()[:4]
MODEL_TYPES = ("unigram", "bpe", "char")
_BYTE_FALLBACK_MIN_VOCAB = 1024


class Tokenizer:
  """A SentencePiece model with ``PAD=0, UNK=1, BOS=2, EOS=3``."""

  def __init__(self, processor: spm.SentencePieceProcessor):
    specials = (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id())
    if specials != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
      raise ValueError(
        f"SentencePiece model has special ids (pad, unk, bos, eos)="
        f"{specials}, expected {(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}; train "
        "it with --pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3"
      )
    self._sp = processor

  @property
  def special_ids(self) -> SpecialIds:
    """Ours: pad 0, unk 1, bos 2, eos 3."""
    return SpecialIds()

  @classmethod
  def from_bytes(cls, serialized: bytes) -> Tokenizer:
    """Build from a serialized SentencePiece ``ModelProto`` (bytes)."""
    processor = spm.SentencePieceProcessor()
    try:
      processor.LoadFromSerializedProto(serialized)
    except Exception as e:  # sentencepiece raises RuntimeError/OSError.
      raise ValueError(f"not a SentencePiece model ({e}); give a .model file written by SentencePiece") from e
    return cls(processor)

  @classmethod
  def load(cls, path: str | os.PathLike) -> Tokenizer:
    """Load a ``.model`` file written by :meth:`save`."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
      raise FileNotFoundError(
        f"tokenizer file {path} is missing or empty; train one with train_tokenizer() or set data.tokenizer_model."
      )
    return cls.from_bytes(path.read_bytes())

  def save(self, path: str | os.PathLike) -> None:
    """Write the model atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(self.serialized)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, path)
    except BaseException:
      Path(tmp).unlink(missing_ok=True)
      raise

  @property
  def serialized(self) -> bytes:
    """The model as serialized ``ModelProto`` bytes."""
    return self._sp.serialized_model_proto()

  @property
  def vocab_size(self) -> int:
    """Number of ids (all ids lie in ``[0, vocab_size)``)."""
    return self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``; no BOS/EOS added."""
    return self._sp.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """:meth:`encode` for many texts at once (faster)."""
    return self._sp.encode(list(texts), out_type=int)

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    """Text of ``ids``: stops at the first EOS, skips PAD and BOS, and skips ids
    the model has beyond this tokenizer's (a model may have more ids than its
    tokenizer, e.g. when the text supported fewer pieces)."""
    out = []
    size = self.vocab_size
    for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
      if i == EOS_ID:
        break
      if i not in (PAD_ID, BOS_ID) and 0 <= i < size:
        out.append(i)
    return self._sp.decode(out)

  def decode_batch(self, ids: np.ndarray | Sequence[Sequence[int]]) -> list[str]:
    """:meth:`decode` of each row of an ``[batch, length]`` int array."""
    return [self.decode(row) for row in ids]


def train_tokenizer(
  texts: Iterable[str],
  vocab_size: int,
  model_type: str = "unigram",
  *,
  byte_fallback: bool | None = None,
  num_threads: int = 2,
) -> Tokenizer:
  """Train a SentencePiece model in memory (no files), deterministically.

  Args:
    texts: training sentences (empty ones are skipped), all of them used; bound
      their number upstream (``vocab.reservoir_sample``).
    vocab_size: number of pieces incl. the 4 specials. For ``"char"`` it is an
      upper bound (the vocabulary is the set of seen characters).
    model_type: ``"unigram"``, ``"bpe"`` or ``"char"``.
    byte_fallback: encode unseen characters as UTF-8 byte pieces (exact round
      trip for any text; needs 256 extra pieces). Default: on when
      ``vocab_size >= 1024`` and ``model_type != "char"``.
    num_threads: trainer threads. The model depends on their number (SentencePiece
      splits its sums by thread), not on timing or load: keep it fixed.

  Returns:
    The trained :class:`Tokenizer`.
  """
  if model_type not in MODEL_TYPES:
    raise ValueError(f"unknown tokenizer model_type {model_type!r}; use one of {MODEL_TYPES}.")
  if vocab_size < 8:
    raise ValueError(f"vocab_size={vocab_size} is too small; use at least 8.")
  sentences = [t for t in texts if t and not t.isspace()]
  if not sentences:
    raise ValueError("train_tokenizer got no non-empty texts; check the training data.")
  if byte_fallback is None:
    byte_fallback = model_type != "char" and vocab_size >= _BYTE_FALLBACK_MIN_VOCAB
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences),
      model_writer=model,
      vocab_size=vocab_size,
      model_type=model_type,
      pad_id=PAD_ID,
      unk_id=UNK_ID,
      bos_id=BOS_ID,
      eos_id=EOS_ID,
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      character_coverage=1.0,
      byte_fallback=byte_fallback,
      input_sentence_size=0,
      shuffle_input_sentence=False,
      hard_vocab_limit=(model_type != "char"),
      max_sentence_length=1 << 16,
      num_threads=num_threads,
      minloglevel=2,
    )
  except RuntimeError as e:
    limit = re.search(r"value <= (\d+)", str(e))
    if limit:
      raise VocabularyTooLarge(vocab_size, int(limit.group(1))) from None
    raise ValueError(f"SentencePiece training failed ({e}); try a smaller vocab_size or more training text.") from e
  return Tokenizer.from_bytes(model.getvalue())


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
  def from_text(cls, text: str) -> CharTokenizer:
    """A tokenizer over the distinct characters of `text`, in code point order."""
    return cls("".join(sorted(set(text))))

  @classmethod
  def from_bytes(cls, serialized: bytes) -> CharTokenizer:
    """The tokenizer `serialized` holds (JSON, as written by `serialized`).

    Raises:
      ValueError: the bytes are not a character tokenizer file.
    """
    try:
      return cls(json.loads(serialized.decode("utf-8"))["chars"])
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"invalid character tokenizer file ({e}); retrain in a new workdir") from None

  @property
  def serialized(self) -> bytes:
    """The tokenizer as JSON bytes (`{"type": "char", "chars": ...}`), read back by `from_bytes`."""
    return json.dumps({"type": "char", "chars": self.chars}).encode("utf-8")

  @property
  def special_ids(self) -> SpecialIds:
    """Pad 0 only: characters have no unk, bos or eos."""
    return SpecialIds(pad=PAD_ID, unk=-1, bos=-1, eos=-1)

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

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """:meth:`encode` of each text."""
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    """Text of `ids` (PAD and out-of-range ids are skipped)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ids = ids[(ids > 0) & (ids < self.vocab_size)]
    return "".join(self._table[ids].tolist())


def tokenizer_from_bytes(serialized: bytes):
  """A workdir's tokenizer file: a `CharTokenizer`, an `HFTokenizer` or a `MarianTokenizer` (JSON), or a
  SentencePiece model."""
  if serialized.startswith(b'{"type": "char"'):
    return CharTokenizer.from_bytes(serialized)
  if serialized.startswith(b'{"type": "hf"'):
    from jaxformer.data.tokenizer_hf import HFTokenizer  # noqa: PLC0415  (needs the hf extra)

    return HFTokenizer.from_bytes(serialized)
  if serialized.startswith(b'{"type": "marian"'):
    from jaxformer.data.tokenizer_marian import MarianTokenizer  # noqa: PLC0415

    return MarianTokenizer.from_bytes(serialized)
  return Tokenizer.from_bytes(serialized)
