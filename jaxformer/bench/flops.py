"""What MFU divides: a step's model FLOPs from the config (`forward_flops_per_pair`,
`train_flops_per_step`) and the device's peak FLOP/s (`device_peak`: measured on a CPU, from
vendor data sheets elsewhere), plus the compute dtype a lowered program's matmuls really use.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import ModelConfig
from jaxformer.tasks import task_class

# Dense (no sparsity) peak FLOP/s from vendor data sheets, per device: (the rate XLA's
# default float32 matmuls run at -- TF32 on Ampere and newer GPUs, bfloat16 passes on TPU --,
# the bfloat16/float16 rate). The first entry whose name occurs in `device.device_kind` wins.
PUBLISHED_PEAKS: tuple[tuple[str, float, float], ...] = (
  ("H100 PCIe", 378e12, 756e12),
  ("H100", 494.7e12, 989.4e12),  # SXM
  ("H200", 494.7e12, 989.4e12),
  ("A100", 156e12, 312e12),
  ("L4", 60e12, 121e12),
  ("V100", 15.7e12, 125e12),  # no TF32: plain float32
  ("TPU v4", 275e12, 275e12),
  ("TPU v5 lite", 197e12, 197e12),  # v5e
  ("TPU v5", 459e12, 459e12),  # v5p
  ("TPU v6 lite", 918e12, 918e12),  # v6e (Trillium)
)


def forward_flops_per_pair(m: ModelConfig, src_length: int, tgt_length: int) -> int:
  """Matmul FLOPs of one forward pass over one sentence pair, or one decoder-only row of
  `tgt_length` tokens (2 FLOPs per multiply-add).

  With S = src_length, T = tgt_length, D = d_model, F = d_ff, V = vocab_size, Q = heads x
  head_dim (= D unless `model.attention_head_dim` says otherwise), C = key/value heads x head_dim
  (= Q without grouped-query heads), G = 3 for a gated FFN (SwiGLU, GeGLU), else 2:
    encoder layer, per source token:  4·D·Q + 4·D·C (Q, output; K, V projections) + 2·G·D·F (FFN)
                                      + 4·S·Q (scores q·k and the weighted sum of v)
    decoder layer, per target token:  4·D·Q + 4·D·C + 4·T·Q (masked self-attention, full T×T as computed)
                                      + 2·G·D·F (FFN); with an encoder also
                                      4·D·Q + 4·S·Q (cross-attention Q and output, scores, sum)
                  and per source token: 4·D·C (cross-attention K and V of the encoder output)
    output logits, per target token:  2·D·V
  For the paper's model (C = D, G = 2) the layers are 8·D² + 4·D·F per token plus attention.
  A mixture of experts (`model.num_experts` = E, k experts per token) counts the FFNs a token
  is routed to, k·2·G·D·F, and its router, 2·D·E (not the dispatch and combine einsums).
  Embedding gathers, norms, softmax, dropout and the optimizer are not counted.
  """
  d, f, s, t = m.d_model, m.d_ff, src_length, tgt_length
  q, c, g = m.num_heads * m.head_dim, m.kv_heads * m.head_dim, 3 if m.ffn in ("swiglu", "geglu", "geglu_tanh") else 2
  ffn = 2 * g * d * f * m.experts_per_token + 2 * d * m.num_experts if m.num_experts else 2 * g * d * f
  block = 4 * d * q + 4 * d * c + ffn
  if not task_class(m.kind).translates:
    return m.num_decoder_layers * t * (block + 4 * t * q) + t * 2 * d * m.vocab_size
  encoder = s * m.num_encoder_layers * (block + 4 * s * q)
  decoder = m.num_decoder_layers * (t * (block + 4 * t * q + 4 * d * q + 4 * s * q) + s * 4 * d * c)
  return encoder + decoder + t * 2 * d * m.vocab_size


def train_flops_per_step(m: ModelConfig, batch_size: int, src_length: int, tgt_length: int) -> int:
  """Model FLOPs of one training step: forward + backward = 3 × the forward matmuls
  (the backward pass computes two matmuls per forward one: the input and the weight
  gradients), times the batch. Divide by `batch_size * tgt_length` for FLOPs per target token."""
  return 3 * batch_size * forward_flops_per_pair(m, src_length, tgt_length)


def published_peak(device_kind: str, low_precision: bool) -> float | None:
  """Peak FLOP/s of one device from `PUBLISHED_PEAKS`, or None for an unlisted kind."""
  for name, default_rate, low_rate in PUBLISHED_PEAKS:
    if name in device_kind:
      return low_rate if low_precision else default_rate
  return None


def time_calls(fn: Callable[[], Any], n: int) -> list[float]:
  """Wall seconds of each of `n` calls of `fn` (which must block until its work is done)."""
  times = []
  for _ in range(n):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def measure_matmul_peak(size: int = 2048, repeats: int = 10, device: jax.Device | None = None) -> float:
  """Float32 FLOP/s of a jitted `[size, size] @ [size, size]` matmul on `device` (default: the
  first device): the best of `repeats` timed runs after an untimed one, since load from other
  processes can only slow a run down. The CPU backend spreads one matmul over all cores."""
  device = device or jax.devices()[0]
  a = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), jnp.float32), device)
  matmul = jax.jit(lambda x: x @ x).lower(a).compile()
  matmul(a).block_until_ready()
  return 2 * size**3 / min(time_calls(lambda: matmul(a).block_until_ready(), repeats))


def dot_dtypes(stablehlo_text: str) -> collections.Counter:
  """How many `dot_general` ops of each operand element type (e.g. 'f32', 'bf16') a
  lowered program holds: the compute dtype actually used, whatever the config says."""
  return collections.Counter(
    re.findall(r"stablehlo\.dot_general [^\n]*?: \(tensor<[0-9x]*([a-z]+[0-9]*)>", stablehlo_text)
  )


def device_peak(compute_dtype: str) -> tuple[float | None, str]:
  """(peak FLOP/s of all devices in the run, how it was obtained). CPU: measured now in
  float32 (one host: the devices share its cores); elsewhere: per-device table × devices."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return measure_matmul_peak(), "measured float32 matmul"
  peak = published_peak(device.device_kind, compute_dtype in ("bf16", "f16"))
  if peak is None:
    return None, f"no published peak for {device.device_kind!r}"
  return peak * jax.device_count(), f"published ({device.device_kind}, {compute_dtype})"
