"""The public Python API's functions that are more than a re-export (see `jaxformer/__init__.py`):
each does what its `jaxformer` command does, on Python values instead of flags and files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer import sharding as sh
from jaxformer.config import Config, runtime_from_overrides
from jaxformer.inference import restore as inference_restore
from jaxformer.inference.options import SearchOptions
from jaxformer.inference.restore import Restored
from jaxformer.runtime.startup import init_runtime
from jaxformer.tasks import evaluate, get_task
from jaxformer.tasks.base import EvalOptions
from jaxformer.train.loop import train


def fit(config: Config, workdir: str | Path) -> dict[str, Any]:
  """Trains `config` in `workdir`, or resumes the run there (`jaxformer train`): applies
  `config.runtime` first (simulated CPU devices, platform, deterministic CPU numerics; these
  act only before JAX's first computation), then writes checkpoints, `config.yaml`, the
  tokenizer and `metrics.jsonl` to `workdir`.

  Returns:
    The last logged training metrics (`loss`, `learning_rate`, ... at the final `step`);
    empty when the run was already complete.

  Raises:
    ConfigError: a mesh or batch that does not fit the devices, or a workdir that holds
      another model's run.
  """
  init_runtime(config.runtime)
  return train(config, workdir)


def restore(
  workdir: str | Path,
  *,
  step: int | None = None,
  average_last: int | None = None,
  quantize: str | None = None,
  overrides: Sequence[str] = (),
) -> Restored:
  """A trained model ready for `translate`, `generate` and `score` (`inference.restore.Restored`:
  config, tokenizers, model, mesh, params and `step`), read from `workdir`.

  Args:
    step: the checkpoint (default: the newest intact one).
    average_last: the mean params of the newest N checkpoints instead (paper section 6.1).
    quantize: "int8" stores the weights as int8 with per-channel scales for decoding.
    overrides: runtime.* and mesh.* settings for this machine, e.g. ["mesh.data=1"]; the
      runtime ones are applied first (as the CLI does), the run's own are not.

  Raises:
    ConfigError: an override of anything else (the model must match the checkpoint).
    CheckpointError: no (such) checkpoint, or none intact.
  """
  init_runtime(runtime_from_overrides(overrides))
  config = inference_restore.workdir_config(workdir, overrides)
  return inference_restore.restore(workdir, config, step, average_last, quantize)


def logits(model: Restored, inputs: Any, targets: Any = None) -> np.ndarray:
  """The model's float32 logits `[batch, length, vocab_size]` (numpy) for token ids, dropout off:
  what to compare with another implementation's (transformers', say) on the same ids.

  Args:
    model: what `restore` returns.
    inputs: int `[batch, length]` ids (a list of lists or an array): a causal or masked LM's
      input, or an encoder-decoder's source.
    targets: an encoder-decoder's decoder input ids `[batch, tgt_len]` (fed as they are, not
      shifted: put the decoder start token first); must be None for the other kinds.

  Returns:
    float32 `[batch, length, vocab_size]` (`[batch, tgt_len, vocab_size]` for an encoder-decoder):
    position t's logits predict the token after t for causal models.

  Raises:
    ValueError: ids that are not a 2-D integer array within the vocabulary, or `targets`
      given (missing) for a model that takes none (needs them).
  """
  import jax  # noqa: PLC0415

  kind, vocab = model.config.model.kind, model.config.model.vocab_size
  arrays = [_ids(name, x, vocab) for name, x in (("inputs", inputs), ("targets", targets)) if x is not None]
  translates = get_task(model.config).translates
  if translates != (targets is not None):
    raise ValueError(
      f"targets {'are required' if targets is None else 'are only taken'} for an encoder_decoder "
      f"model; this one is model.kind={kind}"
    )
  if translates:
    fn = jax.jit(lambda p, x, y: model.model.apply({"params": p}, x, y, method=_teacher_forced))
  else:
    fn = jax.jit(lambda p, x: model.model.apply({"params": p}, x))
  with sh.bind(model.mesh, model.rules):
    return np.asarray(jax.device_get(fn(model.params, *arrays)), np.float32)


def _teacher_forced(module, inputs, decoder_inputs):
  """An encoder-decoder's logits for given decoder inputs (no shift)."""
  return module.decode(module.encode(inputs), inputs, decoder_inputs)


def _ids(name: str, x: Any, vocab_size: int) -> np.ndarray:
  """`x` as an int32 `[batch, length]` array of ids below `vocab_size` (raises ValueError naming `name`)."""
  array = np.asarray(x)
  if array.ndim != 2 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
    raise ValueError(
      f"{name} must be a non-empty 2-D array of integer token ids [batch, length], "
      f"got shape {array.shape} and dtype {array.dtype}"
    )
  if array.min() < 0 or array.max() >= vocab_size:
    raise ValueError(f"{name} holds ids outside [0, {vocab_size}) (the model's vocab_size)")
  return array.astype(np.int32)


def translate(model: Restored, sentences: Sequence[str], *, batch_size: int = 64, **search: Any) -> list[str]:
  """Translations of `sentences` (`jaxformer translate`) by a restored encoder-decoder `model`,
  in input order. `search` holds `inference.options.SearchOptions` fields: greedy by default;
  `beam_size=4, length_penalty=0.6` is the paper's beam search; `temperature`, `top_k`,
  `top_p`, `seed` sample.

  Raises:
    ValueError: invalid search options, or a model that is not an encoder-decoder.
  """
  if not get_task(model.config).translates:
    raise ValueError(f"translate needs an encoder_decoder model; this one is model.kind={model.config.model.kind}")
  return evaluate.translate(model, list(sentences), batch_size, SearchOptions(**search).validate())[0]


def score(
  model: Restored,
  *,
  split: str | None = None,
  src: str | None = None,
  ref: str | None = None,
  batch_size: int = 64,
  output: str | None = None,
  **search: Any,
) -> dict[str, Any]:
  """Evaluates a restored `model` (`jaxformer eval`): a translation model's BLEU, chrF and
  reference loss on `split` ("val" or "test"; default "test") or on the line-aligned files
  `src`/`ref`, decoding with `search` (as in `translate`) and writing the hypotheses to the
  file `output` when given; a language model's loss, perplexity and accuracy on `split`
  (default "val").

  Returns:
    The result dict `jaxformer eval` prints as JSON (`step`, `split`, the scores, ...).

  Raises:
    ValueError: a split other than val/test or one the dataset lacks, src without ref, invalid
      search options.
  """
  if split not in (None, "val", "test"):
    raise ValueError(f"split={split!r}; use 'val' or 'test'")
  options = EvalOptions(
    split=split,
    src=src,
    ref=ref,
    batch_size=batch_size,
    search=SearchOptions(**search).validate(),
    output=output,
    workdir=model.config_workdir,
  )
  return get_task(model.config).evaluate(lambda: model, options)
