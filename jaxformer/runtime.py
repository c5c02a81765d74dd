"""Process start-up: simulated CPU devices, multi-host initialisation, the mesh."""

from __future__ import annotations

import os

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
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


def build_mesh(config: Config) -> Mesh:
  """The run's mesh over all (global) devices; checks divisibility of the model and batch.

  Raises:
    ConfigError: the mesh does not fit the devices, or the global batch does not split
      evenly over the data-parallel axes.
  """
  mesh = sh.make_mesh(config.mesh)
  dp = sh.data_parallel_size(mesh)
  if config.train.batch_size % dp:
    raise ConfigError(
        f"train.batch_size={config.train.batch_size} is not divisible by the data-parallel size "
        f"{dp} (mesh.data*mesh.fsdp); use train.batch_size={max(dp, config.train.batch_size // dp * dp)}")
  return mesh
