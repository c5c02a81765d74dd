"""Restore a trained model from its workdir, translate, and score with sacrebleu.

Everything needed comes from the workdir: `config.yaml`, `tokenizer.model` and the
Orbax checkpoints. Runtime/mesh overrides let a checkpoint written on one mesh be
evaluated on another (the arrays are restored straight into the new shardings).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
import sacrebleu

from jaxformer import checkpoint as ckpt
from jaxformer import sharding as sh
from jaxformer.config import Config, ConfigError, config_from_dict, load_config, to_dict
from jaxformer.data import Tokenizer, eval_batches, tokenize_split
from jaxformer.data.shakespeare import tokenizer_from_bytes
from jaxformer.runtime import build_mesh
from jaxformer.search import SearchOptions, make_decode_fn
from jaxformer.train.loop import global_batch
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import state_shardings
from jaxformer.train.tasks import make_model

RUNTIME_SECTIONS = ("runtime.", "mesh.", "train.batch_size", "data.data_dir")


@dataclasses.dataclass
class Restored:
  """A model ready for inference: config, tokenizer (SentencePiece or characters), model
  (of `config.model.kind`), mesh, params (sharded) and step."""
  config: Config
  tokenizer: Tokenizer
  model: Any
  mesh: Any
  params: Any
  step: int


def workdir_config(workdir: str | Path, overrides: Sequence[str] = ()) -> Config:
  """The run's saved config with runtime/mesh overrides applied; the mesh defaults to
  data parallelism over all devices of this process (not the training run's mesh).

  Raises:
    ConfigError: an override touches anything but runtime.*, mesh.*, train.batch_size or
      data.data_dir (the model and tokenizer must match the checkpoint).
  """
  for o in overrides:
    if not o.startswith(RUNTIME_SECTIONS):
      raise ConfigError(f"override {o!r} is not allowed at eval time; only runtime.*, mesh.*, train.batch_size and data.data_dir")
  saved = to_dict(load_config(ckpt.run_file(workdir, ckpt.CONFIG_FILE)))
  # The training mesh rarely fits the evaluating machine: default to data parallelism over
  # whatever devices are here, unless mesh.* overrides say otherwise.
  saved.pop("mesh")
  return config_from_dict(saved, overrides)


def restore(workdir: str | Path, config: Config, step: int | None = None) -> Restored:
  """Restores params of `step` (default: latest) into the shardings of `config`'s mesh.

  Raises:
    CheckpointError: the workdir has no (such) checkpoint.
  """
  checkpointer = ckpt.Checkpointer(workdir, async_save=False)
  if not checkpointer.all_steps():
    raise ckpt.CheckpointError(f"no checkpoint in {checkpointer.directory}; train first or check --workdir")
  tokenizer = tokenizer_from_bytes(config.data.tokenizer, ckpt.run_file(workdir, ckpt.TOKENIZER_FILE).read_bytes())
  mesh = build_mesh(config)
  model = make_model(config)
  tx = make_optimizer(config.optim, config.model.d_model)
  abstract, shardings = state_shardings(model, tx, mesh)
  state = checkpointer.restore(ckpt.sharded_target(abstract, shardings), step)
  checkpointer.close()
  return Restored(config, tokenizer, model, mesh, state.params, int(jax.device_get(state.step)))


def translate(restored: Restored, sources: Sequence[str], batch_size: int = 64,
              search: SearchOptions | None = None) -> tuple[list[str], dict]:
  """Translates `sources`; returns (hypotheses in input order, speed stats).

  `search` picks greedy (default), beam search or sampling and the output length
  (source length + `extra_tokens`, capped by model.max_length); see `SearchOptions`.
  Speed stats: `sentences_per_sec`, `tokens_per_sec` (generated tokens incl. EOS), `seconds`.

  Raises:
    ValueError: invalid search options (one line).
  """
  cfg = restored.config
  dp = sh.data_parallel_size(restored.mesh)
  batch_size = max(dp, batch_size // dp * dp)
  data = tokenize_split(restored.tokenizer, list(sources), list(sources), cfg.data.max_length, overlong="truncate")
  decode = make_decode_fn(restored.model, restored.mesh, cfg.model.max_length, search)
  hyps: list[str] = [""] * len(sources)
  generated = 0
  start = time.perf_counter()
  for batch in eval_batches(data, batch_size, cfg.data.buckets):
    tokens = np.asarray(jax.device_get(decode(restored.params, global_batch(batch, restored.mesh)["inputs"])))
    for row, index in zip(tokens, batch["index"]):
      if index >= 0:
        hyps[index] = restored.tokenizer.decode(row)
        generated += int(np.count_nonzero(row))
  seconds = time.perf_counter() - start
  return hyps, {"sentences_per_sec": len(sources) / seconds, "tokens_per_sec": generated / seconds,
                "seconds": seconds}


def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
  """Corpus BLEU and chrF with sacrebleu defaults (cased, 13a tokenizer on detokenised text)."""
  bleu = sacrebleu.metrics.BLEU()
  chrf = sacrebleu.metrics.CHRF()
  b = bleu.corpus_score(list(hypotheses), [list(references)])
  c = chrf.corpus_score(list(hypotheses), [list(references)])
  return {"bleu": round(b.score, 2), "chrf": round(c.score, 2),
          "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature())}


def write_lines_atomic(path: str | Path, lines: Sequence[str]) -> None:
  """Writes `lines` to `path` through a temporary file, so a crash leaves no partial file."""
  path = Path(path)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
  with os.fdopen(fd, "w") as f:
    f.write("".join(line + "\n" for line in lines))
  os.replace(tmp, path)
