"""Causal language modelling with the decoder-only model (`model.kind=decoder_only`).

Batches are token windows whose targets are the inputs shifted one token ahead (the data
pipeline makes them); with packing, segment ids and positions keep each document apart.
Evaluation reports the validation split's loss and perplexity; `jaxformer generate`
samples from the model with the KV cache.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxformer import data as D
from jaxformer.config import ConfigError
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.tasks.base import EvalOptions, Outputs, Task, apply_model


def lm_outputs(model, params, batch, rng, inputs):
  """The language models' forward pass on `inputs` (the batch's or masked), with packing's
  segment ids and positions when the batch has them: (logits, auxiliary sums), see `apply_model`."""
  return apply_model(
    model,
    params,
    rng,
    inputs,
    None,
    segment_ids=batch.get("inputs_segment_ids"),
    positions=batch.get("inputs_positions"),
  )


class CausalLM(Task):
  """Token windows -> `DecoderOnly`; see the module docstring."""

  kind = "decoder_only"
  data_kind = D.TEXT
  generates = True
  benchable = True
  attention_maps = (("layer", "self_attention", "decoder self-attention"),)
  bert_embeddings = True
  default_split = "val"
  shift = True

  def validate(self) -> None:
    """`Task.validate`.

    Raises:
      ConfigError: Linformer attention, which is non-causal.
    """
    super().validate()
    if self.config.model.attention == "linformer" and self.make_model().CAUSAL:  # (the masked LM is not)
      raise ConfigError(
        "model.attention=linformer is non-causal (keys are mixed along the sequence); use it with "
        "model.kind=encoder_only or encoder_decoder (its encoder), or model.attention=dense|blockwise"
      )

  def make_model(self) -> DecoderOnly:
    """`Task.make_model`: a `DecoderOnly` model."""
    return DecoderOnly(self.config.model)

  def make_batches(self, splits, process_index: int = 0, process_count: int = 1):
    """`Task.make_batches`: windows of the token stream (`data.window_batches`)."""
    return D.window_batches(self.config, splits, self.shift, process_index, process_count)

  def outputs(self, model, params, batch, rng):
    """`Task.outputs`: next-token logits, targets and weights (1 on targets that are not padding)."""
    logits, aux = lm_outputs(model, params, batch, rng, batch["inputs"])
    return Outputs(logits, batch["targets"], (batch["targets"] != self.config.model.pad_id).astype(jnp.float32), aux)

  def evaluate(self, restore, options: EvalOptions) -> dict[str, Any]:
    """Loss over the whole `options.split` (batches of `train.batch_size` windows): `loss`
    (mean NLL per predicted token, nats, no label smoothing), `perplexity` = exp(loss),
    `accuracy` (argmax hits; for the masked LM over the masked tokens only) and `num_tokens`."""
    import jax  # noqa: PLC0415

    from jaxformer.tasks.evaluate import batches_loss  # noqa: PLC0415

    if options.src or options.ref:
      raise ValueError("--src/--ref score translations; a language model's eval scores --split val|test")
    data = self.eval_split(options)
    batches = D.lm_eval_batches(self.config, data, self.shift, jax.process_index(), jax.process_count())
    restored = restore()
    split = options.split or self.default_split
    return {"step": restored.step, **batches_loss(restored, batches), "split": split, "kind": self.kind}
