"""Start-up of multi-process (multi-host) JAX: find the cluster layout, join it.

One process runs per host (or per simulated host on one machine, see
``scripts/launch_local_multihost.sh``). Every process calls
:func:`initialize_from_args` before any other JAX use; afterwards
``jax.devices()`` lists the devices of all processes and ``jax.process_index()``
/ ``jax.process_count()`` describe this process.

Where the layout comes from, first match wins:

1. flags ``--coordinator HOST:PORT --num-processes P --process-id I`` (all three);
2. environment ``JAXFORMER_COORDINATOR``, ``JAXFORMER_NUM_PROCESSES``,
   ``JAXFORMER_PROCESS_ID`` (all three);
3. SLURM with ``SLURM_NTASKS > 1``: we leave the layout to JAX's own SLURM
   detection (``jax.distributed.initialize()`` without arguments): processes and
   process id from ``SLURM_NTASKS``/``SLURM_PROCID``, coordinator the first node of
   ``SLURM_STEP_NODELIST`` on a port derived from ``SLURM_JOB_ID``, and on GPUs one
   device per task (``SLURM_LOCALID``), i.e. JAX's one-task-per-GPU convention.
   ``JAXFORMER_COORDINATOR=HOST:PORT`` overrides the coordinator only.
4. otherwise a single process: nothing is initialised.

On CPU, cross-process collectives use Gloo (``jax_cpu_collectives_implementation``;
it is already JAX's default in this version, we set it explicitly so that an older
default of "none" cannot silently break multi-process CPU runs).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")

ENV_COORDINATOR = "JAXFORMER_COORDINATOR"
ENV_NUM_PROCESSES = "JAXFORMER_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXFORMER_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """How to join the cluster. ``coordinator`` is None only for ``source="slurm"``
  (JAX then derives it from the SLURM node list)."""

  coordinator: str | None
  num_processes: int
  process_id: int
  source: str  # "flags", "env" or "slurm"


def _check_coordinator(address: str, what: str) -> str:
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{what}={address!r} is not HOST:PORT, e.g. 127.0.0.1:12345")
  return address


def _int(value: str | int, what: str) -> int:
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ValueError(f"{what}={value!r} is not an integer") from None


def _spec(coordinator, num_processes, process_id, source: str, names: tuple[str, str, str]) -> ClusterSpec:
  n, i = _int(num_processes, names[1]), _int(process_id, names[2])
  if n < 1:
    raise ValueError(f"{names[1]}={n} must be >= 1")
  if not 0 <= i < n:
    raise ValueError(f"{names[2]}={i} must be in [0, {n}) ({names[1]}={n})")
  if coordinator is not None:
    coordinator = _check_coordinator(coordinator, names[0])
  return ClusterSpec(coordinator, n, i, source)


def resolve(
  coordinator: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  environ: Mapping[str, str] | None = None,
) -> ClusterSpec | None:
  """The cluster layout from flags, else the environment; None for a single process.

  Raises:
    ValueError: a partial or invalid set of flags / variables (one line, naming them).
  """
  env = os.environ if environ is None else environ
  flags = (coordinator, num_processes, process_id)
  if any(v is not None for v in flags):
    if any(v is None for v in flags):
      raise ValueError("--coordinator, --num-processes and --process-id must be given together")
    spec = _spec(*flags, "flags", ("--coordinator", "--num-processes", "--process-id"))
    return None if spec.num_processes == 1 else spec
  names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
  if env.get(ENV_NUM_PROCESSES) is not None or env.get(ENV_PROCESS_ID) is not None:
    missing = [k for k in names if env.get(k) is None]
    if missing:
      raise ValueError(f"{', '.join(missing)} must be set together with {', '.join(set(names) - set(missing))}")
    spec = _spec(*(env[k] for k in names), "env", names)
    return None if spec.num_processes == 1 else spec
  if env.get("SLURM_NTASKS") is not None and env.get("SLURM_PROCID") is not None:
    n = _int(env["SLURM_NTASKS"], "SLURM_NTASKS")
    if n > 1:
      return _spec(
        env.get(ENV_COORDINATOR), n, env["SLURM_PROCID"], "slurm", (ENV_COORDINATOR, "SLURM_NTASKS", "SLURM_PROCID")
      )
  return None


_initialized: ClusterSpec | None = None


def initialize(spec: ClusterSpec | None, timeout_s: int = 300) -> None:
  """Joins the cluster described by ``spec`` (no-op for None). Must run before any
  JAX computation or device query. ``timeout_s`` bounds the wait for all processes."""
  global _initialized
  if spec is None or _initialized == spec:
    return
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs: dict = dict(initialization_timeout=timeout_s)
  if spec.coordinator is not None:
    kwargs["coordinator_address"] = spec.coordinator
  if spec.source != "slurm":  # layout fully given: no auto-detection (and no device restriction)
    kwargs.update(num_processes=spec.num_processes, process_id=spec.process_id, cluster_detection_method="deactivate")
  jax.distributed.initialize(**kwargs)
  _initialized = spec


def initialize_from_args(args) -> ClusterSpec | None:
  """:func:`resolve` + :func:`initialize` for parsed CLI args (attributes
  ``coordinator``, ``num_processes``, ``process_id``; missing ones count as unset)."""
  spec = resolve(
    getattr(args, "coordinator", None), getattr(args, "num_processes", None), getattr(args, "process_id", None)
  )
  initialize(spec)
  return spec


def barrier(name: str, timeout_s: int = 3600) -> None:
  """Waits until every process reaches ``barrier(name)`` (no-op for one process).

  Uses the coordination service's barrier (no device computation, so no 30 s Gloo
  start-up deadline): process 0 may spend minutes building the dataset meanwhile.
  """
  import jax

  if jax.process_count() == 1:
    return
  from jax._src import distributed as jax_distributed  # the client of jax.distributed.initialize

  client = jax_distributed.global_state.client
  if client is None:  # not started through jax.distributed (e.g. TPU runtime): device barrier
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
  else:
    client.wait_at_barrier(f"jaxformer:{name}", timeout_s * 1000)


def main_process_first(fn: Callable[[], T], name: str = "main_process_first") -> T:
  """Runs ``fn`` on process 0, waits for it on all processes, then runs ``fn`` on the
  others. Used for idempotent preparation of shared files (dataset, tokenizer cache):
  process 0 builds them, the others then just read them. A single process just calls ``fn``.

  If ``fn`` raises on process 0 the others keep waiting until the barrier times out;
  launchers (``scripts/launch_local_multihost.sh``, SLURM) stop them when one process fails.
  """
  import jax

  if jax.process_count() == 1:
    return fn()
  result = fn() if jax.process_index() == 0 else None
  barrier(name)
  if jax.process_index() != 0:
    result = fn()
  return result


def max_over_processes(value: int) -> int:
  """The largest of every process's `value`: a collective that every process calls at the
  same point of its program (the step loop asks it once per call for the preemption signal
  any process took, so all stop at the same step). One process: `value` itself."""
  import jax

  if jax.process_count() == 1:
    return value
  import numpy as np
  from jax.experimental import multihost_utils

  return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def any_process(flag: bool) -> bool:
  """Whether `flag` is true on any process (a collective, as `max_over_processes`)."""
  return bool(max_over_processes(int(flag)))
