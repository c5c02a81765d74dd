"""`jaxformer compile`: ahead-of-time compilation of the train step for a large mesh, to learn
whether a model fits per device before renting the hardware.

The train step (the one `jaxformer train` runs, with the config's remat, scan, precision,
gradient accumulation and mesh) is lowered and compiled for abstract inputs: the train state
comes from `jax.eval_shape` of the initialiser and the batch from its shape, each a
`jax.ShapeDtypeStruct` carrying its `NamedSharding`, so no parameter is ever materialised.
The devices are N simulated CPU devices (`runtime.num_cpu_devices`, set before JAX starts
its backend), or, where libtpu is installed, a TPU topology from `jax.experimental.topologies`
(`--topology v5e:16x16`): the same program compiled by the TPU compiler for devices this
machine does not have.

Memory comes from XLA's own analysis of the compiled per-device program
(`compiled.memory_analysis()`): arguments (the state's shard and the batch's), outputs, the
part of the outputs that reuses donated argument buffers (alias), and temporaries (activations
kept for the backward pass, gradients, collectives' buffers). The per-device total is
arguments + outputs - alias + temporaries: what the device holds at the step's peak, bar
fragmentation and the runtime's own reserve. Figures on CPU devices are those of XLA:CPU's
buffer assignment; a TPU/GPU compiler fuses and schedules differently, so treat them as
estimates (the state's share is exact; the topology path gives the TPU compiler's own figures).
"""

from __future__ import annotations

import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.config import Config, ConfigError
from jaxformer.runtime import build_mesh
from jaxformer.tasks import get_task
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import state_shardings
from jaxformer.train.step import make_train_call

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(text: str) -> int:
  """Bytes of a size such as "80GiB", "16GB", "512 MiB", "1.5TB" or "1000000" (case-insensitive;
  GB = 10^9, GiB = 2^30).

  Raises:
    ConfigError: not a positive number with a known unit (one line).
  """
  match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
  unit = match.group(2).upper() if match else ""
  if not match or unit not in _UNITS or float(match.group(1)) <= 0:
    raise ConfigError(f"--hbm {text!r} is not a size; write e.g. 80GiB, 16GB or 512MiB")
  return int(float(match.group(1)) * _UNITS[unit])


def topology_devices(name: str) -> list[Any]:
  """The devices of TPU topology `name` (e.g. "v5e:16x16"), from `jax.experimental.topologies`.

  Raises:
    ConfigError: libtpu is not installed or does not know `name` (one line).
  """
  from jax.experimental import topologies  # here: the optional path
  try:
    return list(topologies.get_topology_desc(name, "tpu").devices)
  except Exception as e:  # noqa: BLE001  (libtpu missing, or an unknown name: one line either way)
    raise ConfigError(f"--topology {name}: no TPU compiler for it here ({str(e).splitlines()[0][:160]}); "
                      "install libtpu (pip install 'jax[tpu]') or use --devices N for simulated CPU devices") from None


def abstract_batch(config: Config, mesh, rules: sh.Rules) -> dict[str, jax.ShapeDtypeStruct]:
  """The train step's batch as int32 ShapeDtypeStructs with their shardings: `inputs` and
  `targets` `[train.batch_size, data.max_length]` (stacked `[train.steps_per_call, ...]` when
  > 1), plus packing's segment ids and positions when `data.packing`."""
  steps = config.train.steps_per_call
  shape = ((steps,) if steps > 1 else ()) + (config.train.batch_size, config.data.max_length)
  sharding = sh.batch_sharding(mesh, stacked=steps > 1, rules=rules)
  keys = ["inputs", "targets"]
  if config.data.packing:
    keys += ["inputs_segment_ids", "inputs_positions"]
    keys += ["targets_segment_ids", "targets_positions"] if config.model.kind == "encoder_decoder" else []
  return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in keys}


def memory_parts(compiled) -> dict[str, int]:
  """XLA's per-device memory analysis of a compiled program, bytes: `argument_bytes`,
  `output_bytes`, `alias_bytes` (outputs reusing donated arguments), `temp_bytes`, and their
  `total_bytes` = arguments + outputs - alias + temporaries (donated state counted once).
  Empty where the backend gives no analysis."""
  memory = compiled.memory_analysis()
  if memory is None:
    return {}
  parts = {"argument_bytes": memory.argument_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
           "alias_bytes": memory.alias_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes}
  parts["total_bytes"] = parts["argument_bytes"] + parts["output_bytes"] - parts["alias_bytes"] + parts["temp_bytes"]
  return parts


def compile_train_step(config: Config, devices: list[Any] | None = None,
                       hbm_bytes: int | None = None) -> dict[str, Any]:
  """Lowers and compiles `config`'s train step on a mesh over `devices` (default: all JAX
  devices) without running it; nothing is allocated but the compiled program.

  Returns a JSON-safe dict: `devices`, `platform`, `mesh` (axis -> size), `params` (count),
  `batch_size`, `length`, bytes per device `argument_bytes`, `output_bytes`, `alias_bytes`,
  `temp_bytes`, `generated_code_bytes`, `total_bytes_per_device` (= argument + output - alias
  + temp), `compile_seconds` (wall time to trace, lower and XLA-compile; `lower_seconds` of
  it the first two), `compile_cpu_seconds` (this process's CPU time for the same, a steadier
  figure on a shared machine) and, with `hbm_bytes`, `hbm_bytes` and `fits` (total <= hbm).

  Raises:
    ConfigError: the mesh does not fit the devices or a dimension does not divide over it
      (checked before compiling, one line).
  """
  mesh = build_mesh(config, devices)
  rules = sh.rules_for(config.mesh)
  model = get_task(config).make_model()
  tx = make_optimizer(config.optim, config.model.d_model)
  abstract, shardings = state_shardings(model, tx, mesh, rules)   # jax.eval_shape: nothing allocated
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  key = jax.eval_shape(lambda: jax.random.key(0))
  rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sh.replicated(mesh))
  step = make_train_call(model, tx, config, mesh, shardings)
  start, cpu_start = time.perf_counter(), time.process_time()
  with sh.bind(mesh, rules):
    lowered = step.jitted.lower(state, abstract_batch(config, mesh, rules), rng)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  done, cpu_done = time.perf_counter(), time.process_time()
  parts = memory_parts(compiled)
  total = parts.pop("total_bytes")
  result = {
      "config": config.name, "devices": mesh.devices.size, "platform": mesh.devices.flat[0].platform,
      "mesh": dict(mesh.shape), "params": sum(x.size for x in jax.tree.leaves(abstract.params)),
      "batch_size": config.train.batch_size, "length": config.data.max_length,
      "remat": config.model.remat, "scan_layers": config.model.scan_layers,
      "compute_dtype": config.model.dtype, **{k: int(v) for k, v in parts.items()},
      "generated_code_bytes": int(compiled.memory_analysis().generated_code_size_in_bytes),
      "total_bytes_per_device": int(total),
      "lower_seconds": round(lowered_at - start, 2), "compile_seconds": round(done - start, 2),
      "compile_cpu_seconds": round(cpu_done - cpu_start, 2),
  }
  if hbm_bytes is not None:
    result.update(hbm_bytes=hbm_bytes, fits=total <= hbm_bytes)
  return result


def _gib(n: int) -> str:
  return f"{n / 2 ** 30:,.2f} GiB" if abs(n) >= 2 ** 30 else f"{n / 2 ** 20:,.2f} MiB"


def format_report(result: dict[str, Any]) -> str:
  """A short human-readable summary of a `compile_train_step` result."""
  mesh = " ".join(f"{k}={v}" for k, v in result["mesh"].items() if v > 1) or "single device"
  head = (f"{result['config']}: {result['params']:,} parameters, batch {result['batch_size']} x {result['length']} "
          f"tokens, on {result['devices']} {result['platform']} devices ({mesh}); compiled in "
          f"{result['compile_seconds']:.1f} s")
  lines = [head, "per device:"]
  for key, label in (("argument", "arguments"), ("output", "outputs"), ("alias", "- aliased (donated)"),
                     ("temp", "temporaries")):
    lines.append(f"  {label:<20} {_gib(result[key + '_bytes']):>14}")
  lines.append(f"  {'total':<20} {_gib(result['total_bytes_per_device']):>14}")
  if "fits" in result:
    verdict = "fits" if result["fits"] else "does NOT fit"
    lines.append(f"{verdict} in {_gib(result['hbm_bytes'])} of device memory")
  return "\n".join(lines)
