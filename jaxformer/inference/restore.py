"""Restoring a trained model for inference: everything comes from the workdir (`config.yaml`,
the tokenizer files and the Orbax checkpoints). Runtime/mesh overrides let a checkpoint
written on one mesh be used on another (the arrays are restored straight into the new
shardings).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxformer import sharding as sh
from jaxformer.checkpoint import average
from jaxformer.checkpoint import manager as ckpt
from jaxformer.checkpoint import run_files as rf
from jaxformer.config import Config, ConfigError, config_from_dict, load_config, to_dict
from jaxformer.data import Tokenizer
from jaxformer.inference.quantize import quantize_params
from jaxformer.models import layout
from jaxformer.models.abstract import param_shardings
from jaxformer.runtime.startup import build_mesh
from jaxformer.tasks import get_task

RUNTIME_SECTIONS = ("runtime.", "mesh.", "train.batch_size", "data.data_dir")


@dataclasses.dataclass
class Restored:
  """A model ready for inference: config, tokenizer (SentencePiece or characters; the
  target's), model (of `config.model.kind`), mesh, params (sharded), step, the rules, and
  the source tokenizer (`tokenizer` itself unless the vocabularies are separate)."""

  config: Config
  tokenizer: Tokenizer
  model: Any
  mesh: Any
  params: Any
  step: int
  rules: sh.Rules  # logical-axis rules the params were placed with (`mesh.rules`)
  source_tokenizer: Any = None
  averaged: list[int] | None = None  # the steps whose mean `params` is (`--average-last`), else None
  quantized: str | None = None  # "int8": `params` holds `quantize.QuantizedArray` kernels
  config_workdir: str | None = None  # the workdir it was restored from

  def __post_init__(self):
    if self.source_tokenizer is None:
      self.source_tokenizer = self.tokenizer


def workdir_config(workdir: str | Path, overrides: Sequence[str] = ()) -> Config:
  """The run's saved config with runtime/mesh overrides applied; the mesh defaults to
  data parallelism over all devices of this process (not the training run's mesh).

  Raises:
    ConfigError: an override touches anything but runtime.*, mesh.*, train.batch_size or
      data.data_dir (the model and tokenizer must match the checkpoint).
  """
  for o in overrides:
    if not o.startswith(RUNTIME_SECTIONS):
      raise ConfigError(
        f"override {o!r} is not allowed at eval time; only runtime.*, mesh.*, train.batch_size and data.data_dir"
      )
  saved = to_dict(load_config(rf.run_file(workdir, rf.CONFIG_FILE)))
  # The training mesh rarely fits the evaluating machine: default to data parallelism over
  # whatever devices are here, unless mesh.* overrides say otherwise.
  saved.pop("mesh")
  return config_from_dict(saved, overrides)


def restore(
  workdir: str | Path,
  config: Config,
  step: int | None = None,
  average_last: int | None = None,
  quantize: str | None = None,
) -> Restored:
  """Restores the params of `step` (default: the newest intact step, reporting damaged newer
  ones on stderr; not the optimizer state) into the shardings of `config`'s mesh, whatever
  mesh the checkpoint was written from; or, with `average_last` N, the mean of the params of
  the newest N checkpoints (paper section 6.1; `Restored.step` is then the newest, and
  `Restored.averaged` lists the steps). With `quantize="int8"` the params are then stored as
  int8 with per-channel scales (`inference.quantize`; decoding multiplies them in int8, or
  dequantizes them inside its jitted functions, `decoding_params`). Writes nothing to the workdir.

  Raises:
    CheckpointError: the workdir has no (such) checkpoint, `step` is damaged, or none is intact.
  """
  checkpointer = ckpt.Checkpointer(workdir, read_only=True)
  if not checkpointer.all_steps():
    raise ckpt.CheckpointError(f"no checkpoint in {checkpointer.directory}; train first or check --workdir")
  rf.run_file(workdir, rf.TOKENIZER_FILE)  # a one-line error if it is not a workdir
  vocab = rf.load_vocabulary(workdir)
  rules = sh.rules_for(config.mesh)
  mesh = build_mesh(config)
  model = get_task(config).make_model()
  abstract, shardings = param_shardings(model, mesh, rules)
  target = ckpt.sharded_target(abstract, shardings)
  if average_last:
    averaged = average.last_steps(checkpointer, average_last)
    restored_step = averaged[-1]
    params = average.average_params(lambda s: layout.restore_params(checkpointer, target, model, s)[1], averaged)
  else:
    averaged = None
    restored_step, params = layout.restore_params(checkpointer, target, model, step)
  checkpointer.close()
  if quantize == "int8":
    params = jax.jit(lambda p: quantize_params(p, min_size=1))(params)  # every kernel, even a tiny model's
  elif quantize is not None:
    raise ValueError(f"unknown quantization {quantize!r}; use int8")
  return Restored(
    config, vocab.target, model, mesh, params, restored_step, rules, vocab.source, averaged, quantize, str(workdir)
  )


def restore_draft(
  workdir: str | Path, target: Restored, overrides: Sequence[str] = (), num_tokens: int = 4, quantize: str | None = None
):
  """The draft model of speculative decoding (`decode.Draft`) from its workdir: any
  checkpoint whose tokenizer files are the target's, restored with the same runtime/mesh
  overrides (so its params sit on the same devices).

  Raises:
    ValueError: the draft's tokenizer or vocabulary differs from the target's, or num_tokens < 1.
    CheckpointError: the draft workdir has no checkpoint.
  """
  from jaxformer.inference.decode import Draft  # noqa: PLC0415  (decode imports nothing from here)

  if num_tokens < 1:
    raise ValueError(f"--draft-tokens must be >= 1, got {num_tokens}")
  config = workdir_config(workdir, overrides)
  for name in (rf.TOKENIZER_FILE, rf.SOURCE_TOKENIZER_FILE):
    mine, theirs = Path(workdir) / name, Path(target.config_workdir) / name
    if mine.is_file() != theirs.is_file() or (mine.is_file() and mine.read_bytes() != theirs.read_bytes()):
      raise ValueError(
        f"--draft-workdir {workdir} has another {name} than --workdir {target.config_workdir}; "
        "a draft must share the target's tokenizer (train it with data.tokenizer_model=...)"
      )
  if config.model.vocab_size != target.config.model.vocab_size:
    raise ValueError(
      f"--draft-workdir {workdir} has vocab_size {config.model.vocab_size}, the target "
      f"{target.config.model.vocab_size}; a draft must share the target's vocabulary"
    )
  draft = restore(workdir, config, quantize=quantize)
  return Draft(draft.model, draft.params, num_tokens)
