"""Restore a trained model from its workdir, translate, and score with sacrebleu; score
hypotheses under the model on beam search's objective (`hypothesis_scores`).

Everything needed comes from the workdir: `config.yaml`, `tokenizer.model` and the
Orbax checkpoints. Runtime/mesh overrides let a checkpoint written on one mesh be
evaluated on another (the arrays are restored straight into the new shardings).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

from jaxformer import average
from jaxformer import checkpoint as ckpt
from jaxformer import sharding as sh
from jaxformer.config import Config, ConfigError, config_from_dict, load_config, to_dict
from jaxformer.data import Tokenizer, eval_batches, global_batch, tokenize_split
from jaxformer.decode import EOS_ID
from jaxformer.models import layout
from jaxformer.runtime import build_mesh
from jaxformer.search import LENGTH_PENALTY, SearchOptions, length_penalty, make_decode_fn
from jaxformer.tasks import get_task
from jaxformer.train.loop import evaluate_loss
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import state_shardings
from jaxformer.train.step import make_eval_step

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
  averaged: list[int] | None = None   # the steps whose mean `params` is (`--average-last`), else None

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
      raise ConfigError(f"override {o!r} is not allowed at eval time; only runtime.*, mesh.*, train.batch_size and data.data_dir")
  saved = to_dict(load_config(ckpt.run_file(workdir, ckpt.CONFIG_FILE)))
  # The training mesh rarely fits the evaluating machine: default to data parallelism over
  # whatever devices are here, unless mesh.* overrides say otherwise.
  saved.pop("mesh")
  return config_from_dict(saved, overrides)


def restore(workdir: str | Path, config: Config, step: int | None = None, average_last: int | None = None) -> Restored:
  """Restores the params of `step` (default: the newest intact step, reporting damaged newer
  ones on stderr; not the optimizer state) into the shardings of `config`'s mesh, whatever
  mesh the checkpoint was written from; or, with `average_last` N, the mean of the params of
  the newest N checkpoints (paper section 6.1; `Restored.step` is then the newest, and
  `Restored.averaged` lists the steps). Writes nothing to the workdir.

  Raises:
    CheckpointError: the workdir has no (such) checkpoint, `step` is damaged, or none is intact.
  """
  checkpointer = ckpt.Checkpointer(workdir, read_only=True)
  if not checkpointer.all_steps():
    raise ckpt.CheckpointError(f"no checkpoint in {checkpointer.directory}; train first or check --workdir")
  ckpt.run_file(workdir, ckpt.TOKENIZER_FILE)   # a one-line error if it is not a workdir
  vocab = ckpt.load_vocabulary(workdir)
  rules = sh.parse_rules(config.mesh.rules)
  with sh.axis_rules(rules):
    mesh = build_mesh(config)
    model = get_task(config).make_model()
    tx = make_optimizer(config.optim, config.model.d_model)
    abstract, shardings = state_shardings(model, tx, mesh)
    target = ckpt.sharded_target(abstract.params, shardings.params)
    if average_last:
      averaged = average.last_steps(checkpointer, average_last)
      restored_step = averaged[-1]
      params = average.average_params(lambda s: layout.restore_params(checkpointer, target, model, s)[1], averaged)
    else:
      averaged = None
      restored_step, params = layout.restore_params(checkpointer, target, model, step)
  checkpointer.close()
  return Restored(config, vocab.target, model, mesh, params, restored_step, rules, vocab.source, averaged)


def _round_batch(restored: Restored, batch_size: int) -> int:
  """`batch_size` rounded down to a multiple of the data-parallel size (at least one row per shard)."""
  with sh.axis_rules(restored.rules):
    dp = sh.data_parallel_size(restored.mesh)
  return max(dp, batch_size // dp * dp)


def decode_sources(restored: Restored, sources: Sequence[str], batch_size: int = 64,
                   search: SearchOptions | None = None, warmup: bool = False) -> tuple[list[dict], dict]:
  """Decodes `sources` in length-sorted batches (`eval_batches` with the run's buckets).

  Returns (batches, speed stats). Each batch is a dict of host arrays: `inputs` int32
  `[rows, src_len]`, `index` int32 `[rows]` (the sentence's position in `sources`, -1 for
  filler rows) and `tokens` int32 `[rows, out_len]` (through EOS, then PAD). Speed stats:
  `sentences_per_sec`, `tokens_per_sec` (generated tokens incl. EOS), `seconds`; with
  `warmup`, one batch per distinct shape is decoded first so compiles are not timed.

  Raises:
    ValueError: invalid search options (one line).
  """
  cfg = restored.config
  batch_size = _round_batch(restored, batch_size)
  data = tokenize_split(restored.source_tokenizer, list(sources), list(sources), cfg.data.max_length,
                        overlong="truncate")
  decode = make_decode_fn(restored.model, restored.mesh, cfg.model.max_length, search)
  batches = eval_batches(data, batch_size, cfg.data.buckets)

  def run(batch):
    with sh.axis_rules(restored.rules):
      return np.asarray(jax.device_get(decode(restored.params, global_batch(batch, restored.mesh)["inputs"])))

  if warmup:
    for b in {b["inputs"].shape: b for b in batches}.values():
      run(b)
  out = []
  start = time.perf_counter()
  for batch in batches:
    out.append({"inputs": batch["inputs"], "index": batch["index"], "tokens": run(batch)})
  seconds = time.perf_counter() - start
  generated = sum(int(np.count_nonzero(b["tokens"][b["index"] >= 0])) for b in out)
  return out, {"sentences_per_sec": len(sources) / seconds, "tokens_per_sec": generated / seconds,
               "seconds": seconds}


def translate(restored: Restored, sources: Sequence[str], batch_size: int = 64,
              search: SearchOptions | None = None) -> tuple[list[str], dict]:
  """Translates `sources`; returns (hypotheses in input order, speed stats).

  `search` picks greedy (default), beam search or sampling and the output length
  (source length + `extra_tokens`, capped by model.max_length); see `SearchOptions`.
  Speed stats as in `decode_sources` (compiles included).

  Raises:
    ValueError: invalid search options (one line).
  """
  batches, speed = decode_sources(restored, sources, batch_size, search)
  hyps: list[str] = [""] * len(sources)
  for batch in batches:
    for row, index in zip(batch["tokens"], batch["index"]):
      if index >= 0:
        hyps[index] = restored.tokenizer.decode(row)
  return hyps, speed


def hypothesis_scores(model: nn.Module, params: Any, inputs: jax.Array, tokens: jax.Array,
                      alpha: float = LENGTH_PENALTY, eos_id: int = EOS_ID) -> jax.Array:
  """Beam search's objective for given hypotheses, by teacher forcing.

  score(Y) = sum_t log p(y_t | y_<t, X) / length_penalty(|Y|, alpha), the sum over the
  tokens through the first EOS (EOS included; all `out_len` tokens if there is none), so
  greedy and beam outputs are compared on what beam search maximises (`search.beam_search`
  reports the same number for its hypotheses). Jittable (`alpha`, `eos_id` static).

  Args:
    inputs: int `[batch, src_len]` source ids, PAD (0) padded.
    tokens: int `[batch, out_len]` hypotheses as decoding returns them (tokens through EOS,
      then PAD). A PAD id before a row's end would be read as padding by teacher forcing.
    alpha: GNMT length-penalty exponent >= 0 (paper: 0.6).
  Returns:
    float32 `[batch]` length-normalised log-probabilities (<= 0).
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  out_len = tokens.shape[1]
  is_eos = tokens == eos_id
  length = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, out_len)      # [B]
  logits = model.apply({"params": params}, inputs, tokens)                              # [B, T, V]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  token_logp = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]           # [B, T]
  in_hypothesis = jnp.arange(out_len)[None, :] < length[:, None]
  return jnp.sum(jnp.where(in_hypothesis, token_logp, 0.0), axis=1) / length_penalty(length, alpha)


def reference_loss(restored: Restored, sources: Sequence[str], references: Sequence[str],
                   batch_size: int = 64) -> dict[str, float]:
  """Teacher-forced loss of `references` given `sources` (dropout off).

  Returns `loss` (mean NLL per non-padding target token incl. EOS, nats, no label
  smoothing), `perplexity` = exp(loss), `accuracy` (next-token argmax) and `num_tokens`.
  """
  cfg = restored.config
  batch_size = _round_batch(restored, batch_size)
  data = tokenize_split(restored.source_tokenizer, list(sources), list(references), cfg.data.max_length,
                        overlong="truncate", target_tokenizer=restored.tokenizer)
  return batches_loss(restored, eval_batches(data, batch_size, cfg.data.buckets))


def batches_loss(restored: Restored, batches) -> dict[str, float]:
  """`loss` (mean NLL per weighted target token, nats, no label smoothing), `perplexity` =
  exp(loss), `accuracy` and `num_tokens` of the restored model over host `batches` (dropout off)."""
  param_shardings = jax.tree.map(lambda x: x.sharding, restored.params)
  with sh.axis_rules(restored.rules):
    eval_step = make_eval_step(restored.model, restored.config, restored.mesh, param_shardings)
    totals = evaluate_loss(eval_step, restored.params, batches, restored.mesh)
  return {"loss": totals["nll"], "perplexity": float(np.exp(totals["nll"])), "accuracy": totals["accuracy"],
          "num_tokens": int(totals["num_tokens"])}


def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
  """Corpus BLEU and chrF with sacrebleu defaults (cased, 13a tokenizer on detokenised text).

  Raises:
    ValueError: the hypotheses and references differ in number (sacrebleu would truncate).
  """
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references; score aligned lists")
  bleu = sacrebleu.metrics.BLEU()
  chrf = sacrebleu.metrics.CHRF()
  b = bleu.corpus_score(list(hypotheses), [list(references)])
  c = chrf.corpus_score(list(hypotheses), [list(references)])
  return {"bleu": round(b.score, 2), "chrf": round(c.score, 2),
          "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature())}


def hypotheses_destination(output: str | None, workdir: str | Path) -> str:
  """Where `eval` writes its hypotheses, checked before any decoding: the file `output`, or
  the folder `workdir` (the task names the file after the split and the search).

  A read-only workdir (an archived or shared run) still gets its scores: the hypotheses go to
  a new temporary folder instead, which one stderr line names (as does the result's
  `hypotheses`).

  Raises:
    ValueError: `output` is a directory, or its folder is missing or not writable.
  """
  if output is None:
    if os.access(workdir, os.W_OK):
      return str(workdir)
    folder = tempfile.mkdtemp(prefix="jaxformer-eval-")
    print(f"note: {workdir} is not writable, so the hypotheses go to {folder} (--output FILE puts them elsewhere)",
          file=sys.stderr, flush=True)
    return folder
  path = Path(output)
  if path.is_dir():
    raise ValueError(f"--output {output} is a directory; give a file path, e.g. --output {path / 'hypotheses.txt'}")
  folder = path.absolute().parent
  if not folder.is_dir() or not os.access(folder, os.W_OK):
    raise ValueError(f"--output {output}: its folder {folder} is {'not writable' if folder.is_dir() else 'missing'}; "
                     "give a file path in a writable folder")
  return output


def write_lines_atomic(path: str | Path, lines: Sequence[str]) -> None:
  """Writes `lines` (UTF-8) to `path` through a temporary file, so a crash leaves no partial
  file, and a failed write no temporary one.

  Raises:
    ValueError: the file cannot be written (one line naming it and the cause).
  """
  path = Path(path)
  tmp = None
  try:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
  except OSError as e:
    if tmp is not None:
      with contextlib.suppress(OSError):
        os.unlink(tmp)
    raise ValueError(f"cannot write {path}: {e.strerror}") from None


def result_json(result: dict[str, Any]) -> str:
  """`result` as one line of strict JSON: non-finite floats (a diverged model's loss or
  perplexity) become null, since JSON has no NaN or Infinity."""
  def finite(x):
    if isinstance(x, float):
      return x if math.isfinite(x) else None
    if isinstance(x, dict):
      return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [finite(v) for v in x]
    return x
  return json.dumps(finite(result), allow_nan=False)
