"""Int8 weight quantization of a model's params for decoding.

Each matrix-like float kernel becomes a `layers.int8.QuantizedArray`: int8 values and float32
scales, symmetric, one scale per output channel (absmax / 127), so `w ~ values * scale` with an
error of at most half a scale step per element. The KV cache stays in the compute dtype.

Use: quantize once on the host (`quantize_params`), keep the int8 tree on the device, and call
`decoding_params` at the top of the jitted decode function. It leaves the kernels the layers
multiply in int8 (`INT8_MATMUL`: attention and feed-forward projections, output layer, embedding
tables) as they are: those products quantize their activations per row and run int8 x int8 with
int32 accumulation (`layers.int8`), about twice as fast as float32 on XLA:CPU at decode shapes.
It dequantizes the others (a mixture of experts' kernels, small tables) inside the call, so they
exist in float only as per-call temporaries. `dequantize_params` gives the whole float tree
(evaluation losses, attention maps).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.layers.int8 import INT8_MAX, QuantizedArray, is_quantized

# Param name -> (ndim of one layer's kernel, the axes a matmul contracts, i.e. reduced for the scale).
# Projections `[d_model, heads, head_dim]` scale per (head, head_dim); the attention output
# `[heads, head_dim, d_model]` per d_model; FFN and output kernels `[in, out]` per column. An
# `embedding` table `[rows, d_model]` (token lookup, tied output layer, learned positions) is
# read by rows, so it scales per row: right for both the lookup and the tied logits.
KERNELS: dict[str, tuple[int, tuple[int, ...]]] = {
  "query": (3, (0,)),
  "key": (3, (0,)),
  "value": (3, (0,)),
  "out": (3, (0, 1)),
  "wi": (2, (0,)),
  "wi_gate": (2, (0,)),
  "wo": (2, (0,)),
  "output_proj": (2, (0,)),
  "embedding": (2, (1,)),
}


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
  if name == "router":  # a mixture of experts' router: small, and its top-k choices are sensitive
    return None
  if name in KERNELS and ndim >= KERNELS[name][0] + depth:
    return tuple(ndim - KERNELS[name][0] + a for a in KERNELS[name][1])
  if name not in KERNELS and ndim - depth >= 2:
    return (ndim - 2,)
  return None


# Jitted: one fused program per kernel shape, rather than eight whole-kernel passes (and eight
# small compiles) op by op when a model is quantized on the host.
@functools.partial(jax.jit, static_argnames="reduced_axes")
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
  """Int8 quantization of the kernels of a Flax params tree (the unboxed `params` collection).

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
  if any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized)):
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
    raise ValueError(
      f"quantize_params: no float kernel with >= {min_size} elements to quantize; "
      "pass the model's unboxed 'params' collection or a smaller min_size"
    )
  return out


def dequantize_params(qparams: Mapping[str, Any], dtype: Any = jnp.float32) -> Any:
  """The float params back from `quantize_params`' output: every `QuantizedArray` becomes
  `values * scale` in `dtype`; other leaves are returned unchanged, so with float32 the
  tree has exactly the original structure, shapes and dtypes. Call it inside a jitted
  function so that only the int8 tree is held between calls (decoding: `decoding_params`).

  Args:
    qparams: a tree from `quantize_params`.
    dtype: dtype of the dequantised kernels (e.g. the compute dtype, bfloat16).
  """
  return jax.tree.map(lambda x: x.dequantize(dtype) if is_quantized(x) else x, qparams, is_leaf=is_quantized)


def int8_products() -> bool:
  """Whether decoding multiplies int8 kernels in int8 (`decoding_params`): everywhere but on an
  XLA:CPU whose YNNPACK dots are off (`XLA_FLAGS` sets `--xla_cpu_experimental_ynn_fusion_type`
  without `individual_dot`, as `runtime.deterministic` does). Eigen then runs the int8 dot
  1.3-2.8x slower than the float32 one, so the kernels are dequantized instead."""
  if jax.default_backend() != "cpu":
    return True
  ynn = [
    f.split("=", 1)[1]
    for f in os.environ.get("XLA_FLAGS", "").split()
    if f.startswith("--xla_cpu_experimental_ynn_fusion_type=")
  ]
  return not ynn or "individual_dot" in ynn[-1].split(",")


def decoding_params(qparams: Mapping[str, Any], dtype: Any = jnp.float32) -> Any:
  """The params a decode function passes to the model: `qparams` with the kernels the layers
  multiply in int8 left quantized (every `KERNELS` name at one layer's shape, or stacked per
  layer) where `int8_products()`, and the other `QuantizedArray`s (a mixture of experts'
  `[experts, ...]` kernels, kernels of other names; all of them where not `int8_products()`)
  dequantized to `dtype`. Call it inside the jitted decode function.

  Args:
    qparams: a tree from `quantize_params` (a float tree comes back unchanged).
    dtype: dtype of the dequantized kernels.
  """
  depths, keep = _stack_depths(qparams), int8_products()

  def convert(path, x):
    if not is_quantized(x):
      return x
    keys = _dict_keys(path)
    if keep and keys[-1] in KERNELS and x.values.ndim == KERNELS[keys[-1]][0] + depths.get(keys[0], 0):
      return x
    return x.dequantize(dtype)

  return jax.tree_util.tree_map_with_path(convert, qparams, is_leaf=is_quantized)


def weight_bytes(tree: Any) -> int:
  """Bytes of all array leaves of `tree` (arrays or `jax.ShapeDtypeStruct`s; a `QuantizedArray`
  counts its int8 values and float32 scales)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
