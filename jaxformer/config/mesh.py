"""The mesh as data: named axes with sizes from config (no JAX import, so a config is
checked before JAX starts).

Six axes, outermost first; a size-1 axis costs nothing, so every mesh has all six and any
subset may be larger than one:

  data     batch only (pure data parallelism; the axis to put across slower links)
  stage    pipeline stages of the layer stack
  fsdp     batch and every parameter (ZeRO-3: params and optimizer state sharded)
  context  the sequence (length) axis of activations
  expert   the experts of a mixture-of-experts layer
  tensor   heads, d_ff and vocabulary (Megatron tensor parallelism; the innermost, fastest axis)
"""

from __future__ import annotations

import dataclasses
import math

from jaxformer.errors import ConfigError

MESH_AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh sizes, one per axis of `MESH_AXES`; one of them may be -1 (the remaining devices).

  Positional order is data, fsdp, tensor (as before the other axes existed), so
  `MeshConfig(2, 2, 2)` keeps meaning data=2, fsdp=2, tensor=2.
  """

  data: int = -1  # devices on the data axis (batch only); -1 = the rest
  fsdp: int = 1  # devices on the fsdp axis (batch and every parameter, ZeRO-3)
  tensor: int = 1  # devices on the tensor axis (heads, d_ff, vocabulary)
  stage: int = 1  # devices on the stage axis (pipeline stages)
  context: int = 1  # devices on the context axis (the length of activations)
  expert: int = 1  # devices on the expert axis (mixture-of-experts experts)
  rules: str = ""  # overrides of sharding.LOGICAL_RULES, e.g. "embed=none,act_batch=data"

  @property
  def sizes(self) -> dict[str, int]:
    """Axis name -> configured size (-1 not yet filled), in mesh order."""
    return {name: getattr(self, name) for name in MESH_AXES}

  def validate(self) -> None:
    """Raises ConfigError (one line) for more than one -1 axis or a size that is neither positive nor -1."""
    if list(self.sizes.values()).count(-1) > 1:
      raise ConfigError(f"at most one of {', '.join('mesh.' + a for a in MESH_AXES)} may be -1")
    for name, size in self.sizes.items():
      if size == 0 or size < -1:
        raise ConfigError(f"mesh.{name} must be a positive size or -1, got {size}")

  def resolve(self, num_devices: int) -> dict[str, int]:
    """Axis name -> size with the -1 entry filled so that the sizes multiply to `num_devices`.

    Raises:
      ConfigError: the sizes cannot fill `num_devices` (one line naming the sizes and a fix).
    """
    sizes = self.sizes
    free = [name for name, size in sizes.items() if size == -1]
    known = math.prod(size for size in sizes.values() if size != -1)
    given = {name: size for name, size in sizes.items() if size != 1}
    if free:
      if num_devices % known:
        raise ConfigError(
          f"mesh sizes {given} cannot fill {num_devices} devices: {known} does not divide {num_devices}"
        )
      sizes[free[0]] = num_devices // known
    product = math.prod(sizes.values())
    if product != num_devices:
      used = "*".join(f"{n}" for n, s in sizes.items() if s != 1) or "data"
      raise ConfigError(
        f"mesh {used} = {'*'.join(str(s) for s in sizes.values() if s != 1) or 1} = {product} but there are "
        f"{num_devices} devices; e.g. use mesh.data={num_devices} (other axes 1) or mesh.data=-1 "
        "(or runtime.num_cpu_devices to simulate more CPU devices)"
      )
    return sizes
