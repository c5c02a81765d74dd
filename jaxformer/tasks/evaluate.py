"""Translate restored models and score them: decoding in length-sorted batches, sacrebleu
BLEU and chrF, teacher-forced loss, and hypotheses scored on beam search's objective
(`hypothesis_scores`). Restoring lives in `jaxformer.inference.restore`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

from jaxformer import sharding as sh
from jaxformer.data import eval_batches, global_batch, tokenize_split
from jaxformer.inference.cache import no_pad
from jaxformer.inference.decode import Draft, SearchOptions, make_decode_fn
from jaxformer.inference.quantize import dequantize_params
from jaxformer.inference.restore import Restored
from jaxformer.inference.search import LENGTH_PENALTY, length_penalty
from jaxformer.models.pipeline import pipeline_for
from jaxformer.tasks.objective import evaluate_loss, make_eval_step


def _round_batch(restored: Restored, batch_size: int) -> int:
  """`batch_size` rounded down to a multiple of the data-parallel size (at least one row per shard),
  times the pipeline's microbatches on a mesh with stages (the loss step is pipelined there)."""
  pipeline = pipeline_for(restored.config, restored.mesh)
  dp = sh.data_parallel_size(restored.mesh, restored.rules) * (pipeline.microbatches if pipeline else 1)
  return max(dp, batch_size // dp * dp)


def decode_sources(
  restored: Restored,
  sources: Sequence[str],
  batch_size: int = 64,
  search: SearchOptions | None = None,
  warmup: bool = False,
  draft: Draft | None = None,
) -> tuple[list[dict], dict]:
  """Decodes `sources` in length-sorted batches (`eval_batches` with the run's buckets).

  Returns (batches, speed stats). Each batch is a dict of host arrays: `inputs` int32
  `[rows, src_len]`, `index` int32 `[rows]` (the sentence's position in `sources`, -1 for
  filler rows) and `tokens` int32 `[rows, out_len]` (through EOS, then PAD). Speed stats:
  `sentences_per_sec`, `tokens_per_sec` (generated tokens incl. EOS), `seconds`, and with a
  `draft` (speculative greedy decoding) `draft_acceptance`, the share of proposed tokens the
  target kept; with `warmup`, one batch per distinct shape is decoded first so compiles are not timed.

  Raises:
    ValueError: invalid search options (one line).
  """
  cfg = restored.config
  batch_size = _round_batch(restored, batch_size)
  data = tokenize_split(
    restored.source_tokenizer,
    list(sources),
    list(sources),
    cfg.data.max_length,
    overlong="truncate",
    eos_id=cfg.model.eos_id,
  )
  decode = make_decode_fn(restored.model, restored.mesh, cfg.model.max_length, search, draft, restored.rules)
  batches = eval_batches(data, batch_size, cfg.data.buckets, pad_id=cfg.model.pad_id)

  def run(batch):
    inputs = global_batch(batch, restored.mesh, restored.rules)["inputs"]
    return np.asarray(jax.device_get(decode(restored.params, inputs)))

  if warmup:
    for b in {b["inputs"].shape: b for b in batches}.values():
      run(b)
  out = []
  start = time.perf_counter()
  for batch in batches:
    out.append({"inputs": batch["inputs"], "index": batch["index"], "tokens": run(batch)})
  seconds = time.perf_counter() - start
  generated = sum(int(np.count_nonzero(b["tokens"][b["index"] >= 0] != cfg.model.pad_id)) for b in out)
  speed = {"sentences_per_sec": len(sources) / seconds, "tokens_per_sec": generated / seconds, "seconds": seconds}
  if draft is not None:
    accepted, proposed = np.sum(decode.speculation[-len(batches) :], axis=0)
    speed["draft_acceptance"] = float(accepted / max(proposed, 1))
  return out, speed


def translate(
  restored: Restored,
  sources: Sequence[str],
  batch_size: int = 64,
  search: SearchOptions | None = None,
  draft: Draft | None = None,
) -> tuple[list[str], dict]:
  """Translates `sources`; returns (hypotheses in input order, speed stats).

  `search` picks greedy (default), beam search or sampling and the output length
  (source length + `extra_tokens`, capped by model.max_length); see `SearchOptions`.
  Speed stats as in `decode_sources` (compiles included). A `draft` decodes greedily with
  speculative decoding (the same hypotheses).

  Raises:
    ValueError: invalid search options (one line).
  """
  batches, speed = decode_sources(restored, sources, batch_size, search, draft=draft)
  hyps: list[str] = [""] * len(sources)
  for batch in batches:
    for row, index in zip(batch["tokens"], batch["index"]):
      if index >= 0:
        hyps[index] = restored.tokenizer.decode(row)
  return hyps, speed


def hypothesis_scores(
  model: nn.Module,
  params: Any,
  inputs: jax.Array,
  tokens: jax.Array,
  alpha: float = LENGTH_PENALTY,
  eos_id: int | None = None,
) -> jax.Array:
  """Beam search's objective for given hypotheses, by teacher forcing.

  score(Y) = sum_t log p(y_t | y_<t, X) / length_penalty(|Y|, alpha), the sum over the
  tokens through the first EOS (EOS included; all `out_len` tokens if there is none), so
  greedy and beam outputs are compared on what beam search maximises (`decode.beam_search`
  reports the same number for its hypotheses: both leave PAD, never a target, out of the softmax).
  Jittable (`alpha`, `eos_id` static).

  Args:
    inputs: int `[batch, src_len]` source ids, PAD (0) padded.
    tokens: int `[batch, out_len]` hypotheses as decoding returns them (tokens through EOS,
      then PAD). A PAD id before a row's end would be read as padding by teacher forcing.
    alpha: GNMT length-penalty exponent >= 0 (paper: 0.6).
    eos_id: the end token (None: `model.eos_id`).

  Returns:
    float32 `[batch]` length-normalised log-probabilities (<= 0).
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  eos_id = model.config.eos_id if eos_id is None else eos_id
  out_len = tokens.shape[1]
  is_eos = tokens == eos_id
  length = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1) + 1, out_len)  # [B]
  logits = no_pad(model.apply({"params": params}, inputs, tokens), model.config.pad_id)  # [B, T, V]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  token_logp = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]  # [B, T]
  in_hypothesis = jnp.arange(out_len)[None, :] < length[:, None]
  return jnp.sum(jnp.where(in_hypothesis, token_logp, 0.0), axis=1) / length_penalty(length, alpha)


def reference_loss(
  restored: Restored, sources: Sequence[str], references: Sequence[str], batch_size: int = 64
) -> dict[str, float]:
  """Teacher-forced loss of `references` given `sources` (dropout off).

  Returns `loss` (mean NLL per non-padding target token incl. EOS, nats, no label
  smoothing), `perplexity` = exp(loss), `accuracy` (next-token argmax) and `num_tokens`.
  """
  cfg = restored.config
  batch_size = _round_batch(restored, batch_size)
  data = tokenize_split(
    restored.source_tokenizer,
    list(sources),
    list(references),
    cfg.data.max_length,
    overlong="truncate",
    target_tokenizer=restored.tokenizer,
    eos_id=cfg.model.eos_id,
  )
  return batches_loss(restored, eval_batches(data, batch_size, cfg.data.buckets, pad_id=cfg.model.pad_id))


def batches_loss(restored: Restored, batches) -> dict[str, float]:
  """`loss` (mean NLL per weighted target token, nats, no label smoothing), `perplexity` =
  exp(loss), `accuracy` and `num_tokens` of the restored model over host `batches` (dropout off)."""
  params = jax.jit(dequantize_params)(restored.params)  # int8 (`--quantize`): the loss in float
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  eval_step = make_eval_step(restored.model, restored.config, restored.mesh, param_shardings)
  totals = evaluate_loss(eval_step, params, batches, restored.mesh, restored.rules)
  return {
    "loss": totals["nll"],
    "perplexity": float(np.exp(totals["nll"])),
    "accuracy": totals["accuracy"],
    "num_tokens": int(totals["num_tokens"]),
  }


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
  return {
    "bleu": round(b.score, 2),
    "chrf": round(c.score, 2),
    "bleu_signature": str(bleu.get_signature()),
    "chrf_signature": str(chrf.get_signature()),
  }


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
    print(
      f"note: {workdir} is not writable, so the hypotheses go to {folder} (--output FILE puts them elsewhere)",
      file=sys.stderr,
      flush=True,
    )
    return folder
  path = Path(output)
  if path.is_dir():
    raise ValueError(f"--output {output} is a directory; give a file path, e.g. --output {path / 'hypotheses.txt'}")
  folder = path.absolute().parent
  if not folder.is_dir() or not os.access(folder, os.W_OK):
    raise ValueError(
      f"--output {output}: its folder {folder} is {'not writable' if folder.is_dir() else 'missing'}; "
      "give a file path in a writable folder"
    )
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
