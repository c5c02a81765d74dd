"""A published model's own tokenizer (`data.tokenizer=hf`): a Hugging Face `tokenizer.json` run by
the `tokenizers` library, with the special tokens and chat template of its `tokenizer_config.json`.

Text encodes as `AutoTokenizer(text)` would: the tokenizer's post-processor adds what the model
was trained with (Llama's BOS; BERT's [CLS] ... [SEP]; nothing for GPT-2). Decoding stops at
the first EOS and drops special tokens. The tokenizer travels with a workdir as one JSON file
(`serialized`: the `tokenizer.json` text and the special tokens), so restoring needs no other
file. Its `special_ids` are the ids of its special tokens (-1 where it has none).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.data.special_ids import SpecialIds

KIND = "hf"
TOKEN_KEYS = ("pad", "unk", "bos", "eos", "mask")  # tokenizer_config.json's `<name>_token` entries
SPM_FILES = ("spiece.model", "tokenizer.model")  # a slow tokenizer's SentencePiece model (T5; Llama, Mistral)


def slow_model(folder: str | Path) -> Path | None:
  """The SentencePiece model of a model directory without a `tokenizer.json` (`SPM_FILES`), or None."""
  return next((Path(folder) / f for f in SPM_FILES if (Path(folder) / f).is_file()), None)


def _token_text(entry: Any) -> str | None:
  """A tokenizer_config.json token entry (a string, or an AddedToken dict with `content`)."""
  if isinstance(entry, dict):
    return entry.get("content")
  return entry if isinstance(entry, str) else None


class HFTokenizer:
  """A `tokenizers.Tokenizer` with its special tokens; the interface of our SentencePiece `Tokenizer`
  (encode, encode_batch, decode, decode_batch, vocab_size, serialized, special_ids)."""

  def __init__(self, tokenizer_json: str, tokens: dict[str, str | None], chat_template: str | None = None):
    import tokenizers  # noqa: PLC0415  (the hf extra)

    self._json, self.tokens, self.chat_template = tokenizer_json, dict(tokens), chat_template
    self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    ids = {name: self._tok.token_to_id(text) if text else None for name, text in self.tokens.items()}
    self.special_ids = SpecialIds(**{name: -1 if ids.get(name) is None else ids[name] for name in TOKEN_KEYS})
    self._special = np.array(sorted(self._tok.get_added_tokens_decoder()), np.int64)

  @classmethod
  def load(cls, path: str | Path) -> HFTokenizer:
    """The tokenizer of a model directory (or of a `tokenizer.json` path, its config beside it).

    Raises:
      FileNotFoundError: no `tokenizer.json` there.
      ValueError: a file that is not valid JSON or not a tokenizer (one line naming it).
    """
    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    file = folder / "tokenizer.json" if path.is_dir() else path
    if not file.is_file() and path.is_dir() and slow_model(folder) is not None:
      return cls.from_sentencepiece(folder)
    if not file.is_file():
      raise FileNotFoundError(
        f"{file} is missing; data.tokenizer=hf needs a Hugging Face tokenizer.json "
        "(save one with AutoTokenizer's save_pretrained)"
      )
    settings = {}
    config = folder / "tokenizer_config.json"
    try:
      if config.is_file():
        settings = json.loads(config.read_text(encoding="utf-8"))
      tokens = {name: _token_text(settings.get(f"{name}_token")) for name in TOKEN_KEYS}
      return cls(file.read_text(encoding="utf-8"), tokens, settings.get("chat_template"))
    except Exception as e:  # tokenizers raises its own Exception type
      raise ValueError(f"{file}: not a Hugging Face tokenizer ({str(e).splitlines()[0]})") from None

  @classmethod
  def from_sentencepiece(cls, folder: str | Path) -> HFTokenizer:
    """The tokenizer of a model directory that has only a SentencePiece model (`SPM_FILES`: T5's
    `spiece.model`, Llama's `tokenizer.model`), converted by transformers as `AutoTokenizer`
    converts it (the same pieces, ids, normalization and special tokens).

    Raises:
      ValueError: transformers cannot load or convert it (one line).
    """
    from transformers import AutoTokenizer  # noqa: PLC0415  (the hf extra)

    try:
      fast = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, use_fast=True)
      tokenizer_json = fast.backend_tokenizer.to_str()
    except Exception as e:  # transformers and sentencepiece raise assorted types
      raise ValueError(
        f"{slow_model(folder)}: the SentencePiece model does not convert to a Hugging Face tokenizer "
        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); save one with "
        "AutoTokenizer's save_pretrained"
      ) from None
    tokens = {name: getattr(fast, f"{name}_token", None) for name in TOKEN_KEYS}
    return cls(
      tokenizer_json,
      {k: v if isinstance(v, str) else None for k, v in tokens.items()},
      getattr(fast, "chat_template", None),
    )

  @classmethod
  def from_bytes(cls, serialized: bytes) -> HFTokenizer:
    """The tokenizer `serialized` holds (see `serialized`)."""
    data = json.loads(serialized.decode("utf-8"))
    return cls(data["tokenizer"], data["tokens"], data.get("chat_template"))

  @property
  def added_token_ids(self) -> tuple[int, ...]:
    """The sorted ids of the tokenizer's added tokens (its special tokens among them), never text."""
    return tuple(int(i) for i in self._special)

  @property
  def serialized(self) -> bytes:
    """JSON bytes `{"type": "hf", "tokenizer": <tokenizer.json text>, "tokens": {...}, "chat_template": ...}`."""
    return json.dumps(
      {"type": KIND, "tokenizer": self._json, "tokens": self.tokens, "chat_template": self.chat_template}
    ).encode("utf-8")

  def save(self, folder: str | Path) -> None:
    """Writes `tokenizer.json` and a `tokenizer_config.json` (special tokens, chat template) that
    transformers' `AutoTokenizer` loads, into the existing directory `folder`."""
    folder = Path(folder)
    (folder / "tokenizer.json").write_text(self._json, encoding="utf-8")
    config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      **{f"{name}_token": text for name, text in self.tokens.items() if text},
    }
    if self.chat_template:
      config["chat_template"] = self.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

  @property
  def vocab_size(self) -> int:
    """Ids the tokenizer can produce, added tokens included."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, with the special tokens the tokenizer's post-processor adds."""
    return self._tok.encode(text).ids

  def encode_plain(self, text: str) -> list[int]:
    """Ids of `text` without the special tokens the post-processor adds."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, character spans `(start, end)` in `text`) without added special tokens."""
    encoding = self._tok.encode(text, add_special_tokens=False)
    return encoding.ids, encoding.offsets

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """:meth:`encode` of each text."""
    return [e.ids for e in self._tok.encode_batch(list(texts))]

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    """Text of `ids` up to the first EOS, without special tokens, padding or ids past the vocabulary."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    eos = self.special_ids.eos
    if eos >= 0 and np.any(ids == eos):
      ids = ids[: int(np.argmax(ids == eos))]
    keep = (ids >= 0) & (ids < self.vocab_size) & ~np.isin(ids, self._special)
    return self._tok.decode(ids[keep].tolist(), skip_special_tokens=True)

  def decode_batch(self, ids: np.ndarray | Sequence[Sequence[int]]) -> list[str]:
    """:meth:`decode` of each row of an `[batch, length]` int array."""
    return [self.decode(row) for row in ids]
