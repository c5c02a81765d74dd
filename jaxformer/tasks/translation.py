"""Translation with the paper's encoder-decoder (`model.kind=encoder_decoder`).

The model learns the logits of `targets` given `inputs` by teacher forcing (targets shifted
right behind BOS, per pair when packed). Evaluation decodes a split (or `--src` file) with
the chosen search, scores BLEU and chrF with sacrebleu, and reports the teacher-forced
loss of the references.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxformer import data as D
from jaxformer.config import ConfigError
from jaxformer.data.sources.base import read_lines
from jaxformer.models.transformer import EncoderDecoder
from jaxformer.tasks.base import EvalOptions, Outputs, Task, apply_model

# The extra keys of a packed batch (`data/packing.py`), passed to the model as they are.
PACKED_KEYS = ("inputs_segment_ids", "inputs_positions", "targets_segment_ids", "targets_positions")


def _read_lines(path: str, what: str) -> list[str]:
  """The lines of a `--src`/`--ref` file (UTF-8, `.gz` allowed); one-line errors name the file."""
  file = Path(path)
  if not file.is_file():
    raise FileNotFoundError(f"{what} file {path} does not exist")
  lines = [line for _, line in read_lines(file)]
  if not lines:
    raise ValueError(f"{what} file {path} is empty")
  return lines


def hypotheses_name(split: str, search) -> str:
  """`hypotheses.<split>.<strategy>.txt`: greedy, beam<k> or sample<seed>, so decoding a
  split another way does not overwrite the earlier file."""
  summary = search.summary()
  tag = {"beam": f"beam{summary.get('beam_size')}", "sample": f"sample{summary.get('seed')}"}.get(
    summary["strategy"], summary["strategy"]
  )
  return f"hypotheses.{split}.{tag}.txt"


class Translation(Task):
  """Sentence pairs -> `EncoderDecoder`; see the module docstring."""

  kind = "encoder_decoder"
  data_kind = D.PAIRS
  translates = True
  benchable = True
  attention_maps = (
    ("encoder", "self_attention", "encoder self-attention"),
    ("decoder", "self_attention", "decoder self-attention"),
    ("decoder", "cross_attention", "encoder-decoder attention"),
  )
  logits_bias = True
  validation_scores = ("bleu",)

  def validate(self) -> None:
    """`Task.validate`: the data buckets (unless packed), the tokenizer and the shared vocabulary.

    Raises:
      ConfigError: a setting a translation model cannot use.
    """
    super().validate()
    data = self.config.data
    if not data.packing:  # packed rows are data.max_length long: no buckets
      data.validate_buckets()
    if data.tokenizer == "char" and not data.tokenizer_model:
      raise ConfigError("data.tokenizer=char is for language models; use unigram or bpe for translation")
    if not data.shared_vocab and self.config.model.tie_embeddings:
      raise ConfigError(
        "data.shared_vocab=false gives source and target their own ids; set "
        "model.tie_embeddings=false (tied embeddings need one shared vocabulary)"
      )
    if not data.shared_vocab and data.tokenizer_model:
      raise ConfigError("data.tokenizer_model is one model for both sides; drop it or set data.shared_vocab=true")

  def batch_lengths(self) -> tuple[int, ...]:
    """`Task.batch_lengths`: `data.max_length` and the buckets."""
    return (self.config.data.max_length, *self.config.data.buckets)

  def make_model(self) -> EncoderDecoder:
    """`Task.make_model`: an `EncoderDecoder` model."""
    return EncoderDecoder(self.config.model)

  def make_batches(self, splits, process_index: int = 0, process_count: int = 1):
    """`Task.make_batches`: bucketed or packed sentence pairs (`data.pair_batches`)."""
    return D.pair_batches(self.config, splits, process_index, process_count)

  def outputs(self, model, params, batch, rng):
    """`Task.outputs`: teacher-forced logits, targets and weights (1 on non-PAD targets)."""
    packed = {k: batch[k] for k in PACKED_KEYS if k in batch}
    logits, aux = apply_model(model, params, rng, batch["inputs"], batch["targets"], **packed)
    return Outputs(logits, batch["targets"], (batch["targets"] != self.config.model.pad_id).astype(jnp.float32), aux)

  def eval_texts(self, options: EvalOptions) -> tuple[str, list[str], list[str]]:
    """(name, sources, references): the `--src`/`--ref` files or the split's texts.

    Raises:
      ValueError: only one of src/ref, files of different lengths, or a split the dataset lacks.
    """
    if options.src or options.ref:
      if not (options.src and options.ref):
        raise ValueError("--src and --ref must be given together")
      src, ref = _read_lines(options.src, "--src"), _read_lines(options.ref, "--ref")
      if len(src) != len(ref):
        raise ValueError(f"--src has {len(src)} lines but --ref has {len(ref)}; they must be line-aligned")
      return "custom", src, ref
    data = self.eval_split(options)
    sources, references = data.texts(range(len(data)))  # one read of the records
    return options.split or self.default_split, sources, references

  def score_validation(self, restored, split) -> dict[str, float]:
    """Greedy-decoding BLEU (sacrebleu) of the validation split against its references."""
    from jaxformer.inference.options import SearchOptions  # noqa: PLC0415
    from jaxformer.tasks import evaluate  # noqa: PLC0415  (evaluate imports the task registry)

    sources, references = split.texts(range(len(split)))
    hyps, _ = evaluate.translate(restored, sources, self.config.train.batch_size, SearchOptions())
    return {"bleu": evaluate.score(hyps, references)["bleu"]}

  def evaluate(self, restore, options: EvalOptions) -> dict[str, Any]:
    """Decodes and scores; writes the hypotheses to `options.output` (a file, or a folder
    that gets `hypotheses_name`), atomically, unless it is None."""
    from jaxformer.tasks import evaluate  # noqa: PLC0415  (evaluate imports the task registry)

    name, sources, references = self.eval_texts(options)
    restored = restore()
    draft = options.draft() if options.draft else None
    hyps, speed = evaluate.translate(restored, sources, options.batch_size, options.search, draft)
    losses = evaluate.reference_loss(restored, sources, references, options.batch_size)
    output = None
    if options.output is not None:
      output = Path(options.output)
      if output.is_dir():
        output = output / hypotheses_name(name, options.search)
      evaluate.write_lines_atomic(output, hyps)
    return {
      "step": restored.step,
      "split": name,
      "num_sentences": len(sources),
      **evaluate.score(hyps, references),
      **losses,
      **{k: round(v, 3) for k, v in speed.items()},
      "search": options.search.summary(),
      "hypotheses": None if output is None else str(output),
    }
