"""The task protocol: what a model kind (translation, causal LM, masked LM) supplies to the
loop, the CLI, the benchmark and config validation.

A task binds a config to one model kind: it builds the model, loads and batches the data
it needs, computes the training outputs (logits, targets, loss weights, and the auxiliary
sums the model's layers sow, e.g. the mixture of experts' router losses) of a batch, and
evaluates a restored checkpoint. Nothing outside the two registries (`tasks/__init__.py`,
`data/sources/__init__.py`) dispatches on the model kind or dataset name.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import data as D
from jaxformer.errors import ConfigError
from jaxformer.layers.moe import AUX
from jaxformer.models import layout


@dataclasses.dataclass(frozen=True)
class EvalOptions:
  """What `jaxformer eval` asks of a task (fields a task does not use are ignored).

  split: `val`, `test` or None (the task's `default_split`); src / ref: files to score
  instead of a split (translation);
  batch_size: sentences per decoding batch; search: `inference.options.SearchOptions`; output: the
  hypotheses file, or a folder (the workdir) where it is named after the split and the
  search, or None (not written: the Python API's `score`); workdir: the run's folder, whose
  tokenizers encode the evaluation data; draft: None, or a function restoring the draft model of
  speculative greedy decoding.
  """

  split: str | None = None
  src: str | None = None
  ref: str | None = None
  batch_size: int = 64
  search: Any = None
  output: str | None = None
  workdir: str | None = None
  draft: Any = None  # () -> `inference.decode.Draft` (speculative decoding), restored after the model


class Task(abc.ABC):
  """Base class of the registered tasks; subclasses set the class attributes and implement
  `make_model`, `make_batches`, `outputs` and `evaluate`.

  Class attributes:
    kind: the `model.kind` it serves.
    data_kind: `data.PAIRS` (sentence pairs) or `data.TEXT` (a token stream).
    reserved_ids: ids the model has after the tokenizer's (the masked LM's [MASK]).
    needs_rng: whether the train step needs a key even without dropout (MLM masking).
    generates: whether `jaxformer generate` can sample text from the model.
    translates: whether the model translates (`jaxformer translate`, BLEU, teacher-forced logits
      from a source and decoder inputs).
    benchable: whether `jaxformer bench` times its train step on synthetic batches.
    attention_maps: (intermediates stack, attention module, panel title) of each kind of
      attention `jaxformer attention` draws, encoder side first.
    bert_embeddings: whether the model has the BERT-style embedding options
      (`model.embedding_norm`, `type_vocab_size`, `position_offset`).
    logits_bias: whether `model.logits_bias` (Marian's final_logits_bias) exists in the model.
    mlm_head: whether `model.mlm_head` (the masked LM's output transform) exists in the model.
    default_split: what `eval` scores without `--split` (`val` or `test`).
    validation_scores: metrics `score_validation` adds to the validation loss (`train.keep_best`
      may name them with a `val_` prefix).
  """

  kind = ""
  data_kind = D.PAIRS
  reserved_ids = 0
  needs_rng = False
  generates = False
  translates = False
  benchable = False
  attention_maps: tuple[tuple[str, str, str], ...] = ()
  bert_embeddings = False
  logits_bias = False
  mlm_head = False
  default_split = "test"
  validation_scores: tuple[str, ...] = ()

  def __init__(self, config):
    self.config = config

  def validate(self) -> None:
    """Raises ConfigError (one line) for settings this task cannot use; `Config.validate` calls it
    (subclasses extend it). Here: the model options only some kinds have.
    """
    m = self.config.model
    used = [
      f"model.{k}={getattr(m, k)}" for k in ("embedding_norm", "type_vocab_size", "position_offset") if getattr(m, k)
    ]
    if used and not self.bert_embeddings:
      raise ConfigError(
        f"{used[0]} acts in the decoder_only and encoder_only models; turn it off (false / 0) for model.kind={m.kind}"
      )
    if m.logits_bias and not self.logits_bias:
      raise ConfigError(
        f"model.logits_bias=true is the encoder-decoder's output bias (Marian's final_logits_bias); "
        f"set model.kind=encoder_decoder or model.logits_bias=false (model.kind={m.kind})"
      )
    if m.mlm_head and not self.mlm_head:
      raise ConfigError(
        f"model.mlm_head=true is the masked LM's output transform; set model.kind=encoder_only "
        f"or model.mlm_head=false (model.kind={m.kind})"
      )

  def batch_lengths(self) -> tuple[int, ...]:
    """The sequence lengths this task's batches can have (`data.max_length`; translation adds its buckets)."""
    return (self.config.data.max_length,)

  @abc.abstractmethod
  def make_model(self) -> nn.Module:
    """The Flax module of this kind for `config.model`."""

  def fit_vocab_size(self, vocab=None):
    """`(config, vocab)`: this task's config with `model.vocab_size` taken from a character vocabulary
    built from the data when left unset (`data.fit_vocab_size`), and that vocabulary (`vocab`, the
    run's saved one, if given).

    Raises:
      ConfigError: an explicit `model.vocab_size` too small for the character vocabulary.
    """
    return D.fit_vocab_size(self.config, D.make_source(self.config.data, self.data_kind), self.reserved_ids, vocab)

  def load_data(self, vocab=None, only: tuple[str, ...] | None = None) -> tuple[Any, dict[str, Any]]:
    """(`data.Vocabulary`, prepared splits); see `data.load_data`."""
    return D.load_data(self.config, self.data_kind, self.reserved_ids, vocab, only)

  @abc.abstractmethod
  def make_batches(self, splits, process_index: int = 0, process_count: int = 1):
    """(training batches with `.iterate(start_step)`, list of validation batches) of this process."""

  @abc.abstractmethod
  def outputs(self, model: nn.Module, params: Any, batch: dict[str, jax.Array], rng: jax.Array | None) -> Outputs:
    """The logits, targets, loss weights and auxiliary sums of `batch` (`Outputs`). `rng` None
    means evaluation (dropout off); otherwise it is the step's key."""

  def eval_split(self, options: EvalOptions) -> Any:
    """The prepared split `options.split` names (`val` or `test`), tokenized with the workdir's
    vocabulary.

    Raises:
      ValueError: the dataset has no such split.
    """
    from jaxformer.checkpoint.run_files import load_vocabulary  # noqa: PLC0415  (Orbax: only when evaluating)

    split = {"val": "validation", "test": "test"}[options.split or self.default_split]
    vocab = load_vocabulary(options.workdir) if options.workdir else None
    splits = self.load_data(vocab, only=(split,))[1]
    if split not in splits:
      raise ValueError(
        f"the dataset has no {split} split; give data.test_files when training, "
        "or use --split val" + (" or --src/--ref" if self.data_kind == D.PAIRS else "")
      )
    return splits[split]

  def score_validation(self, restored: Any, split: Any) -> dict[str, float]:
    """The `validation_scores` of `restored` (an `inference.restore.Restored` of the training params)
    on the prepared validation `split`; `train` calls it at each evaluation when
    `train.keep_best` names one of them."""
    return {}

  @abc.abstractmethod
  def evaluate(self, restore: Callable[[], Any], options: EvalOptions) -> dict[str, Any]:
    """The `eval` command's JSON result. `restore()` returns the `inference.restore.Restored`
    checkpoint; tasks check their inputs first, so a user mistake fails before the restore."""


class Outputs(NamedTuple):
  """What `Task.outputs` returns for the loss: float32 `logits` `[batch, length, vocab]`, int
  `targets` `[batch, length]`, float32 loss `weights` `[batch, length]` (1 on real targets, 0
  on padding), and `aux`, the auxiliary sums the model's layers sowed (`apply_model`)."""

  logits: jax.Array
  targets: jax.Array
  weights: jax.Array
  aux: dict[str, jax.Array]


def apply_model(
  model: nn.Module, params: Any, rng: jax.Array | None, *args, **kwargs
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`model.apply` with dropout on when `rng` is a key, off when it is None.

  Returns:
    (the model's output, the auxiliary-loss channel): the sums its layers sowed into the
    `layers.moe.AUX` collection as `{name: float32 [layers, ...]}`, one row per layer of every
    stack in `model.STACKS` order, whether the stacks are unrolled or scanned; {} when no
    layer sows (a model without experts).
  """
  rngs = None if rng is None else {"dropout": rng}
  out, state = model.apply({"params": params}, *args, deterministic=rng is None, rngs=rngs, mutable=[AUX], **kwargs)
  stacks = layout.layer_stacks(model)
  per_stack = layout.stack_layers(dict(state.get(AUX, {})), stacks)
  rows: dict[str, list[jax.Array]] = {}
  for name in stacks:
    for path, leaf in jax.tree_util.tree_flatten_with_path(per_stack.get(name, {}))[0]:
      rows.setdefault(path[-1].key, []).append(leaf)
  return out, {name: jnp.concatenate(leaves) for name, leaves in rows.items()}
