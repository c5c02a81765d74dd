"""Process start-up: simulated CPU devices, reproducible CPU numerics, and the mesh
(multi-host start-up: runtime/distributed.py)."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.config import PLATFORMS, Config, ConfigError, RuntimeConfig
from jaxformer.models.pipeline import check_pipeline
from jaxformer.runtime.host_memory import limit_malloc_arenas
from jaxformer.tasks import get_task

# XLA:CPU results are bitwise stable run to run on one machine, under any load, but change
# with the machine: with the size of the intra-op thread pool (one thread per usable CPU;
# Eigen splits the contraction of the weight-gradient matmuls, XNNPACK/YNNPACK the
# reductions over the batch, by it: 1 and 2 CPUs give other params after 3 steps), pinned by
# `NPROC` below; and with the instruction set (AVX-512 and AVX2 code give other losses;
# XNNPACK/YNNPACK pick kernels by CPUID; math approximations), pinned by these flags. Not
# pinned: Eigen sizes its matmul blocks by the CPU's caches, so CPUs with other caches may differ.
DETERMINISTIC_XLA_FLAGS = (
  "--xla_cpu_max_isa=AVX2",
  "--xla_cpu_enable_platform_dependent_math=false",
  "--xla_cpu_use_xnnpack=false",
  "--xla_cpu_experimental_ynn_fusion_type=",
)
# libtpu where no TPU chip is attached (installed to compile for TPU topologies, the `aot` extra):
# say this host is a whole one-host slice, or loading it prints warnings about the missing TPU
# metadata on every start, and let several processes load it (it otherwise takes a lock meant for
# processes that use the chips).
_LIBTPU_HOST_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def quiet_libtpu() -> None:
  """Where they are unset, sets libtpu's host variables for a process that does not use TPU chips
  (`_LIBTPU_HOST_ENV`): no warnings on a machine without them, no lock against other compiling
  processes. Acts only before anything loads libtpu (it reads them once)."""
  for key, value in _LIBTPU_HOST_ENV.items():
    os.environ.setdefault(key, value)


def _tpu_chips_attached() -> bool:
  """Whether PCI lists a TPU chip (JAX's own probe; assumed so if this JAX lacks it)."""
  try:
    from jax._src import hardware_utils

    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
  except (ImportError, AttributeError, OSError):
    return True


def pin_cpu_numerics(cpu_threads: int) -> None:
  """Makes XLA:CPU results depend on nothing but the program and `cpu_threads`: a thread pool
  of that size (XLA reads `NPROC` when its CPU backend starts) and `DETERMINISTIC_XLA_FLAGS`
  added to `XLA_FLAGS` (a flag the user set there is kept). Acts only if the backend has not
  started (the CLI calls it first); child processes inherit it."""
  os.environ["NPROC"] = str(cpu_threads)
  flags = os.environ.get("XLA_FLAGS", "")
  pinned = DETERMINISTIC_XLA_FLAGS if platform.machine().lower() in ("x86_64", "amd64") else DETERMINISTIC_XLA_FLAGS[1:]
  added = [f for f in pinned if f.split("=")[0] not in flags]  # AVX2 names an x86 instruction set only
  os.environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()


def init_runtime(runtime: RuntimeConfig) -> None:
  """Applies `runtime.deterministic` (`pin_cpu_numerics`), `runtime.platform` and
  `runtime.num_cpu_devices`; must run before any JAX computation, since the flags, thread
  pool and device count are fixed when the backend starts.

  Raises:
    ConfigError: the machine has no devices of `runtime.platform` (naming the platforms it
      has), or the CPU device count cannot be applied.
  """
  limit_malloc_arenas()  # before the backend's thread pools start: see host_memory.py
  if not _tpu_chips_attached():
    quiet_libtpu()
  if runtime.deterministic:
    pin_cpu_numerics(runtime.cpu_threads)
  if runtime.platform:
    jax.config.update("jax_platforms", runtime.platform)
  if runtime.num_cpu_devices:
    try:
      jax.config.update("jax_num_cpu_devices", runtime.num_cpu_devices)
    except RuntimeError:  # backend already started (e.g. in-process use): accept a matching count
      if len(jax.devices("cpu")) != runtime.num_cpu_devices:
        raise ConfigError(
          f"runtime.num_cpu_devices={runtime.num_cpu_devices} cannot be applied: JAX already started "
          f"with {len(jax.devices('cpu'))} CPU devices; set it before any JAX computation"
        ) from None
  if runtime.platform:
    _check_platform(runtime.platform)


def _has_platform(platform: str) -> bool:
  try:
    return bool(jax.devices(platform))
  except RuntimeError:
    return False


def _check_platform(platform: str) -> None:
  """Starts the backend of `platform` (the one `jax_platforms` allows)."""
  if _has_platform(platform):
    return
  jax.config.update("jax_platforms", "")  # let JAX start every backend it can, to list them
  present = [p for p in PLATFORMS if _has_platform(p)]
  raise ConfigError(
    f"runtime.platform={platform}: this machine has no {platform} devices, only "
    f"{' and '.join(present)}; set runtime.platform to one of those or leave it empty (JAX's default)"
  )


def build_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The run's mesh over `devices` (default: all global devices); checks, once and before anything is compiled,
  that the model, the sequence length and the batch divide over it (`check_model_fits_mesh`,
  `check_experts_fit_mesh`).

  Raises:
    ConfigError: the mesh does not fit the devices, a sharded model dimension or the length
      does not split over its axis, or the global batch does not split evenly over the
      data-parallel axes, or the pipeline stages or microbatches (`check_pipeline`) (one line each).
  """
  mesh = sh.make_mesh(config.mesh, devices)
  check_model_fits_mesh(config, mesh.shape["fsdp"], mesh.shape["tensor"], mesh.shape["context"])
  check_experts_fit_mesh(config, mesh.shape["expert"])
  dp = sh.data_parallel_size(mesh, sh.rules_for(config.mesh))
  if config.train.batch_size % dp:
    raise ConfigError(
      f"train.batch_size={config.train.batch_size} is not divisible by the data-parallel size "
      f"{dp} (mesh.data*mesh.fsdp*mesh.expert); use train.batch_size={max(dp, config.train.batch_size // dp * dp)}"
    )
  check_pipeline(config, mesh.shape["stage"], dp)
  return mesh


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def check_model_fits_mesh(config: Config, fsdp: int, tensor: int, context: int = 1) -> None:
  """Fails before compiling if a sharded dimension does not split evenly.

  The tensor axis splits num_heads, the key/value heads, d_ff and vocab_size; the fsdp
  axis splits d_model; the context axis splits the sequence length (data.max_length and,
  for translation, every length bucket), with no attention dropout (context-parallel attention).

  Raises:
    ConfigError: naming the axis, the sizes and the valid choices.
  """
  m = config.model
  for name, size in (
    ("model.num_heads", m.num_heads),
    ("model.num_kv_heads", m.kv_heads),
    ("model.d_ff", m.d_ff),
    ("model.vocab_size", m.vocab_size),
  ):
    if size % tensor:
      valid = [d for d in _divisors(m.kv_heads) if m.d_ff % d == 0 and m.vocab_size % d == 0]
      raise ConfigError(f"mesh.tensor={tensor} does not divide {name}={size}; use mesh.tensor in {valid}")
  if m.d_model % fsdp:
    raise ConfigError(
      f"mesh.fsdp={fsdp} does not divide model.d_model={m.d_model}; "
      f"use mesh.fsdp in {[d for d in _divisors(m.d_model) if d <= 64]}"
    )
  if context > 1 and m.attention_dropout_rate > 0:
    raise ConfigError(
      f"model.attention_dropout_rate={m.attention_dropout_rate} does not run with context "
      f"parallelism (mesh.context={context}); set model.attention_dropout_rate=0 or mesh.context=1"
    )
  lengths = get_task(config).batch_lengths()
  if any(length % context for length in lengths):
    raise ConfigError(
      f"mesh.context={context} does not divide the sequence lengths {sorted(set(lengths))} "
      f"(data.max_length, data.buckets); use mesh.context in "
      f"{[d for d in _divisors(config.data.max_length) if all(n % d == 0 for n in lengths)]}"
    )


def check_experts_fit_mesh(config: Config, expert: int) -> None:
  """Fails before compiling if the `expert` axis does not split `model.num_experts` evenly
  (without experts the axis only splits the batch, like `data`).

  Raises:
    ConfigError: naming both sizes and the valid choices.
  """
  experts = config.model.num_experts
  if experts and experts % expert:
    raise ConfigError(
      f"mesh.expert={expert} does not divide model.num_experts={experts}; use mesh.expert in {_divisors(experts)}"
    )
