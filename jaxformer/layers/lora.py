"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a
trainable low-rank update beside a frozen projection.

A target projection `y = x W` gets two params beside its kernel, `{kernel}_lora_a` (A) and
`{kernel}_lora_b` (B), and computes `y = x W + (lora_alpha / lora_rank) (x A) B`:

| `model.lora_targets` | kernel (shape) | A | B |
|---|---|---|---|
| query, key, value | `query`/`key`/`value` `[d_model, heads, head_dim]` | `[d_model, r]` | `[r, heads, head_dim]` |
| out | `out` `[heads, head_dim, d_model]` | `[heads, head_dim, r]` | `[r, d_model]` |
| mlp_in | `wi` and (gated FFNs) `wi_gate` `[d_model, d_ff]` | `[d_model, r]` | `[r, d_ff]` |
| mlp_out | `wo` `[d_ff, d_model]` | `[d_ff, r]` | `[r, d_model]` |

Every attention module has them (an encoder-decoder's self- and cross-attention alike); a mixture
of experts has no dense FFN, so there only attention targets are allowed (the config says). B starts
at zero, so a fresh adapter leaves the model's function unchanged; A is Kaiming-uniform as in
PEFT, U(-1/sqrt(fan_in), 1/sqrt(fan_in)). A keeps its kernel's input axes and B its output axes
(logical names: embed, heads, kv, mlp), the rank axis `lora` is replicated, so the adapters
shard on every mesh like their kernels; under `model.scan_layers` they get the leading layers
axis as every block param does. The params are float32 like the others and cast to the compute
dtype where used; the update is computed on the activations (two thin matmuls), never as a
`[in, out]` matrix, so training needs no full-size weight gradient.

The rest of this module works on param trees by name: which leaves are adapters (`is_adapter`),
the adapter part and the rest (`trainable`, `without_adapters`, `replace`; the train step and the
optimizer see only `trainable(params)`), `hold_frozen`, which keeps the frozen projection kernels
in bfloat16 or float16 (`precision.policy=params=bfloat16`: half their memory), and
`merge_params`, which folds each adapter into its kernel, `W + (alpha / r) A B`: the same function
up to float rounding, with no LoRA params.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
# The kernels the model casts to the compute dtype where it reads them (`MultiHeadAttention._kernel`, `FeedForward`).
COMPUTE_KERNELS = frozenset({"query", "key", "value", "out", "wi", "wi_gate", "wo"})


class LoraSpec(NamedTuple):
  """Adapter rank r, `alpha` (the update is scaled by alpha / r) and the targets (`model.lora_targets`)."""

  rank: int
  alpha: float
  targets: tuple[str, ...]

  @property
  def scale(self) -> float:
    """alpha / r."""
    return self.alpha / self.rank


def lora_spec(model_config: Any) -> LoraSpec | None:
  """The `LoraSpec` of a `ModelConfig` (`model.lora_*`), or None when `lora_rank` is 0."""
  m = model_config
  return LoraSpec(m.lora_rank, float(m.lora_alpha), tuple(m.lora_targets)) if m.lora_rank else None


def _a_init(num_in: int):
  # Kaiming-uniform with a = sqrt(5) over the flattened fan-in, as torch's Linear and PEFT: bound 1/sqrt(fan_in).
  return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform", in_axis=tuple(range(num_in)), out_axis=num_in)


def add_adapter(
  module: nn.Module,
  lora: LoraSpec | None,
  target: str,
  kernel: str,
  x: jax.Array,
  y: jax.Array,
  in_axes: tuple[str, ...],
  out_axes: tuple[str, ...],
  dtype: Any,
) -> jax.Array:
  """`y + (alpha / r) (x A) B`: the projection `kernel` of `module` (called inside its compact
  method) with its LoRA update, or `y` itself when `lora` is None or does not name `target`.

  Args:
    x: `[..., *in]`, the projection's input, e.g. `[batch, length, d_model]`; its last
      `len(in_axes)` axes are the kernel's input axes.
    y: `x W` in `dtype`, `[..., *out]` with the same tokens (possibly flattened, `[batch * length, d_ff]`);
      its last `len(out_axes)` axes are the kernel's output axes.
    in_axes, out_axes: the logical names of those axes. A is `[*in, r]`, B `[r, *out]`.
    dtype: the compute dtype.

  Returns:
    `y`'s shape and dtype.
  """
  if lora is None or target not in lora.targets:
    return y
  r = lora.rank
  in_shape, out_shape = x.shape[x.ndim - len(in_axes) :], y.shape[y.ndim - len(out_axes) :]
  a = sh.param(module, kernel + SUFFIX_A, _a_init(len(in_shape)), (*in_axes, sh.LORA), (*in_shape, r))
  b = sh.param(module, kernel + SUFFIX_B, nn.initializers.zeros, (sh.LORA, *out_axes), (r, *out_shape))
  h = jnp.dot(x.reshape(-1, math.prod(in_shape)), a.reshape(-1, r).astype(dtype))  # [tokens, r]
  update = jnp.dot(h, b.reshape(r, -1).astype(dtype)) * jnp.asarray(lora.scale, dtype)
  return y + update.reshape(y.shape)


def is_adapter(name: str) -> bool:
  """Whether the param named `name` (the last key of its path) is a LoRA A or B."""
  return name.endswith((SUFFIX_A, SUFFIX_B))


def _select(tree: Mapping[str, Any], keep) -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      sub = _select(value, keep)
      if sub:
        out[key] = sub
    elif keep(key):
      out[key] = value
  return out


def has_adapters(tree: Mapping[str, Any]) -> bool:
  """Whether a params-shaped tree (params, their shardings, specs or shapes) holds adapters."""
  return bool(_select(tree, is_adapter))


def trainable(tree: Mapping[str, Any]) -> Any:
  """The part of a params-shaped tree that trains: its adapters (a nested dict of those leaves
  alone) when it has any, else the whole tree (full fine-tuning: the same object)."""
  adapters = _select(tree, is_adapter)
  return adapters if adapters else tree


def without_adapters(tree: Mapping[str, Any]) -> dict[str, Any]:
  """A params-shaped tree less its adapters: the base model's params."""
  return _select(tree, lambda name: not is_adapter(name))


def replace(tree: Mapping[str, Any], part: Mapping[str, Any]) -> Any:
  """`tree` with the leaves of `part` (a nested dict of some of its paths, such as `trainable(tree)`
  or `without_adapters(tree)`) put in their places; `tree` itself is not changed."""
  if part is tree:
    return part
  out = dict(tree)
  for key, value in part.items():
    out[key] = replace(tree[key], value) if isinstance(value, Mapping) else value
  return out


def _map_leaves(tree: Mapping[str, Any], fn) -> dict[str, Any]:
  return {k: _map_leaves(v, fn) if isinstance(v, Mapping) else fn(k, v) for k, v in tree.items()}


def hold_frozen(params: Mapping[str, Any], dtype: str) -> Any:
  """`params` with, when they hold adapters and `dtype` is bfloat16 or float16, the frozen
  projection kernels (`COMPUTE_KERNELS`, either layout) stored in `dtype`; else as they are.

  The train state applies it with `precision.policy`'s params dtype (`model.frozen_dtype`): the
  bulk of the base at half the bytes; adapters, norms and embeddings stay float32, and a
  checkpoint restores into either dtype (Orbax casts). The model casts those kernels to the
  compute dtype where it reads them, so with `dtype` equal to the compute dtype the forward and
  the adapters' gradients are bitwise the same as with float32 storage."""
  if dtype == "float32" or not has_adapters(params):
    return params
  return _map_leaves(params, lambda name, x: x.astype(dtype) if name in COMPUTE_KERNELS else x)


def merge_params(params: Mapping[str, Any], scale: float) -> dict[str, Any]:
  """The params with each adapter folded into its kernel, `W + scale A B` (scale = alpha / r),
  computed and returned in float32, and no adapter left: the LoRA model's function as a plain
  model's params. Either layer layout (a scanned stack's leading layers axis is carried through)."""
  out = {}
  for key, value in params.items():
    if isinstance(value, Mapping):
      out[key] = merge_params(value, scale)
    elif not is_adapter(key):
      out[key] = value
      if key + SUFFIX_A in params:
        out[key] = _merged_kernel(value, params[key + SUFFIX_A], params[key + SUFFIX_B], scale)
  return out


def _merged_kernel(w, a, b, scale: float):
  """W `[*lead, *in, *out]` + scale A `[*lead, *in, r]` B `[*lead, r, *out]` (lead: stacked layers)."""
  lead = a.ndim + b.ndim - w.ndim - 2
  r = a.shape[-1]
  a2 = jnp.asarray(a, jnp.float32).reshape(*a.shape[:lead], math.prod(a.shape[lead:-1]), r)
  b2 = jnp.asarray(b, jnp.float32).reshape(*b.shape[:lead], r, math.prod(b.shape[lead + 1 :]))
  delta = jnp.einsum("...ir,...ro->...io", a2, b2).reshape(w.shape)
  return jnp.asarray(w, jnp.float32) + jnp.float32(scale) * delta
