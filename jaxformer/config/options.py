"""Validation of the model's architecture options (`model.*` beyond the shape): attention kind
and position scheme, and the options that only make sense together. `ModelConfig.validate`
calls `validate_architecture`; `Config.validate` calls `validate_with_data` for the checks that
need the data section. Every error is one line naming the key and the fix.
"""

from __future__ import annotations

import math
from typing import Any

from jaxformer.errors import ConfigError

# values of model.rope_scaling (layers.positions.RopeScaling)
ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")


def validate_architecture(m: Any) -> None:
  """Checks a `ModelConfig`'s attention / position options. Raises `ConfigError`."""
  if m.num_kv_heads < 0 or (m.num_kv_heads and m.num_heads % m.num_kv_heads):
    raise ConfigError(
      f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}; "
      f"use one of {[k for k in range(1, m.num_heads + 1) if m.num_heads % k == 0]} (or 0 = num_heads)"
    )
  for name in ("attn_logit_softcap", "sliding_window", "global_tokens", "rope_trained_length", "attention_head_dim"):
    if getattr(m, name) < 0:
      raise ConfigError(f"model.{name} must be >= 0 (0 turns it off), got {getattr(m, name)}")
  if m.attention_block_size <= 0:
    raise ConfigError(f"model.attention_block_size must be positive, got {m.attention_block_size}")
  if m.attention in ("blockwise", "fused", "splash") and m.attention_dropout_rate > 0:
    raise ConfigError(
      f"model.attention={m.attention} does not support attention dropout; "
      "set model.attention_dropout_rate=0 or model.attention=dense"
    )
  if m.attention == "fused" and m.attn_logit_softcap > 0:
    raise ConfigError(
      "model.attention=fused has no score soft-cap; set model.attn_logit_softcap=0 or model.attention=dense"
    )
  if m.attention == "splash" and (m.position in ("alibi", "t5") or m.global_tokens):
    raise ConfigError(
      "model.attention=splash (TPU flash attention) takes no score bias (position alibi, t5) or "
      "global tokens; use model.attention=dense or blockwise for them"
    )
  if m.attention == "splash" and m.attention_block_size % 128:
    raise ConfigError(
      f"model.attention=splash needs model.attention_block_size to be a multiple of 128 (the TPU "
      f"kernels' lanes), e.g. 512; got {m.attention_block_size}"
    )
  if m.position == "rope" and m.head_dim % 2:
    raise ConfigError(
      f"model.position=rope needs an even head_dim, got {m.head_dim}; change model.d_model or model.num_heads"
    )
  if m.position == "sinusoidal" and m.d_model % 2:
    raise ConfigError(f"model.position=sinusoidal needs an even model.d_model, got {m.d_model}")
  if not 0.0 < m.norm_epsilon < math.inf:
    raise ConfigError(f"model.norm_epsilon must be a finite number > 0, got {m.norm_epsilon}; e.g. 1e-6")
  if m.num_experts and not m.mlp_bias:
    raise ConfigError(
      "model.mlp_bias=false acts on the dense FFN; a mixture of experts keeps its biases: "
      "set model.mlp_bias=true or model.num_experts=0"
    )
  _validate_experts(m)
  _validate_rope_scaling(m)
  _validate_t5(m)
  _validate_linformer(m)
  _validate_lora(m)
  _validate_embeddings(m)
  for name in ("pad_id", "bos_id", "eos_id", "decoder_start_id", "mask_id"):
    if not -1 <= getattr(m, name) < m.vocab_size:
      raise ConfigError(
        f"model.{name}={getattr(m, name)} is not a token id of model.vocab_size={m.vocab_size}; "
        "use an id below it, or -1 for none"
      )
  if m.global_tokens and not m.sliding_window:
    raise ConfigError(
      f"model.global_tokens={m.global_tokens} acts on top of a sliding window; "
      "set model.sliding_window too, or model.global_tokens=0"
    )


def _validate_experts(m: Any) -> None:
  if m.num_experts < 0:
    raise ConfigError(f"model.num_experts must be >= 0 (0 = a dense FFN), got {m.num_experts}")
  if m.num_experts and not 1 <= m.experts_per_token <= m.num_experts:
    raise ConfigError(
      f"model.experts_per_token={m.experts_per_token} must be in [1, model.num_experts="
      f"{m.num_experts}]; route each token to fewer experts or add experts"
    )
  if not 0.0 <= m.expert_capacity_factor < math.inf:  # written so that NaN fails too
    raise ConfigError(
      f"model.expert_capacity_factor must be a finite number >= 0 (0 = no capacity limit), "
      f"got {m.expert_capacity_factor}; e.g. 1.25"
    )
  for name in ("router_aux_loss", "router_z_loss"):
    if not 0.0 <= getattr(m, name) < math.inf:
      raise ConfigError(f"model.{name} must be a finite number >= 0 (0 = off), got {getattr(m, name)}")


def _validate_rope_scaling(m: Any) -> None:
  if m.rope_scaling != "none" and m.position != "rope":
    raise ConfigError(
      f"model.rope_scaling={m.rope_scaling} rescales RoPE frequencies; "
      "it needs model.position=rope (or model.rope_scaling=none)"
    )
  if not 1.0 <= m.rope_scaling_factor < math.inf:  # written so that NaN fails too
    raise ConfigError(
      f"model.rope_scaling_factor must be a finite number >= 1 (extended / trained context), "
      f"got {m.rope_scaling_factor}"
    )
  if not 1.0 < m.rope_theta < math.inf:
    raise ConfigError(
      f"model.rope_theta must be a finite number > 1 (the base of RoPE's frequencies), got {m.rope_theta}; e.g. 10000"
    )
  if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
    raise ConfigError(
      f"model.rope_scaling=llama3 needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor, "
      f"got {m.rope_low_freq_factor} and {m.rope_high_freq_factor}; Llama 3.1 uses 1 and 4"
    )


def _validate_t5(m: Any) -> None:
  if m.relative_buckets < 4 or m.relative_buckets % 2:
    raise ConfigError(
      f"model.relative_buckets must be an even number >= 4 (half per direction in the encoder), "
      f"got {m.relative_buckets}"
    )
  if m.relative_max_distance <= m.relative_buckets // 2:
    raise ConfigError(
      f"model.relative_max_distance={m.relative_max_distance} must exceed half of "
      f"model.relative_buckets={m.relative_buckets} (the exact buckets); e.g. 128"
    )


def _validate_linformer(m: Any) -> None:
  # The decoder-only model has no non-causal attention for it: `tasks.causal_lm` rejects it.
  if m.linformer_k < 1:
    raise ConfigError(f"model.linformer_k must be >= 1, got {m.linformer_k}")
  if m.attention != "linformer":
    return
  if m.position in ("alibi", "t5"):
    raise ConfigError(
      f"model.position={m.position} biases scores by token distance, which Linformer's projected "
      "keys no longer have; use model.position=sinusoidal, learned or rope"
    )


def _validate_embeddings(m: Any) -> None:
  """The BERT-style options' values (which kinds have them at all is the task's question: `Task.validate`)."""
  for name in ("type_vocab_size", "position_offset"):
    if getattr(m, name) < 0:
      raise ConfigError(f"model.{name} must be >= 0 (0 turns it off), got {getattr(m, name)}")
  if m.position_offset and m.position != "learned":
    raise ConfigError(
      f"model.position_offset={m.position_offset} shifts the rows of the learned position table; "
      "set model.position=learned or model.position_offset=0"
    )


# values of model.lora_targets: the projections LoRA adapters can sit beside (layers/lora.py)
LORA_TARGETS = ("query", "key", "value", "out", "mlp_in", "mlp_out")


def _validate_lora(m: Any) -> None:
  bad = [t for t in m.lora_targets if t not in LORA_TARGETS]
  if bad:
    raise ConfigError(
      f"model.lora_targets: unknown target {bad[0]!r}; use a list among {', '.join(LORA_TARGETS)}, "
      "e.g. model.lora_targets=[query,value]"
    )
  if m.lora_rank < 0:
    raise ConfigError(f"model.lora_rank must be >= 0 (0 turns LoRA off), got {m.lora_rank}; e.g. 8")
  if not m.lora_rank:
    return
  if not m.lora_targets or len(set(m.lora_targets)) != len(m.lora_targets):
    raise ConfigError(
      f"model.lora_targets={list(m.lora_targets)} must name each target once and at least one; "
      "e.g. model.lora_targets=[query,value]"
    )
  if not 0.0 < m.lora_alpha < math.inf:  # written so that NaN fails too
    raise ConfigError(f"model.lora_alpha must be a finite number > 0, got {m.lora_alpha}; e.g. 16")
  mlp = [t for t in m.lora_targets if t.startswith("mlp")]
  if mlp and m.num_experts:
    raise ConfigError(
      f"model.lora_targets={list(m.lora_targets)}: a mixture of experts (model.num_experts="
      f"{m.num_experts}) has no dense FFN for {mlp[0]}; target the attention projections only"
    )


def validate_with_data(model: Any, data: Any) -> None:
  """Checks the model options against the `DataConfig`. Raises `ConfigError`."""
  if model.attention == "linformer" and data.packing:
    raise ConfigError(
      "model.attention=linformer mixes all positions of a row, so it cannot keep packed examples "
      "apart; set data.packing=false"
    )
