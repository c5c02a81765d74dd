"""Attention weights of a restored model for one input, for plotting (the paper's Figures 3-5).

The weights come from the model itself: dense attention sows them (`layers.attention`) and
one teacher-forced forward pass with the "intermediates" collection mutable collects them,
layer by layer. The pass runs an unrolled, dense, remat-free copy of the model (the same
params; a scanned checkpoint is unstacked), so any training layout gives the same maps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxformer.data.pipeline import sentence_ids
from jaxformer.inference.quantize import dequantize_params
from jaxformer.inference.restore import Restored
from jaxformer.models import layout
from jaxformer.models.transformer import shift_right
from jaxformer.tasks import get_task
from jaxformer.tasks.evaluate import decode_sources


@dataclasses.dataclass(frozen=True)
class AttentionMap:
  """One kind of attention: `weights` float32 `[num_layers, num_heads, queries, keys]` (rows sum
  to 1), and the token labels of the queries (rows) and keys (columns)."""

  title: str
  weights: np.ndarray
  queries: list[str]
  keys: list[str]


@dataclasses.dataclass(frozen=True)
class AttentionMaps:
  """The maps of one input, encoder side first, and the target text they were computed for
  (encoder-decoder; None for a language model)."""

  maps: list[AttentionMap]
  target: str | None


def token_labels(tokenizer: Any, ids, special: Any = None) -> list[str]:
  r"""Readable labels of token ids: `<s>`/`</s>` for the BOS/decoder start and EOS of `special`
  (a model's `SpecialIds`; default the tokenizer's), else the token's text (a SentencePiece piece
  without its word-start mark, the bare mark as `▁`; a space or newline of a character vocabulary
  as `␣`/`\n`)."""
  special = special or tokenizer.special_ids
  special = {i: label for i, label in ((special.bos, "<s>"), (special.start, "<s>"), (special.eos, "</s>")) if i >= 0}
  # A piece that decodes to nothing on its own is SentencePiece's bare word-start mark.
  return [
    special.get(i) or tokenizer.decode([i]).replace("\n", "\\n").replace(" ", "␣") or "▁"
    for i in np.asarray(ids).tolist()
  ]


def _plain_model(restored: Restored):
  """(model, params): `restored`'s model unrolled, dense and without remat (its weights sow),
  with its params in that layout, float (int8 kernels dequantized) and on the host."""
  cfg = restored.config
  model_cfg = dataclasses.replace(cfg.model, attention="dense", remat="none", scan_layers=False)
  model = get_task(dataclasses.replace(cfg, model=model_cfg)).make_model()
  params = jax.device_get(jax.jit(dequantize_params)(restored.params))
  stacks = layout.layer_stacks(model)
  if layout.is_scanned(params, stacks):
    params = layout.unstack_layers(params, stacks)
  return model, params


def _encode(tokenizer: Any, text: str, what: str, limit: int, eos: int | None) -> np.ndarray:
  if eos is not None:  # a translation side: its plain ids and the model's EOS
    plain, end = sentence_ids(tokenizer, [text], eos)
    ids = plain[0] + [end]
  else:
    ids = tokenizer.encode(text)
  if not text or not ids:
    raise ValueError(f"{what} {text!r} encodes to no tokens; give some text")
  if len(ids) > limit:
    raise ValueError(f"{what} is {len(ids)} tokens but the model reads at most {limit}; give a shorter {what}")
  return np.asarray([ids], np.int32)


def _greedy(restored: Restored, text: str) -> np.ndarray:
  """int32 `[1, length]`: the greedy translation's tokens (through EOS, or as many as
  `model.max_length` allows), as decoded rather than re-encoded from their text."""
  batch = decode_sources(restored, [text], batch_size=1)[0][0]
  row = batch["tokens"][list(batch["index"]).index(0)]
  return row[row != restored.config.model.pad_id][None].astype(np.int32)


def attention_maps(restored: Restored, text: str, target: str | None = None) -> AttentionMaps:
  """The attention weights of every layer and head for one input.

  Encoder-decoder: `text` is the source and `target` its translation (default: the
  model's greedy translation of `text`); three maps: encoder self-attention (source x
  source), decoder self-attention (target x target, causal) and encoder-decoder attention
  (target x source). Decoder positions are labelled with the decoder's input tokens
  (`<s>` y1 ... yT: row t predicts y_{t+1}); sources and given targets end with `</s>`.
  Decoder-only: the self-attention over `text`; encoder-only: likewise, bidirectional.

  Raises:
    ValueError: an empty `text`/`target`, a `text` longer than the model reads
      (min(data.max_length, model.max_length) tokens) or a `target` longer than
      model.max_length, or a `target` for a model without a decoder reading a source.
  """
  cfg = restored.config
  task = get_task(cfg)
  if target is not None and not task.translates:
    raise ValueError(
      f"--target is for translation models; this workdir holds model.kind={cfg.model.kind}: drop --target"
    )
  model, params = _plain_model(restored)
  source = _encode(
    restored.source_tokenizer,
    text,
    "--text",
    min(cfg.data.max_length, cfg.model.max_length),
    eos=cfg.model.eos_id if task.translates else None,
  )
  if task.translates:
    if target is None:
      targets = _greedy(restored, text)
      target = restored.tokenizer.decode(targets[0])
    else:
      targets = _encode(restored.tokenizer, target, "--target", cfg.model.max_length, eos=cfg.model.eos_id)
    args = (source, targets)
    ids = cfg.model.special_ids
    decoder_inputs = np.asarray(shift_right(targets, ids.start, pad_id=ids.pad))[0]
    labels = {
      "encoder": token_labels(restored.source_tokenizer, source[0], ids),
      "decoder": token_labels(restored.tokenizer, decoder_inputs, ids),
    }
  else:
    args = (source,)
    labels = {"layer": token_labels(restored.tokenizer, source[0])}
  _, state = jax.jit(lambda p, *a: model.apply({"params": p}, *a, mutable=["intermediates"]))(params, *args)
  sown = state["intermediates"]
  maps = []
  for stack, module, title in task.attention_maps:
    depth = layout.layer_stacks(model)[stack]
    weights = np.stack([np.asarray(sown[f"{stack}_{i}"][module]["attention_weights"][0][0]) for i in range(depth)])
    keys = labels["encoder"] if module == "cross_attention" else labels[stack]
    maps.append(AttentionMap(title, weights, labels[stack], keys))
  return AttentionMaps(maps, target)
