"""Our SentencePiece tokenizer as a Hugging Face fast tokenizer (`tokenizer.json`), and back.

The `tokenizers` pipeline reproduces SentencePiece's segmentation: no normalizer (our models
are trained with the identity rule), a Metaspace pre-tokenizer (a `▁` before the text, spaces
become `▁`, pieces never cross a word boundary: SentencePiece's `add_dummy_prefix` and
`split_by_whitespace`), the same Unigram scores or BPE merges and byte fallback, and the
matching decoder. `AutoTokenizer.from_pretrained(DIR)` then gives our ids (tested on Multi30k).
The SentencePiece model itself is kept in the directory as `spiece.model`, so importing gives
back the bytes we exported.
"""

from __future__ import annotations

from pathlib import Path

from jaxformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer

SPM_FILE = "spiece.model"
_CONTROL, _BYTE = 3, 6  # SentencePiece piece types


def fast_tokenizer(tokenizer: Tokenizer, *, add_eos: bool, extra_pad: str | None = None, mask_id: int | None = None):
  """A `transformers.PreTrainedTokenizerFast` with `tokenizer`'s pieces and ids.

  Args:
    tokenizer: our SentencePiece tokenizer (pad 0, unk 1, bos 2, eos 3).
    add_eos: append EOS to every encoded text (a translation source, as our data pipeline does).
    extra_pad: name of one more token with id `vocab_size`, made the pad token (Marian keeps
      its pad as the last id); None: our id 0 is the pad token.
    mask_id: the masked LM's [MASK] id (the model's last), made the token `<mask>`; ids between
      the tokenizer's last piece and it become unused tokens `<unused_N>`.

  Raises:
    ValueError: the tokenizer is not a SentencePiece unigram or BPE model.
  """
  import tokenizers  # noqa: PLC0415  (the export extra)
  from sentencepiece import sentencepiece_model_pb2  # noqa: PLC0415
  from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
  from transformers.convert_slow_tokenizer import generate_merges  # noqa: PLC0415

  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(tokenizer.serialized)
  pieces = [p.piece for p in proto.pieces]
  if extra_pad is not None and pieces[PAD_ID] == extra_pad:
    pieces[PAD_ID] = "<blank>"  # one name, one id: the extra token takes the name
  byte_fallback = proto.trainer_spec.byte_fallback
  model_type = proto.trainer_spec.model_type
  if model_type == 1:
    model = tokenizers.models.Unigram(
      [(name, p.score) for name, p in zip(pieces, proto.pieces)], UNK_ID, byte_fallback=byte_fallback
    )
  elif model_type == 2:
    vocab = {name: i for i, name in enumerate(pieces)}
    model = tokenizers.models.BPE(
      vocab, generate_merges(vocab), unk_token=pieces[UNK_ID], byte_fallback=byte_fallback, fuse_unk=True
    )
  else:
    raise ValueError(
      f"the tokenizer is a SentencePiece model of type {model_type}; export supports unigram "
      "and bpe (data.tokenizer=unigram|bpe)"
    )
  fast = tokenizers.Tokenizer(model)
  fast.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
  fast.decoder = tokenizers.decoders.Sequence(
    [
      tokenizers.decoders.Replace("▁", " "),
      tokenizers.decoders.ByteFallback(),
      tokenizers.decoders.Fuse(),
      tokenizers.decoders.Strip(" ", 1, 0),
    ]
  )
  specials = [name for name, p in zip(pieces, proto.pieces) if p.type == _CONTROL or pieces.index(name) == UNK_ID]
  if extra_pad is not None:
    specials.append(extra_pad)
  if mask_id is not None:
    if mask_id < len(pieces):
      raise ValueError(
        f"[MASK] id {mask_id} is a piece of the tokenizer ({len(pieces)} pieces); a masked LM "
        "keeps [MASK] after the tokenizer's pieces"
      )
    specials += [f"<unused_{i}>" for i in range(len(pieces), mask_id)] + ["<mask>"]
  fast.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in specials])
  eos = pieces[EOS_ID]
  if add_eos:
    fast.post_processor = tokenizers.processors.TemplateProcessing(
      single=f"$A {eos}", pair=f"$A $B {eos}", special_tokens=[(eos, EOS_ID)]
    )
  return PreTrainedTokenizerFast(
    tokenizer_object=fast,
    unk_token=pieces[UNK_ID],
    bos_token=pieces[BOS_ID],
    eos_token=eos,
    pad_token=extra_pad or pieces[PAD_ID],
    **({"mask_token": "<mask>"} if mask_id is not None else {}),
  )


def save_tokenizer(
  tokenizer: Tokenizer,
  out: str | Path,
  vocab_size: int,
  *,
  add_eos: bool,
  extra_pad: str | None = None,
  mask: bool = False,
) -> None:
  """Writes `tokenizer.json`, `tokenizer_config.json` (loadable by `AutoTokenizer`) and our
  SentencePiece model `spiece.model` into the directory `out` (see `fast_tokenizer`; `mask`:
  the model's last id, `vocab_size - 1`, is [MASK])."""
  fast_tokenizer(
    tokenizer, add_eos=add_eos, extra_pad=extra_pad, mask_id=vocab_size - 1 if mask else None
  ).save_pretrained(str(out))
  (Path(out) / SPM_FILE).write_bytes(tokenizer.serialized)


def load_tokenizer(hf_dir: str | Path) -> Tokenizer:
  """Our tokenizer from a Hugging Face directory's `spiece.model` (a SentencePiece model with
  pad 0, unk 1, bos 2, eos 3: what `save_tokenizer` writes, and what Marian and Llama-style
  SentencePiece checkpoints with those ids hold as `source.spm` / `tokenizer.model`).

  Raises:
    FileNotFoundError: no SentencePiece model in `hf_dir`.
    ValueError: its special ids are not ours.
  """
  for name in (SPM_FILE, "source.spm", "tokenizer.model"):
    if (Path(hf_dir) / name).is_file():
      return Tokenizer.load(Path(hf_dir) / name)
  raise FileNotFoundError(
    f"{hf_dir} has no SentencePiece model ({SPM_FILE}, source.spm or tokenizer.model); "
    "import needs one with pad 0, unk 1, bos 2, eos 3"
  )
