"""The special token ids a model and its tokenizer agree on, as data: `SpecialIds`.

Our own SentencePiece and character tokenizers use pad 0, unk 1, bos 2, eos 3 (the defaults
here); a published model brings its own (GPT-2: no pad, bos = eos = 50256; Llama: bos 1, eos 2;
Marian: eos 0, pad last), read from its config and tokenizer at import and kept in
`model.pad_id`, `model.bos_id`, `model.eos_id` and `model.decoder_start_id`.
"""

from __future__ import annotations

from typing import NamedTuple


class SpecialIds(NamedTuple):
  """Token ids with a role; -1 where the vocabulary has no such token.

  Attributes:
    pad: padding: masked as a key, never cached or generated, zero loss weight.
    unk: the unknown token.
    bos: the start of a sequence (our decoders' start token).
    eos: the end of a sequence: decoding stops there; data appends it.
    mask: the masked LM's [MASK].
    decoder_start: the first decoder input of an encoder-decoder (-1: `bos`; Marian: pad).
  """

  pad: int = 0
  unk: int = 1
  bos: int = 2
  eos: int = 3
  mask: int = -1
  decoder_start: int = -1

  @property
  def start(self) -> int:
    """The decoder's first input: `decoder_start`, or `bos` when it is -1."""
    return self.bos if self.decoder_start < 0 else self.decoder_start
