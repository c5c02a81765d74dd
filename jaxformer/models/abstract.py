"""A model's parameters as shapes and shardings, without allocating them: what a train state
is built around and what a checkpoint's params are restored into."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.layers import lora
from jaxformer.models.batched_threefry import batched_threefry


def _boxed_params(model: nn.Module, rng: jax.Array) -> Any:
  ids = jnp.ones((1, 8), jnp.int32)
  return model.init(rng, ids, ids)["params"]


def _held(model: nn.Module, params: Any, known: Any = None) -> Any:
  """`params` with `known` in place and a LoRA model's frozen base held in `model.config.frozen_dtype`."""
  return lora.hold_frozen(params if known is None else lora.replace(params, known), model.config.frozen_dtype)


def init_params(model: nn.Module, rng: jax.Array, known: Any = None) -> Any:
  """`model`'s initial params, unboxed; `known`: params that replace their initial values (a nested
  dict of some of the paths). Call it inside `jax.jit`. On one device the parameters' random
  draws are merged into a few Threefry calls (`batched_threefry`), bitwise the values `model.init`
  gives: XLA:CPU compiled a tiny model's init 3x faster (benchmarks/init_compile.py). Sharded over
  several devices the merge did not pay at XLA's default optimisation level (0.9x on 8), so
  there each draw keeps its own call."""
  init = lambda key: _boxed_params(model, key)  # noqa: E731
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or math.prod(mesh.axis_sizes) == 1:
    init = batched_threefry(init)
  return _held(model, nn.meta.unbox(init(rng)), known)


def abstract_params(model: nn.Module) -> tuple[Any, Any]:
  """(params as ShapeDtypeStructs, their logical PartitionSpecs), without allocating them."""

  def init(rng):
    boxed = _boxed_params(model, rng)
    return _held(model, nn.meta.unbox(boxed)), boxed

  abstract, boxed = jax.eval_shape(init, jax.random.key(0))
  return abstract, nn.get_partition_spec(boxed)


def param_shardings(model: nn.Module, mesh: Mesh, rules: sh.Rules = sh.LOGICAL_RULES) -> tuple[Any, Any]:
  """(abstract params, NamedSharding tree) of `model` on `mesh` by `rules`.

  Raises:
    ConfigError: a dimension does not split evenly over its mesh axes.
  """
  abstract, specs = abstract_params(model)
  shardings = sh.logical_to_sharding(specs, mesh, rules)
  sh.check_divisible(abstract, shardings)
  return abstract, shardings
