"""The run's vocabulary: an existing SentencePiece file, SentencePiece models trained on a
bounded sample of the train split (cached under a key of the source's content and the
settings), shared by source and target or one per side, or the character vocabulary of a
language model's text.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from jaxformer.data.prepare import cache_key
from jaxformer.data.sft import example_text
from jaxformer.data.sources.base import PAIRS, Source
from jaxformer.data.tokenizer import CharTokenizer, Tokenizer, train_tokenizer
from jaxformer.errors import ConfigError, DataError, VocabularyTooLarge


def reservoir_sample(items: Iterable[str], size: int, seed: int = 0) -> list[str]:
  """A uniform sample of at most `size` items in one streaming pass (Vitter's algorithm R).

  Memory holds `size` items whatever the stream's length; a stream no longer than `size`
  comes back whole, in order.
  """
  rng = random.Random(seed)
  sample: list[str] = []
  for n, item in enumerate(items):
    if n < size:
      sample.append(item)
    else:
      j = rng.randrange(n + 1)
      if j < size:
        sample[j] = item
  return sample


class Vocabulary(NamedTuple):
  """The tokenizers of a run: `source` encodes the inputs, `target` the targets (and a
  language model's text); the same object when the vocabulary is shared."""

  source: Any
  target: Any

  @property
  def shared(self) -> bool:
    """Whether source and target use one tokenizer (the same object)."""
    return self.source is self.target


def _training_texts(source: Source, sides: tuple[int, ...] = (0, 1)) -> Iterator[str]:
  """Sentences the SentencePiece model learns from: the given sides of each train pair (0
  source, 1 target; sources first, then targets, as the pairs stream once per side), or
  each train document's paragraphs with their blank-line separator (so the model learns it)."""
  if source.kind == PAIRS:
    for side in sides:
      yield from (pair[side].strip() for pair in source.examples("train"))
    return
  for doc in source.examples("train"):
    yield from (p + "\n\n" for p in example_text(doc).split("\n\n"))


def train_fitting(sample: list[str], vocab_size: int, model_type: str, attempts: int = 8):
  """A SentencePiece model of `vocab_size` pieces, or of the largest size the text supports.

  SentencePiece's estimate of the largest workable size can itself be too high, so training
  retries at each new estimate; when the size had to shrink, one line on stderr says so (the
  model keeps `vocab_size` ids; the top ones are never produced).
  """
  size = vocab_size
  for _ in range(attempts):
    try:
      tokenizer = train_tokenizer(sample, size, model_type)
    except VocabularyTooLarge as e:
      size = min(e.limit, size - 1)
      continue
    if size != vocab_size:
      print(
        f"the train split supports {size} SentencePiece pieces, fewer than the {vocab_size} asked for: "
        f"trained {size} (model.vocab_size can be lowered to match)",
        file=sys.stderr,
        flush=True,
      )
    return tokenizer
  raise DataError(
    f"SentencePiece found too little text for a vocabulary (last try: {size} pieces); add text "
    "or lower model.vocab_size"
  )


def char_tokenizer(source: Source) -> CharTokenizer:
  """The character vocabulary of every split's text (PAD, then one id per character, sorted)."""
  chars: set[str] = set()
  for split in source.splits():
    for doc in source.examples(split):
      chars.update(example_text(doc))
  return CharTokenizer("".join(sorted(chars)))


def fit_vocab_size(config: Any, source: Source, reserved: int = 0, vocab: Vocabulary | None = None):
  """`(config, vocab)` for a run whose character tokenizer is built from the data (`data.tokenizer=char`,
  no `data.tokenizer_model`); other runs come back unchanged.

  With `model.vocab_size` left unset (`model.vocab_from_data`) the config takes the character
  vocabulary's ids plus `reserved` (the masked LM's [MASK]), and one line on stderr says so.
  `vocab` is the run's saved vocabulary (a resumed run); None builds it from `source`'s text, and it
  comes back so the data is read with it.

  Raises:
    ConfigError: an explicit `model.vocab_size` smaller than the character ids plus `reserved` (one line).
  """
  data = config.data
  if data.tokenizer != "char" or data.tokenizer_model:
    return config, vocab
  if vocab is None:
    tokenizer = char_tokenizer(source)
    vocab = Vocabulary(tokenizer, tokenizer)
  ids = vocab.target.vocab_size
  if config.model.vocab_from_data:
    print(
      f"model.vocab_size={ids + reserved}: sized from the data ({ids - 1} characters + PAD"
      f"{f' + {reserved} reserved' if reserved else ''}); set model.vocab_size to fix it",
      file=sys.stderr,
      flush=True,
    )
    model = dataclasses.replace(config.model, vocab_size=ids + reserved, vocab_from_data=False)
    return dataclasses.replace(config, model=model), vocab
  if config.model.vocab_size < ids + reserved:
    raise ConfigError(
      f"the character vocabulary of the data has {ids} ids but model.vocab_size="
      f"{config.model.vocab_size} leaves {config.model.vocab_size - reserved} for them; set "
      f"model.vocab_size={ids + reserved}, or leave it unset to size it from the data"
    )
  return config, vocab


def make_vocabulary(data, source: Source, vocab_size: int, root: Path, reserved: int = 0) -> Vocabulary:
  """The tokenizers of a run whose model has `vocab_size` ids for text.

  Args:
    data: the `DataConfig` (`tokenizer`, `tokenizer_model`, `input_sentence_size`, `shared_vocab`).
    source: the run's source (its train split trains new SentencePiece models).
    vocab_size: ids the model has for tokens (`model.vocab_size`, less [MASK] for the masked LM).
    root: cache folder (`data.data_dir`).
    reserved: ids the model keeps beyond `vocab_size` (the masked LM's [MASK]), for messages.

  Returns:
    A `Vocabulary`: one tokenizer for both sides, or (`data.shared_vocab=false`, sentence
    pairs) one trained on each side's sentences.

  Raises:
    DataError: the tokenizer file is missing, invalid or has more ids than `vocab_size`, or
      the character vocabulary does not fit.
  """
  if data.shared_vocab or source.kind != PAIRS:
    tokenizer = _tokenizer(data, source, vocab_size, root, reserved, (0, 1))
    # Marian: one id space, each side segmented by its own SentencePiece model
    return Vocabulary(tokenizer.with_side("source") if data.tokenizer == "marian" else tokenizer, tokenizer)
  return Vocabulary(*(_tokenizer(data, source, vocab_size, root, reserved, (side,)) for side in (0, 1)))


def _tokenizer(data, source: Source, vocab_size: int, root: Path, reserved: int, sides: tuple[int, ...]):
  """One tokenizer, trained on `sides` of the train pairs (or the train documents)."""
  if data.tokenizer == "hf":
    from jaxformer.data.tokenizer_hf import HFTokenizer  # noqa: PLC0415  (needs the hf extra)

    try:
      tokenizer = HFTokenizer.load(data.tokenizer_model)
    except (FileNotFoundError, ValueError) as e:
      raise DataError(f"data.tokenizer_model={data.tokenizer_model!r}: {e}") from None
  elif data.tokenizer == "marian":
    from jaxformer.data.tokenizer_marian import MarianTokenizer  # noqa: PLC0415

    try:
      tokenizer = MarianTokenizer.load(data.tokenizer_model)
    except (FileNotFoundError, ValueError) as e:
      raise DataError(f"data.tokenizer_model={data.tokenizer_model!r}: {e}") from None
  elif data.tokenizer_model:
    path = Path(data.tokenizer_model).expanduser()
    if not path.is_file():
      raise DataError(
        f"data.tokenizer_model={data.tokenizer_model!r} does not exist; give the path of a SentencePiece .model file"
      )
    try:
      tokenizer = Tokenizer.load(path)
    except ValueError as e:
      raise DataError(f"data.tokenizer_model={data.tokenizer_model!r}: {e}") from None
  elif data.tokenizer == "char":
    tokenizer = char_tokenizer(source)
  else:
    key = cache_key(
      source.fingerprint("train"),
      source.kind,
      vocab_size,
      data.tokenizer,
      data.input_sentence_size,
      *([sides] if sides != (0, 1) else []),
    )
    side = {(0,): "-source", (1,): "-target"}.get(sides, "")
    path = root / "tokenizers" / f"{source.name}{side}-{data.tokenizer}{vocab_size}-{key}.model"
    if path.is_file():
      return Tokenizer.load(path)
    sample = reservoir_sample(_training_texts(source, sides), data.input_sentence_size)
    if not any(t.strip() for t in sample):
      raise DataError(
        f"the train split ({source.describe('train')}) has no text to train a tokenizer on; check the files"
      )
    tokenizer = train_fitting(sample, vocab_size, data.tokenizer)
    tokenizer.save(path)
  if tokenizer.vocab_size > vocab_size:
    what = f"data.tokenizer_model={data.tokenizer_model!r}" if data.tokenizer_model else "the character vocabulary"
    raise DataError(
      f"{what} has {tokenizer.vocab_size} ids but model.vocab_size={vocab_size + reserved} leaves "
      f"{vocab_size} for tokens; set model.vocab_size={tokenizer.vocab_size + reserved}"
    )
  return tokenizer
