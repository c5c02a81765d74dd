"""Device mesh and the one table that maps logical axis names to mesh axes.

Every parameter is created with logical axis names (`param_with_axes`) and activations
are constrained by logical name at block boundaries (`constrain`). `LOGICAL_RULES` turns
those names into mesh axes, so changing the parallelism never touches model code.
The mesh uses `AxisType.Auto`: jit propagates shardings from the annotations
(the "automatic" mode), rather than JAX's newer default of explicit sharding types.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxformer.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")

# Weight axes.
VOCAB = "vocab"
EMBED = "embed"
HEADS = "heads"
KV = "kv"          # head_dim
MLP = "mlp"
LAYERS = "layers"  # leading axis of params stacked by nn.scan (model.scan_layers)
# Activation axes.
ACT_BATCH = "act_batch"
ACT_LENGTH = "act_length"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_KV = "act_kv"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"

# Logical axis -> mesh axis (or axes, or None = replicated). Batch over data+fsdp;
# weights fully sharded over fsdp along embed (ZeRO-3); heads/d_ff/vocab over tensor.
Rules = tuple[tuple[str, Any], ...]
LOGICAL_RULES: Rules = (
    (ACT_BATCH, ("data", "fsdp")),
    (ACT_LENGTH, None),
    (ACT_EMBED, None),
    (ACT_HEADS, "tensor"),
    (ACT_KV, None),
    (ACT_MLP, "tensor"),
    (ACT_VOCAB, "tensor"),
    (VOCAB, "tensor"),
    (EMBED, "fsdp"),
    (HEADS, "tensor"),
    (KV, None),
    (MLP, "tensor"),
    (LAYERS, None),
)


def param_with_axes(init: Callable[..., jax.Array], axes: Sequence[str]) -> Callable[..., Any]:
  """Wraps a Flax initializer so the created parameter carries logical axis names."""
  return nn.with_logical_partitioning(init, tuple(axes))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Constrains an activation's sharding by logical names (no-op outside a mesh)."""
  return nn.with_logical_constraint(x, tuple(axes))


def resolve_mesh_shape(config: MeshConfig, num_devices: int) -> tuple[int, int, int]:
  """Fills a -1 entry and checks that data * fsdp * tensor equals the device count.

  Raises:
    ConfigError: the sizes do not multiply to `num_devices`.
  """
  sizes = [config.data, config.fsdp, config.tensor]
  if -1 in sizes:
    known = int(np.prod([s for s in sizes if s != -1]))
    if num_devices % known:
      raise ConfigError(
          f"mesh sizes {dict(zip(MESH_AXES, sizes))} cannot fill {num_devices} devices: "
          f"{known} does not divide {num_devices}")
    sizes[sizes.index(-1)] = num_devices // known
  if int(np.prod(sizes)) != num_devices:
    raise ConfigError(
        f"mesh data*fsdp*tensor = {'*'.join(map(str, sizes))} = {int(np.prod(sizes))} but there are "
        f"{num_devices} devices; e.g. use mesh.data={num_devices} mesh.fsdp=1 mesh.tensor=1 "
        "(or runtime.num_cpu_devices to simulate more CPU devices)")
  return tuple(sizes)  # type: ignore[return-value]


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a `[data, fsdp, tensor]` mesh with Auto axis types over `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(config, len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


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
      raise ConfigError(f"mesh.rules: {name}={value!r} names no mesh axis of {MESH_AXES}; use one or more joined by + or none")
    table[name] = None if not axes else axes[0] if len(axes) == 1 else axes
  return tuple(table.items())


def current_rules() -> Rules:
  """The rules of the enclosing `axis_rules(...)` context, or `LOGICAL_RULES` outside one."""
  return tuple(nn.get_logical_axis_rules()) or LOGICAL_RULES


def logical_to_sharding(logical_specs: Any, mesh: Mesh) -> Any:
  """Maps a tree of logical PartitionSpecs to NamedShardings on `mesh` by `current_rules()`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, current_rules())


def axis_rules(rules: Rules | None = None):
  """Context manager that makes `constrain` and the functions here use `rules`
  (default: `current_rules()`); a run enters it once with its `mesh.rules`."""
  return nn.logical_axis_rules(current_rules() if rules is None else rules)


def batch_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
  """Sharding of a `[batch, length]` input array: batch over the data-parallel axes.
  `stacked`: of a `[steps, batch, length]` stack of batches (the steps axis is not split)."""
  spec = nn.logical_to_mesh_axes((ACT_BATCH, ACT_LENGTH), current_rules())
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
            f"{'*'.join(names)} = {ways}; change the mesh sizes or mesh.rules")


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways the batch dimension is split (data * fsdp under the default rules)."""
  axes = batch_sharding(mesh).spec[0] or ()
  return int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
