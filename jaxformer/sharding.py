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
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
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


def logical_to_sharding(logical_specs: Any, mesh: Mesh) -> Any:
  """Maps a tree of logical PartitionSpecs to NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, LOGICAL_RULES)


def axis_rules():
  """Context manager that makes `constrain` use `LOGICAL_RULES`."""
  return nn.logical_axis_rules(LOGICAL_RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of a `[batch, length]` input array: batch over the data-parallel axes."""
  spec = nn.logical_to_mesh_axes((ACT_BATCH, ACT_LENGTH), LOGICAL_RULES)
  return NamedSharding(mesh, spec)


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways the batch dimension is split (data * fsdp)."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
