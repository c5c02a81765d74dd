"""A published Marian / OPUS-MT tokenizer (`data.tokenizer=marian`; `data.tokenizer_model` is a directory
with `source.spm`, `target.spm` and `vocab.json`), encoding as transformers' `MarianTokenizer` does.

Sources are segmented by the source SentencePiece model, targets by the target one; either way the
pieces become ids through the one `vocab.json` (a piece it lacks is `<unk>`), so both sides share the
model's id space. A leading language code (`>>fra<<`, a vocabulary entry of multilingual models) is one
token. `encode` appends EOS (`</s>`, id 0 in published models), as `MarianTokenizer(text)` does;
`encode_plain` does not. Special-token strings inside a text are segmented as text. Decoding drops
the special tokens (pad, unk, eos and what follows it) and joins the pieces as `MarianTokenizer.decode(ids,
skip_special_tokens=True)` does, with the source model (transformers' default for one shared vocabulary).

A run's `Vocabulary` holds two of these, one per side (`with_side`); each carries both SentencePiece
models and the vocabulary in one JSON file (`serialized`, `{"type": "marian", ...}`), so a workdir
restores without the directory, and `save` writes the directory back for `MarianTokenizer.from_pretrained`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

from jaxformer.data.special_ids import SpecialIds
from jaxformer.data.tokenizer_hf import _token_text

KIND = "marian"
SIDES = ("source", "target")
SPM_FILES = {"source": "source.spm", "target": "target.spm"}
VOCAB_FILE = "vocab.json"
CONFIG_FILE = "tokenizer_config.json"
FILES = (*SPM_FILES.values(), VOCAB_FILE, CONFIG_FILE, "special_tokens_map.json")  # what import copies
TOKENS = {"unk": "<unk>", "eos": "</s>", "pad": "<pad>"}  # MarianTokenizer's defaults
SPACE = "\u2581"  # SentencePiece's word-boundary mark


def is_marian_dir(folder: str | Path) -> bool:
  """Whether `folder` holds a Marian tokenizer (both SentencePiece models and `vocab.json`)."""
  folder = Path(folder)
  return all((folder / name).is_file() for name in (*SPM_FILES.values(), VOCAB_FILE))


class MarianTokenizer:
  """One side of a Marian tokenizer; the interface of our SentencePiece `Tokenizer` (encode, encode_plain,
  encode_batch, decode, decode_batch, vocab_size, serialized, special_ids).

  Args:
    models: the serialized SentencePiece models, `{"source": bytes, "target": bytes}`.
    vocab: `vocab.json`: piece -> id.
    settings: `tokenizer_config.json`'s entries (special token names, languages), written back by `save`.
    side: "source" or "target": the SentencePiece model `encode` segments with.

  Raises:
    ValueError: an unknown side, a SentencePiece model that does not load, separate source and target
      vocabularies, or a special token missing from `vocab` (one line each).
  """

  def __init__(self, models: dict[str, bytes], vocab: dict[str, int], settings: dict, side: str = "target"):
    if side not in SIDES:
      raise ValueError(f"unknown Marian tokenizer side {side!r}; use source or target")
    if settings.get("separate_vocabs"):
      raise ValueError(
        "this Marian tokenizer has separate source and target vocabularies (separate_vocabs), "
        "which jaxformer's one-vocabulary Marian model cannot use"
      )
    self.models, self.vocab, self.settings, self.side = models, vocab, settings, side
    self._sp = {}
    for name, blob in models.items():
      self._sp[name] = spm.SentencePieceProcessor()
      try:
        self._sp[name].LoadFromSerializedProto(blob)
      except Exception as e:  # sentencepiece raises RuntimeError/OSError
        raise ValueError(f"{SPM_FILES[name]} is not a SentencePiece model ({e})") from None
    names = {key: _token_text(settings.get(f"{key}_token")) or text for key, text in TOKENS.items()}
    missing = [text for text in names.values() if text not in vocab]
    if missing:
      raise ValueError(
        f"{VOCAB_FILE} has no entry for the special token {missing[0]!r}; give the model's own vocab.json"
      )
    ids = {key: vocab[text] for key, text in names.items()}
    self.special_ids = SpecialIds(pad=ids["pad"], unk=ids["unk"], bos=-1, eos=ids["eos"], decoder_start=ids["pad"])
    self._pieces = {i: piece for piece, i in vocab.items()}
    self._dropped = np.array(sorted({ids["pad"], ids["unk"], ids["eos"]}), np.int64)

  @classmethod
  def load(cls, folder: str | Path, side: str = "target") -> MarianTokenizer:
    """The tokenizer of a Marian model directory (see the module docstring), segmenting with `side`'s model.

    Raises:
      FileNotFoundError: `source.spm`, `target.spm` or `vocab.json` missing.
      ValueError: an invalid file (one line naming it).
    """
    folder = Path(folder).expanduser()
    if not is_marian_dir(folder):
      raise FileNotFoundError(
        f"{folder} lacks source.spm, target.spm or vocab.json; data.tokenizer=marian needs a "
        "Marian model directory (MarianTokenizer's save_pretrained writes them)"
      )
    config = folder / CONFIG_FILE
    try:
      vocab = json.loads((folder / VOCAB_FILE).read_text(encoding="utf-8"))
      settings = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    except ValueError as e:
      raise ValueError(f"{folder}: {VOCAB_FILE} or {CONFIG_FILE} is not valid JSON ({e})") from None
    models = {name: (folder / file).read_bytes() for name, file in SPM_FILES.items()}
    return cls(models, vocab, settings, side)

  @classmethod
  def from_bytes(cls, serialized: bytes) -> MarianTokenizer:
    """The tokenizer `serialized` holds (see `serialized`)."""
    data = json.loads(serialized.decode("utf-8"))
    models = {name: base64.b64decode(data["models"][name]) for name in SIDES}
    return cls(models, data["vocab"], data["settings"], data["side"])

  @property
  def serialized(self) -> bytes:
    """JSON bytes `{"type": "marian", "side", "models": {side: base64 SentencePiece model}, "vocab", "settings"}`."""
    models = {name: base64.b64encode(blob).decode("ascii") for name, blob in self.models.items()}
    return json.dumps(
      {"type": KIND, "side": self.side, "models": models, "vocab": self.vocab, "settings": self.settings}
    ).encode("utf-8")

  def with_side(self, side: str) -> MarianTokenizer:
    """The same tokenizer segmenting with `side`'s SentencePiece model ("source" or "target")."""
    return MarianTokenizer(self.models, self.vocab, self.settings, side)

  def save(self, folder: str | Path) -> None:
    """Writes `source.spm`, `target.spm`, `vocab.json` and `tokenizer_config.json` into the existing
    directory `folder`, which transformers' `MarianTokenizer.from_pretrained` loads."""
    folder = Path(folder)
    for name, file in SPM_FILES.items():
      (folder / file).write_bytes(self.models[name])
    (folder / VOCAB_FILE).write_text(json.dumps(self.vocab, ensure_ascii=False, indent=2), encoding="utf-8")
    settings = {**self.settings, "tokenizer_class": "MarianTokenizer"}
    (folder / CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")

  @property
  def vocab_size(self) -> int:
    """Ids the vocabulary holds (its largest id plus one)."""
    return max(self.vocab.values()) + 1

  def encode_plain(self, text: str) -> list[int]:
    """Ids of `text` without EOS: a leading language code, then the side's pieces (unknown ones `<unk>`)."""
    code = []
    end = text.find("<<") if text.startswith(">>") else -1
    if end != -1:
      code, text = [text[: end + 2]], text[end + 2 :]
    unk = self.special_ids.unk
    return [self.vocab.get(piece, unk) for piece in code + self._sp[self.side].encode(text, out_type=str)]

  def encode(self, text: str) -> list[int]:
    """Ids of `text` followed by EOS (`MarianTokenizer(text)["input_ids"]`)."""
    return self.encode_plain(text) + [self.special_ids.eos]

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """:meth:`encode` of each text."""
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    """Text of `ids` up to the first EOS, without pad, unk or ids outside the vocabulary."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    eos = self.special_ids.eos
    if np.any(ids == eos):
      ids = ids[: int(np.argmax(ids == eos))]
    pieces = [self._pieces[i] for i in ids[~np.isin(ids, self._dropped)].tolist() if i in self._pieces]
    return self._sp["source"].decode_pieces(pieces).replace(SPACE, " ").strip()

  def decode_batch(self, ids: np.ndarray | Sequence[Sequence[int]]) -> list[str]:
    """:meth:`decode` of each row of an `[batch, length]` int array."""
    return [self.decode(row) for row in ids]
