"""Device mesh and the one table that maps logical axis names to mesh axes.

Every parameter is created with logical axis names (`param`) and activations
are constrained by logical name at block boundaries (`constrain`). `LOGICAL_RULES` turns
those names into mesh axes, so changing the parallelism never touches model code.

The mesh and the rules are values passed explicitly: a run builds its mesh from
`mesh.*` (`make_mesh`) and its rules from `mesh.rules` (`rules_for`) once, and hands both
to every function that maps logical names (`logical_to_sharding`, `batch_sharding`,
`data_parallel_size`) and to every jitted-function factory, which fixes them when it is
built. Model code sees them only while such a function traces, through `bind` (the one
place that sets Flax's logical-axis rules), so a function built for some rules can never
trace with others.
The mesh uses `AxisType.Auto`: jit propagates shardings from the annotations
(the "automatic" mode), rather than JAX's newer default of explicit sharding types.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.errors
import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxformer.config import ConfigError
from jaxformer.config.mesh import MESH_AXES, MeshConfig

# Weight axes.
VOCAB = "vocab"
EMBED = "embed"
HEADS = "heads"
KV = "kv"  # head_dim
MLP = "mlp"
LAYERS = "layers"  # leading axis of params stacked by nn.scan (model.scan_layers)
STAGES = "stages"  # leading axis of a pipeline's per-stage buffers (models/pipeline.py)
EXPERTS = "experts"  # the experts of a mixture-of-experts layer (layers/moe.py)
LORA = "lora"  # the rank axis of LoRA adapters (layers/lora.py): small, replicated
# Activation axes.
ACT_BATCH = "act_batch"
ACT_LENGTH = "act_length"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_KV = "act_kv"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"
ACT_EXPERTS = "act_experts"  # the experts of the MoE's expert buffers `[batch, experts, capacity, ...]`
ACT_EXPERT_BATCH = "act_expert_batch"  # their batch: act_batch without the expert axis (the experts take it)

# Logical axis -> mesh axis (or axes, or None = replicated). Batch over data+fsdp+expert (outside the
# MoE's expert buffers the expert axis is one more data axis); the length of activations over context;
# weights fully sharded over fsdp along embed (ZeRO-3); heads/d_ff/vocab over tensor; experts over
# expert; scanned layers (contiguous blocks of them) and pipeline buffers over stage; LoRA ranks replicated.
Rules = tuple[tuple[str, Any], ...]
LOGICAL_RULES: Rules = (
  (ACT_BATCH, ("data", "fsdp", "expert")),
  (ACT_LENGTH, "context"),
  (ACT_EMBED, None),
  (ACT_HEADS, "tensor"),
  (ACT_KV, None),
  (ACT_MLP, "tensor"),
  (ACT_VOCAB, "tensor"),
  (ACT_EXPERTS, "expert"),
  (ACT_EXPERT_BATCH, ("data", "fsdp")),
  (VOCAB, "tensor"),
  (EMBED, "fsdp"),
  (HEADS, "tensor"),
  (KV, None),
  (MLP, "tensor"),
  (LORA, None),
  (STAGES, "stage"),
  (LAYERS, "stage"),
  (EXPERTS, "expert"),
)


def param(
  module: nn.Module, name: str, init: Callable[..., jax.Array], axes: Sequence[str | None], shape: Sequence[int]
) -> Any:
  """`module`'s parameter `name` of `shape` (float32), made by `init(key, shape)` with the logical
  axis names `axes` (one per dimension) when the module initialises, and read as given when it
  applies. Every parameter of the model code is declared through here.

  `module.param` alone would check an applied parameter's shape by tracing `init` again under
  `jax.eval_shape`, at every apply of every parameter (tests/test_search.py spent 8 of its 71 s
  there). The shape is known here, so it is compared directly.

  Returns:
    The parameter, unboxed: a `jax.Array`, or a `layers.int8.QuantizedArray` when decoding with
    int8 kernels (its `shape` is the kernel's).

  Raises:
    flax.errors.ScopeParamShapeError: the applied parameter's shape is not `shape` (params of
      another model configuration).
    ValueError: `name` is already used in `module` (by a parameter or a submodule).
  """
  if module.has_variable("params", name):
    module.scope.reserve(name, "params")  # as `module.param` does: a name declared twice is an error
    value = nn.meta.unbox(module.get_variable("params", name))
    if np.shape(value) != tuple(shape):
      raise flax.errors.ScopeParamShapeError(name, module.scope.path_text, np.shape(value), tuple(shape))
    return value
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Constrains an activation's sharding by logical names, by the rules of the enclosing `bind`
  (model code; a no-op outside a mesh)."""
  return nn.with_logical_constraint(x, tuple(axes))


def split_axes(logical: str) -> tuple[str, ...]:
  """The mesh axes of size > 1 that logical axis `logical` splits over, by the mesh and rules of
  the enclosing `bind` (model code, e.g. context-parallel attention; () outside a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  axes = nn.logical_to_mesh_axes((logical,))[0]
  return tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if mesh.shape[a] > 1)


def resolve_mesh_shape(config: MeshConfig, num_devices: int) -> tuple[int, ...]:
  """The mesh's sizes in `MESH_AXES` order, -1 filled (`MeshConfig.resolve`).

  Raises:
    ConfigError: the sizes do not multiply to `num_devices`.
  """
  return tuple(config.resolve(num_devices).values())


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the mesh over `MESH_AXES` (all six; unused ones have size 1) with Auto axis
  types over `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(config, len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def parse_rules(overrides: str) -> Rules:
  """`LOGICAL_RULES` with `mesh.rules` overrides applied, e.g. "embed=none,act_batch=data+fsdp"
  (comma-separated `logical=mesh axes`; `+` joins mesh axes; `none` replicates).

  Raises:
    ConfigError: unknown logical or mesh axis, or malformed text (one line).
  """
  table = dict(LOGICAL_RULES)
  for item in filter(None, (part.strip() for part in overrides.split(","))):
    name, sep, value = (x.strip() for x in item.partition("="))
    if not sep:
      raise ConfigError(f"mesh.rules entry {item!r} is not logical=mesh_axes, e.g. embed=none or act_batch=data+fsdp")
    if name not in table:
      raise ConfigError(f"mesh.rules: unknown logical axis {name!r}; valid: {', '.join(table)}")
    axes = tuple(a.strip() for a in value.split("+")) if value.lower() != "none" else ()
    bad = [a for a in axes if a not in MESH_AXES]
    if bad or not value:
      raise ConfigError(
        f"mesh.rules: {name}={value!r} names no mesh axis of {MESH_AXES}; use one or more joined by + or none"
      )
    table[name] = None if not axes else axes[0] if len(axes) == 1 else axes
  return tuple(table.items())


def rules_for(config: MeshConfig) -> Rules:
  """The run's rules: `LOGICAL_RULES` with `config.rules` applied (`parse_rules`)."""
  return parse_rules(config.rules)


def logical_to_sharding(logical_specs: Any, mesh: Mesh, rules: Rules = LOGICAL_RULES) -> Any:
  """Maps a tree of logical PartitionSpecs to NamedShardings on `mesh` by `rules`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


@contextlib.contextmanager
def bind(mesh: Mesh, rules: Rules) -> Iterator[None]:
  """Makes `mesh` the current mesh and `rules` the ones `constrain` resolves by, for tracing a
  jitted function (its factory calls this with the mesh and rules it was built for)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def with_mesh(fn: Callable[..., Any], mesh: Mesh, rules: Rules) -> Callable[..., Any]:
  """`fn` (a jitted function) called inside `bind(mesh, rules)`; `.jitted` is `fn` itself
  (for `.lower`, also inside `bind`)."""

  def wrapped(*args):
    with bind(mesh, rules):
      return fn(*args)

  wrapped.jitted = fn
  return wrapped


def batch_sharding(mesh: Mesh, stacked: bool = False, rules: Rules = LOGICAL_RULES) -> NamedSharding:
  """Sharding of a `[batch, length]` input array: batch over the data-parallel axes, length over
  context. `stacked`: of a `[steps, batch, length]` stack of batches (the steps axis is not split)."""
  spec = nn.logical_to_mesh_axes((ACT_BATCH, ACT_LENGTH), rules)
  return NamedSharding(mesh, PartitionSpec(None, *spec) if stacked else spec)


def check_divisible(abstract: Any, shardings: Any) -> None:
  """Fails before compiling if any array dimension does not split evenly over its mesh axes
  (the general form of the mesh-size checks, covering `mesh.rules` overrides).

  Raises:
    ConfigError: naming the array, the dimension, its size and the mesh axes.
  """
  flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
  for (path, leaf), sharding in zip(flat, jax.tree.leaves(shardings)):
    for dim, (size, axes) in enumerate(zip(leaf.shape, sharding.spec)):
      names = (axes,) if isinstance(axes, str) else tuple(axes or ())
      ways = int(np.prod([sharding.mesh.shape[a] for a in names]))
      if size % ways:
        raise ConfigError(
          f"{jax.tree_util.keystr(path)} dimension {dim} of size {size} does not split over mesh axes "
          f"{'*'.join(names)} = {ways}; change the mesh sizes or mesh.rules"
        )


def data_parallel_size(mesh: Mesh, rules: Rules = LOGICAL_RULES) -> int:
  """How many ways the batch dimension is split by `rules` (data * fsdp * expert under the default rules)."""
  axes = batch_sharding(mesh, rules=rules).spec[0] or ()
  return int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))


def replicated(mesh: Mesh) -> NamedSharding:
  """A sharding that keeps a full copy of an array on every device of `mesh`."""
  return NamedSharding(mesh, PartitionSpec())
