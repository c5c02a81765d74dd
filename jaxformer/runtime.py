"""Process start-up: simulated CPU devices and the mesh (multi-host start-up: distributed.py)."""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.config import Config, ConfigError, RuntimeConfig


def init_runtime(runtime: RuntimeConfig) -> None:
  """Applies `runtime.platform` and `runtime.num_cpu_devices`; must run before any JAX
  computation, since the device count is fixed when the backend starts."""
  if runtime.platform:
    jax.config.update("jax_platforms", runtime.platform)
  if runtime.num_cpu_devices:
    try:
      jax.config.update("jax_num_cpu_devices", runtime.num_cpu_devices)
    except RuntimeError:  # backend already started (e.g. in-process use): accept a matching count
      if len(jax.devices("cpu")) != runtime.num_cpu_devices:
        raise ConfigError(
            f"runtime.num_cpu_devices={runtime.num_cpu_devices} cannot be applied: JAX already started "
            f"with {len(jax.devices('cpu'))} CPU devices; set it before any JAX computation") from None


def build_mesh(config: Config) -> Mesh:
  """The run's mesh over all (global) devices; checks divisibility of the model and batch.

  Raises:
    ConfigError: the mesh does not fit the devices, or the global batch does not split
      evenly over the data-parallel axes.
  """
  mesh = sh.make_mesh(config.mesh)
  check_model_fits_mesh(config, mesh.shape["fsdp"], mesh.shape["tensor"])
  dp = sh.data_parallel_size(mesh)
  if config.train.batch_size % dp:
    raise ConfigError(
        f"train.batch_size={config.train.batch_size} is not divisible by the data-parallel size "
        f"{dp} (mesh.data*mesh.fsdp); use train.batch_size={max(dp, config.train.batch_size // dp * dp)}")
  return mesh


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def check_model_fits_mesh(config: Config, fsdp: int, tensor: int) -> None:
  """Fails before compiling if a sharded dimension does not split evenly.

  The tensor axis splits num_heads, the key/value heads, d_ff and vocab_size; the fsdp
  axis splits d_model.

  Raises:
    ConfigError: naming the axis, the sizes and the valid choices.
  """
  m = config.model
  for name, size in (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.kv_heads),
                     ("model.d_ff", m.d_ff), ("model.vocab_size", m.vocab_size)):
    if size % tensor:
      valid = [d for d in _divisors(m.kv_heads) if m.d_ff % d == 0 and m.vocab_size % d == 0]
      raise ConfigError(f"mesh.tensor={tensor} does not divide {name}={size}; use mesh.tensor in {valid}")
  if m.d_model % fsdp:
    raise ConfigError(f"mesh.fsdp={fsdp} does not divide model.d_model={m.d_model}; "
                      f"use mesh.fsdp in {[d for d in _divisors(m.d_model) if d <= 64]}")
