"""Typed, validated run configuration: YAML files plus dotted `a.b=c` overrides.

A config is a tree of frozen dataclasses. `load_config(path, overrides)` reads the
YAML, applies overrides such as `train.num_steps=200`, checks every key and type,
and raises `ConfigError` (one line: what is wrong and how to fix it) on bad input.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxformer.config.mesh import MeshConfig
from jaxformer.config.model import ModelConfig
from jaxformer.config.options import validate_with_data
from jaxformer.config.policy import PrecisionConfig
from jaxformer.config.schema import apply_overrides, build, parse_override, to_plain
from jaxformer.errors import ConfigError, DataError

PLATFORMS = ("cpu", "gpu", "tpu")  # values of runtime.platform (JAX platform names)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """Adam with the paper's inverse-square-root warmup schedule (section 5.3), or AdamW
  with linear warmup and cosine decay (Loshchilov & Hutter 2019)."""

  optimizer: str = "adam"  # adam | adamw (decoupled weight decay, none on biases/norms/embeddings)
  schedule: str = "rsqrt"  # rsqrt (paper) | constant | cosine
  learning_rate: float = 1.0  # rsqrt: scale factor on d_model^-0.5 * min(...); constant/cosine: the peak rate
  warmup_steps: int = 4000  # linear warmup of the learning rate, steps
  decay_steps: int = 0  # cosine: step at which the rate reaches min_learning_rate
  min_learning_rate: float = 0.0  # cosine: final rate
  b1: float = 0.9  # Adam beta1 (paper: 0.9)
  b2: float = 0.98  # Adam beta2 (paper: 0.98)
  eps: float = 1e-9  # Adam epsilon (paper: 1e-9)
  weight_decay: float = 0.0  # adamw only
  clip_grad_norm: float = 0.0  # 0 disables global-norm clipping
  label_smoothing: float = 0.1  # epsilon_ls of the loss (paper section 5.4: 0.1)

  def validate(self) -> None:
    """Raises ConfigError (one line) for a non-finite or out-of-range optimizer setting."""
    for name in (
      "learning_rate",
      "min_learning_rate",
      "b1",
      "b2",
      "eps",
      "weight_decay",
      "clip_grad_norm",
      "label_smoothing",
    ):
      if not math.isfinite(getattr(self, name)):
        raise ConfigError(f"optim.{name} must be a finite number, got {getattr(self, name)}")
    if self.schedule not in ("rsqrt", "constant", "cosine"):
      raise ConfigError(f"optim.schedule={self.schedule!r} is unknown; use rsqrt, constant or cosine")
    if self.optimizer not in ("adam", "adamw"):
      raise ConfigError(f"optim.optimizer={self.optimizer!r} is unknown; use adam or adamw")
    if self.weight_decay < 0 or (self.weight_decay > 0 and self.optimizer != "adamw"):
      raise ConfigError(f"optim.weight_decay={self.weight_decay} needs optim.optimizer=adamw and a value >= 0")
    if self.schedule == "cosine" and self.decay_steps <= self.warmup_steps:
      raise ConfigError(
        f"optim.decay_steps={self.decay_steps} must exceed optim.warmup_steps="
        f"{self.warmup_steps} for the cosine schedule; e.g. optim.decay_steps=<train.num_steps>"
      )
    if self.schedule == "cosine" and not 0 <= self.min_learning_rate <= self.learning_rate:
      raise ConfigError(f"optim.min_learning_rate={self.min_learning_rate} must be in [0, optim.learning_rate]")
    if self.warmup_steps < 1:
      raise ConfigError(f"optim.warmup_steps must be >= 1, got {self.warmup_steps}")
    if not 0.0 <= self.label_smoothing < 1.0:
      raise ConfigError(f"optim.label_smoothing must be in [0, 1), got {self.label_smoothing}")
    if self.learning_rate <= 0:
      raise ConfigError(f"optim.learning_rate must be positive, got {self.learning_rate}")
    if self.min_learning_rate < 0:
      raise ConfigError(f"optim.min_learning_rate must be >= 0, got {self.min_learning_rate}")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ConfigError(
          f"optim.{name} (an Adam decay rate) must be in [0, 1), got {getattr(self, name)}; "
          "the paper uses b1=0.9, b2=0.98"
        )
    if self.eps <= 0:
      raise ConfigError(f"optim.eps must be > 0 (it keeps Adam's division finite), got {self.eps}; the paper uses 1e-9")
    if self.clip_grad_norm < 0:
      raise ConfigError(f"optim.clip_grad_norm must be >= 0 (0 disables clipping), got {self.clip_grad_norm}")


def check_directory(name: str, path: str | Path, writable: bool = False) -> None:
  """Checks that `path` is a directory, or could be created as one, before anything is
  written there: the nearest existing path (itself or an ancestor) must be a directory,
  writable when `writable`.

  Raises:
    ConfigError: naming `name` (a key or flag), the path and the fix.
  """
  path = Path(path).expanduser().absolute()
  existing = next(p for p in (path, *path.parents) if p.exists())
  if not existing.is_dir():
    raise ConfigError(
      f"{name}={path}: {existing} is a file, not a directory; give a directory path (it is created if missing)"
    )
  if writable and not os.access(existing, os.W_OK):
    raise ConfigError(
      f"{name}={path}: {existing} is not writable (read-only file system or no permission); give a writable directory"
    )


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the data comes from and how it is tokenized and batched (jaxformer/data/).

  For language models `max_length` is the context (window) length and `buckets` are unused.
  """

  dataset: str = "multi30k"  # multi30k | tinyshakespeare | files | tfds:NAME (tfds:wmt14_translate/de-en)
  train_files: str = ""  # files: comma-separated; translation SRC,TGT or one .jsonl/.tsv; LMs paths/globs
  validation_files: str = ""  # files: as train_files; empty = hold out the end of train
  test_files: str = ""  # files: as train_files (eval --split test)
  source_field: str = ""  # JSONL/TSV/TFDS key of the source text; empty = data.source_lang
  target_field: str = ""  # JSONL/TSV/TFDS key of the target text; empty = data.target_lang
  text_field: str = "text"  # JSONL/TFDS key of a language model's documents
  prompt_field: str = ""  # causal LM fine-tuning (JSONL): the prompt's key; the loss skips it
  completion_field: str = ""  # with prompt_field: the completion's key; the loss counts it and EOS
  messages_field: str = ""  # JSONL key of [{role, content}] chats, rendered by the tokenizer's chat_template
  source_lang: str = "en"  # free label of the source language (multi30k: en or de)
  target_lang: str = "de"  # free label of the target language (multi30k: en or de)
  tfds_data_dir: str = ""  # tfds: the TFDS data dir it was prepared in; empty = TFDS's default
  data_dir: str = "~/.cache/jaxformer"  # prepared (tokenized) splits and trained tokenizers are cached here
  tokenizer: str = "unigram"  # SentencePiece unigram | bpe; char (LMs); hf (a tokenizer.json); marian
  tokenizer_model: str = ""  # a SentencePiece .model; hf: a model dir or its tokenizer.json; marian: a dir
  shared_vocab: bool = True  # translation: one vocabulary for source and target; false = one per side
  input_sentence_size: int = 1000000  # SentencePiece trains on at most this many sentences, sampled from train
  max_length: int = 64  # tokens per side including EOS (language models: the context)
  overlong: str = "drop"  # drop | truncate (train split only)
  buckets: tuple[int, ...] = (12, 14, 16, 18, 20, 24, 32, 48, 64)  # padded lengths, tokens
  packing: bool = False  # several examples per row of max_length tokens, with segment ids
  mask_probability: float = 0.15  # masked LM: fraction of tokens selected (BERT: 15%)

  def validate(self) -> None:
    """Raises ConfigError (one line) for an unknown dataset or a bad data setting."""
    from jaxformer.data.sources import validate_settings  # noqa: PLC0415  (no JAX import)

    try:
      validate_settings(self)
    except DataError as e:
      raise ConfigError(str(e)) from None
    if not 0.0 < self.mask_probability < 1.0:
      raise ConfigError(f"data.mask_probability must be in (0, 1), got {self.mask_probability}")
    if not self.source_lang or not self.target_lang:
      raise ConfigError("data.source_lang and data.target_lang must be non-empty labels")
    if self.overlong not in ("drop", "truncate"):
      raise ConfigError(f"data.overlong={self.overlong!r} is unknown; use drop or truncate")
    if self.tokenizer not in ("unigram", "bpe", "char", "hf", "marian"):
      raise ConfigError(f"data.tokenizer={self.tokenizer!r} is unknown; use unigram, bpe, char, hf or marian")
    if self.tokenizer == "hf" and not self.tokenizer_model:
      raise ConfigError(
        "data.tokenizer=hf needs data.tokenizer_model: a Hugging Face model directory or its tokenizer.json"
      )
    if self.tokenizer == "marian" and not self.tokenizer_model:
      raise ConfigError(
        "data.tokenizer=marian needs data.tokenizer_model: a directory with source.spm, target.spm and vocab.json"
      )
    if self.input_sentence_size < 1:
      raise ConfigError(f"data.input_sentence_size must be >= 1, got {self.input_sentence_size}")
    if self.max_length < 2:
      raise ConfigError(f"data.max_length must be >= 2, got {self.max_length}")
    if bool(self.prompt_field) != bool(self.completion_field):
      raise ConfigError(
        "data.prompt_field and data.completion_field go together (prompt/completion JSONL rows); set both, or neither"
      )
    if self.messages_field and self.prompt_field:
      raise ConfigError(
        "data.messages_field (chats) and data.prompt_field/completion_field (pairs) are two ways "
        "to read fine-tuning rows; set one of them"
      )
    check_directory("data.data_dir", self.data_dir)

  def validate_buckets(self) -> None:
    """Checks `buckets` against `max_length` (tasks whose batches are length-bucketed call this)."""
    if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
      raise ConfigError(f"data.buckets={self.buckets} must be strictly increasing lengths")
    if self.buckets[-1] != self.max_length:
      fitting = [b for b in self.buckets if b < self.max_length] + [self.max_length]
      raise ConfigError(
        f"the last of data.buckets ({self.buckets[-1]}) must equal data.max_length "
        f"({self.max_length}); e.g. data.buckets=[{','.join(map(str, fitting))}]"
      )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Length of the run and how often it logs, evaluates and checkpoints (in steps)."""

  num_steps: int = 10000  # optimizer steps of the whole run
  batch_size: int = 64  # global, in sentence pairs
  log_every: int = 50  # steps between metrics.jsonl lines
  eval_every: int = 500  # validation loss
  eval_batches: int = 0  # validation batches per evaluation, the same first ones (shortest first for pairs); 0 = all
  checkpoint_every: int = 1000  # steps between checkpoints
  keep_checkpoints: int = 3  # newest checkpoints kept
  async_checkpoint: bool = True  # write checkpoints in the background
  z_loss: float = 0.0  # weight of log(Z)^2 per target token (PaLM uses 1e-4); 0 = off
  steps_per_call: int = 1  # optimizer steps per jitted call (one lax.scan); >1 saves per-call cost
  grad_accum_steps: int = 1  # microbatches per step (a lax.scan, token-weighted); batch_size must divide by it
  microbatches: int = 1  # GPipe microbatches per (accumulation) batch when mesh.stage > 1; else unused
  nan_policy: str = "abort"  # non-finite loss/gradients: abort (stop, naming the step) | skip (drop that update)
  max_consecutive_skips: int = 10  # nan_policy=skip: stop once this many steps in a row were non-finite
  # val_loss | val_nll | val_accuracy | val_bleu (translation): keep the best step in WORKDIR/best
  keep_best: str = ""
  early_stop_patience: int = 0  # stop after this many evaluations without improving keep_best (or val_loss); 0 = off

  def validate(self) -> None:
    """Raises ConfigError (one line) for a count < 1, a batch that grad_accum_steps does not split, or a bad policy."""
    if not 0.0 <= self.z_loss < math.inf:  # written so that NaN fails too
      raise ConfigError(f"train.z_loss must be a finite number >= 0, got {self.z_loss}")
    for name in (
      "num_steps",
      "batch_size",
      "log_every",
      "eval_every",
      "checkpoint_every",
      "keep_checkpoints",
      "steps_per_call",
      "grad_accum_steps",
      "microbatches",
      "max_consecutive_skips",
    ):
      if getattr(self, name) < 1:
        raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
    if self.batch_size % self.grad_accum_steps:
      raise ConfigError(
        f"train.batch_size={self.batch_size} does not split into train.grad_accum_steps="
        f"{self.grad_accum_steps} equal microbatches; use a train.batch_size that is a multiple "
        f"of {self.grad_accum_steps}"
      )
    if self.eval_batches < 0:
      raise ConfigError(f"train.eval_batches must be >= 0 (0 = the whole validation split), got {self.eval_batches}")
    if self.early_stop_patience < 0:
      raise ConfigError(f"train.early_stop_patience must be >= 0 (0 = off), got {self.early_stop_patience}")
    if self.nan_policy not in ("abort", "skip"):
      raise ConfigError(f"train.nan_policy={self.nan_policy!r} is unknown; use abort or skip")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
  """Process-level settings that do not change the model."""

  seed: int = 0  # initialisation, data order and dropout
  num_cpu_devices: int = 0  # >0: simulate this many CPU devices (multi-device runs on a laptop)
  platform: str = ""  # "" picks JAX's default backend; cpu | gpu | tpu forces one
  deterministic: bool = True  # the same bits under any load or CPU count (see runtime/startup.py); false = fastest
  cpu_threads: int = 2  # XLA:CPU threads when deterministic (results depend on it); fast mode: all CPUs

  def validate(self) -> None:
    """Raises ConfigError (one line) for an unknown platform, a negative device count or cpu_threads < 1."""
    if self.platform not in ("", *PLATFORMS):
      raise ConfigError(
        f"runtime.platform={self.platform!r} is unknown; use {' | '.join(PLATFORMS)}, "
        "or leave it empty for JAX's default"
      )
    if self.num_cpu_devices < 0:
      raise ConfigError(f"runtime.num_cpu_devices must be >= 0, got {self.num_cpu_devices}")
    if self.cpu_threads < 1:
      raise ConfigError(f"runtime.cpu_threads must be >= 1, got {self.cpu_threads}")


@dataclasses.dataclass(frozen=True)
class Config:
  """The whole run: every section is validated on construction by `load_config`.

  `model.dtype` is derived: construction sets it to the compute dtype of `precision.policy`
  (and `model.frozen_dtype`, LoRA's frozen kernels, to its params dtype),
  the one place a user chooses precision.
  """

  name: str = "unnamed"  # a label for the run
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  precision: PrecisionConfig = PrecisionConfig()
  optim: OptimConfig = OptimConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  runtime: RuntimeConfig = RuntimeConfig()

  def __post_init__(self):
    policy = self.precision.parsed
    object.__setattr__(
      self, "model", dataclasses.replace(self.model, dtype=policy.compute_dtype, frozen_dtype=policy.param_dtype)
    )

  def validate(self) -> None:
    """Validates every section, the task, and the settings that span sections; raises ConfigError (one line)."""
    for field in dataclasses.fields(self):
      section = getattr(self, field.name)
      if hasattr(section, "validate"):
        section.validate()
    from jaxformer.tasks import get_task  # noqa: PLC0415  (tasks import the models, which import this module)

    task = get_task(self)
    task.validate()
    metrics = ("val_loss", "val_nll", "val_accuracy", *(f"val_{name}" for name in task.validation_scores))
    if self.train.keep_best not in ("", *metrics):
      raise ConfigError(
        f"train.keep_best={self.train.keep_best!r} is not a validation metric of "
        f"model.kind={self.model.kind}; use one of {', '.join(metrics)}, or empty"
      )
    validate_with_data(self.model, self.data)
    if self.model.frozen_dtype != "float32" and not self.model.lora_rank:
      raise ConfigError(
        f"precision.policy={self.precision.policy!r}: params={self.model.frozen_dtype}: parameters and "
        "optimizer state stay float32 (only a LoRA run, model.lora_rank > 0, holds its frozen base in "
        "another dtype); use params=float32"
      )
    if self.data.max_length > self.model.max_length:
      raise ConfigError(
        f"data.max_length={self.data.max_length} exceeds model.max_length={self.model.max_length}; "
        "raise model.max_length or lower data.max_length"
      )


def config_from_dict(tree: dict[str, Any], overrides: typing.Sequence[str] = ()) -> Config:
  """Builds and validates a Config from a nested dict plus `a.b=c` overrides."""
  tree = apply_overrides(tree, overrides)
  config = build(Config, tree)
  if "vocab_size" not in tree.get("model", {}) and config.data.tokenizer == "char" and not config.data.tokenizer_model:
    # The character vocabulary is the data's: training sizes the model to it (`data.fit_vocab_size`).
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_from_data=True))
  config.validate()
  return config


def runtime_from_overrides(overrides: typing.Sequence[str]) -> RuntimeConfig:
  """The RuntimeConfig that `overrides`' runtime.* entries alone give (the rest are ignored):
  what eval-time commands apply before a workdir's config is read (its training run's
  runtime settings describe another machine)."""
  return config_from_dict({}, [o for o in overrides if o.startswith("runtime.")]).runtime


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> Config:
  """Reads a YAML config file and applies overrides.

  Raises:
    ConfigError: the file is missing or not a mapping, a key is unknown (the message
      suggests the nearest valid key), a value has the wrong type, or validation fails.
  """
  path = Path(path)
  if not path.is_file():
    raise ConfigError(f"config file {str(path)!r} does not exist; pass --config configs/NAME.yaml")
  try:
    tree = yaml.safe_load(path.read_text()) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"config file {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
  if not isinstance(tree, dict):
    raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
  return config_from_dict(tree, overrides)


def to_dict(config: Config) -> dict[str, Any]:
  """The config's user keys as plain YAML-safe types (tuples become lists; derived fields
  such as model.dtype are left out, and so is a model.vocab_size still to be sized from the data)."""
  tree = to_plain(config)
  if config.model.vocab_from_data:
    del tree["model"]["vocab_size"]
  return tree


def dump_config(config: Config) -> str:
  """The resolved config as YAML text; `load_config` of it gives back an equal Config."""
  return yaml.safe_dump(to_dict(config), sort_keys=False)


__all__ = [
  "Config",
  "ConfigError",
  "DataConfig",
  "MeshConfig",
  "ModelConfig",
  "OptimConfig",
  "PrecisionConfig",
  "RuntimeConfig",
  "TrainConfig",
  "config_from_dict",
  "dump_config",
  "load_config",
  "parse_override",
  "runtime_from_overrides",
  "to_dict",
]
