"""Int8 weight-only quantization of a model's params for decoding.

Each matrix-like float kernel becomes a `QuantizedArray`: int8 values and float32 scales,
symmetric, one scale per output channel (absmax / 127), so `w ~ values * scale` with an
error of at most half a scale step per element. Activations and the KV cache stay in the
compute dtype; only the stored weights shrink (about 4x against float32).

Use: quantize once on the host (`quantize_params`), keep the int8 tree on the device, and
call `dequantize_params` at the top of the jitted decode function. XLA then converts and
scales the weights inside each call: the multiply fuses into the convert, and the float
weights exist only as per-call temporaries (materialised for the matmuls that read them),
while the memory held between calls, and moved host -> device, is the int8 tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

INT8_MAX = 127

# Param name -> (ndim of one layer's kernel, the axes a matmul contracts, i.e. reduced for the scale).
# Projections `[d_model, heads, head_dim]` scale per (head, head_dim); the attention output
# `[heads, head_dim, d_model]` per d_model; FFN and output kernels `[in, out]` per column. An
# `embedding` table `[rows, d_model]` (token lookup, tied output layer, learned positions) is
# read by rows, so it scales per row: right for both the lookup and the tied logits.
KERNELS: dict[str, tuple[int, tuple[int, ...]]] = {
    "query": (3, (0,)), "key": (3, (0,)), "value": (3, (0,)), "out": (3, (0, 1)),
    "wi": (2, (0,)), "wi_gate": (2, (0,)), "wo": (2, (0,)),
    "output_proj": (2, (0,)), "embedding": (2, (1,)),
}


@flax.struct.dataclass
class QuantizedArray:
  """A kernel stored as int8 values and float32 per-output-channel scales (a pytree node).

  Attributes:
    values: int8, the kernel's shape, in [-127, 127].
    scale: float32, the kernel's shape with the contracted (input) axes of size 1, e.g.
      `[1, heads, head_dim]` for a `[d_model, heads, head_dim]` projection, `[layers, 1, d_ff]`
      for stacked `[layers, d_model, d_ff]` kernels, `[vocab, 1]` for an embedding table.
  """
  values: jax.Array
  scale: jax.Array

  def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
    """`values * scale` (computed in float32) as `dtype`, the kernel's shape."""
    return (self.values.astype(jnp.float32) * self.scale).astype(dtype)


def _is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedArray)


def _dict_keys(path: tuple) -> list[str]:
  """The dict keys of a tree path: `["decoder", "ffn", "wi"]`; the last is the param's name."""
  return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)] or [""]


def _stack_depths(params: Any) -> dict[str, int]:
  """Leading stacked axes (`[num_layers]` under `model.scan_layers`) of each top-level subtree:
  how many more axes its known kernels have than one layer's kernel (the fewest: a mixture of
  experts' kernels have one more, `[experts]`)."""
  depths: dict[str, int] = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = _dict_keys(path)
    if keys[-1] in KERNELS:
      depths[keys[0]] = min(depths.get(keys[0], x.ndim), x.ndim - KERNELS[keys[-1]][0])
  return depths


def _reduced_axes(name: str, ndim: int, depth: int) -> tuple[int, ...] | None:
  """The contracted axes of a kernel of `ndim` axes with `depth` leading stacked axes, or None
  when the leaf is not a kernel (fewer than 2 axes per layer: norm scales, biases). Kernels
  of other names are taken as `[..., in, out]` (Flax's Dense convention); a known kernel with
  more leading axes (a mixture of experts' `[experts, ...]`) gets a scale per expert too."""
  if name == "router":   # a mixture of experts' router: small, and its top-k choices are sensitive
    return None
  if name in KERNELS and ndim >= KERNELS[name][0] + depth:
    return tuple(ndim - KERNELS[name][0] + a for a in KERNELS[name][1])
  if name not in KERNELS and ndim - depth >= 2:
    return (ndim - 2,)
  return None


def quantize_array(w: jax.Array, reduced_axes: tuple[int, ...]) -> QuantizedArray:
  """Symmetric int8 quantization with one float32 scale per output channel.

  Args:
    w: float kernel, any shape.
    reduced_axes: the contracted (input) axes of `w`; every other index is an output channel.

  Returns:
    `QuantizedArray` with `scale = max |w| / 127` over `reduced_axes` (kept as size-1 axes)
    and `values = round(w / scale)`, so `|w - values * scale| <= scale / 2` elementwise. An
    all-zero channel gets scale 0 and values 0.
  """
  w = jnp.asarray(w, jnp.float32)
  scale = jnp.max(jnp.abs(w), axis=reduced_axes, keepdims=True) / INT8_MAX
  safe = jnp.where(scale > 0, scale, 1.0)  # an all-zero channel: 0 / 1 = 0, not 0 / 0
  values = jnp.clip(jnp.round(w / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return QuantizedArray(values=values, scale=scale)


def quantize_params(params: Mapping[str, Any], min_size: int = 4096) -> Any:
  """Int8 weight-only quantization of a Flax params tree (the unboxed `params` collection).

  Every float kernel with at least two axes per layer and `min_size` elements or more becomes a
  `QuantizedArray` (scales per output channel, per layer for the stacked `[num_layers, ...]`
  leaves of `model.scan_layers`; see `KERNELS`). Norm scales, biases, small kernels and
  non-float leaves are kept as they are. Traceable: it may run under `jax.jit` or `jax.eval_shape`.

  Args:
    params: the model's params, e.g. `{"embed": {"embedding": [vocab, d_model]}, "encoder_0": ...}`.
    min_size: elements below which a kernel stays float (its scales would cost more than they save).

  Returns:
    A tree of the same structure with `QuantizedArray` nodes in place of the quantized kernels.

  Raises:
    ValueError: the tree is already quantized, or holds no float kernel of `min_size` elements.
  """
  if any(_is_quantized(x) for x in jax.tree.leaves(params, is_leaf=_is_quantized)):
    raise ValueError("quantize_params: the params are already quantized; pass the float params")
  depths = _stack_depths(params)
  count = 0

  def quantize(path, w):
    nonlocal count
    if not jnp.issubdtype(w.dtype, jnp.floating) or w.size < min_size:
      return w
    keys = _dict_keys(path)
    axes = _reduced_axes(keys[-1], w.ndim, depths.get(keys[0], 0))
    if axes is None:
      return w
    count += 1
    return quantize_array(w, axes)

  out = jax.tree_util.tree_map_with_path(quantize, params)
  if not count:
    raise ValueError(f"quantize_params: no float kernel with >= {min_size} elements to quantize; "
                     "pass the model's unboxed 'params' collection or a smaller min_size")
  return out


def dequantize_params(qparams: Mapping[str, Any], dtype: Any = jnp.float32) -> Any:
  """The float params back from `quantize_params`' output: every `QuantizedArray` becomes
  `values * scale` in `dtype`; other leaves are returned unchanged, so with float32 the
  tree has exactly the original structure, shapes and dtypes. Call it inside the jitted
  decode function so that only the int8 tree is held between calls (module docstring).

  Args:
    qparams: a tree from `quantize_params`.
    dtype: dtype of the dequantised kernels (e.g. the compute dtype, bfloat16).
  """
  return jax.tree.map(lambda x: x.dequantize(dtype) if _is_quantized(x) else x, qparams, is_leaf=_is_quantized)


def weight_bytes(tree: Any) -> int:
  """Bytes of all array leaves of `tree` (arrays or `jax.ShapeDtypeStruct`s; a `QuantizedArray`
  counts its int8 values and float32 scales)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
