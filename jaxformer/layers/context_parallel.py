"""Context parallelism: attention over a sequence whose length is split across mesh axes
(`mesh.context`), with all-gathered keys and values (Llama 3, Dubey et al. 2024, section 3.3.2).

Each device keeps its shard of the queries, `[batch, L / c, heads, head_dim]` with their global
positions, and gathers the keys, values and their positions, validity and segment ids over
the c devices of the axis; the attention of its queries over all keys is then computed as on
one device (dense, blockwise or fused), so the result equals unsplit attention and every mask
and position scheme that works from positions (causal, sliding window with global tokens,
padding, packed segments, RoPE applied before with global positions, ALiBi, T5) carries over.
Only the queries' share of the scores or blocks lives on a device: activation memory falls
about 1/c. Autodiff turns the gather into a reduce-scatter of the key/value gradients.

The split is manual over the context axes only (`jax.shard_map` with `axis_names`; and over
the pipeline's stage axes, which batch it inside a pipeline); batch and heads stay in jit's
automatic mode. Which axes split the length comes from the mesh and rules
the step was built for (`context_axes`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxformer import sharding as sh


def gather_length(x: jax.Array | None, axes: Sequence[str]) -> jax.Array | None:
  """All shards of `x` `[batch, length / c, ...]` along the length (dimension 1) over mesh axes
  `axes`, in order: `[batch, length, ...]` (None stays None). Call inside a map manual over `axes`.
  The gradient of a float `x` is `scatter_length` of the gathered array's."""
  if x is None or not axes:
    return x
  if jnp.issubdtype(x.dtype, jnp.floating):
    return _gather_float(tuple(axes), x)
  return jax.lax.all_gather(x, tuple(axes), axis=1, tiled=True)


def scatter_length(x: jax.Array, axes: Sequence[str]) -> jax.Array:
  """The transpose of `gather_length`: `x` `[batch, length, ...]` summed over the devices of `axes`
  and split along the length, `[batch, length / c, ...]` in `x`'s dtype. The sum runs in float32:
  it adds c partial gradients, and XLA:CPU (JAX 0.10) aborts compiling a bfloat16 reduce-scatter
  inside a map that is manual over some axes only."""
  summed = jax.lax.psum_scatter(x.astype(jnp.float32), tuple(axes), scatter_dimension=1, tiled=True)
  return summed.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_float(axes: tuple[str, ...], x: jax.Array) -> jax.Array:
  return jax.lax.all_gather(x, axes, axis=1, tiled=True)


def _gather_float_fwd(axes, x):
  return _gather_float(axes, x), None


def _gather_float_bwd(axes, _, d):
  return (scatter_length(d, axes),)


_gather_float.defvjp(_gather_float_fwd, _gather_float_bwd)


def context_axes(*lengths: int) -> tuple[str, ...]:
  """The mesh axes that split the length of activations (`act_length`) by the mesh and rules of the
  enclosing `sharding.bind`, if every one of `lengths` divides by their size c; else () (no mesh, c = 1,
  or a length that cannot split, e.g. a source being translated: left to jit's automatic partitioning;
  training lengths are checked before compiling, `runtime.startup.check_model_fits_mesh`)."""
  axes = sh.split_axes(sh.ACT_LENGTH)
  ways = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
  return axes if all(n % ways == 0 for n in lengths) else ()


def over_length(fn: Callable[[Any, Any], jax.Array], axes: Sequence[str], split: Any, whole: Any) -> jax.Array:
  """`fn(split, whole)` run on each device's shard of the length.

  Args:
    fn: maps (the local shards of `split`, `whole`) to the local output `[batch, length / c, ...]`;
      it may gather (`gather_length`) over `axes`.
    axes: mesh axes of the current mesh (`jax.set_mesh`, as `sharding.bind` sets it) that split
      the length, c devices in all, dividing every length (`context_axes`).
    split: a pytree of arrays `[batch, length, ...]` (batch may be 1; None leaves allowed), each
      split along dimension 1.
    whole: a pytree of arrays every device gets whole (e.g. position-bias params).

  Returns:
    `[batch, length, ...]`, split along dimension 1 over `axes`.
  """
  axes = tuple(axes)
  spec = PartitionSpec(None, axes)
  in_specs = (jax.tree.map(lambda _: spec, split), jax.tree.map(lambda _: PartitionSpec(), whole))
  # Also manual over the pipeline's stage axes: under the pipeline's `vmap(spmd_axis_name=...)` the
  # map is batched over them (outside a pipeline every input is the same on each stage device). There
  # JAX 0.10's varying-axes check rejects mixing per-stage masks with stage-invariant positions, so it
  # is off: every collective here names its axes explicitly.
  stages = frozenset(sh.split_axes(sh.STAGES))
  return jax.shard_map(
    fn, in_specs=in_specs, out_specs=spec, axis_names=frozenset(axes) | stages, check_vma=not stages
  )(split, whole)
