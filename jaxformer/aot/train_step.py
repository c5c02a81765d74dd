"""`jaxformer compile`: ahead-of-time compilation of the train step (or, with `--decode`, the
decode step and prefill) for a large mesh, to learn whether a model fits per device before
renting the hardware.

The train step (the one `jaxformer train` runs, with the config's remat, scan, precision,
gradient accumulation and mesh) is lowered and compiled for abstract inputs: the train state
comes from `jax.eval_shape` of the initialiser and the batch from its shape, each a
`jax.ShapeDtypeStruct` carrying its `NamedSharding`, so no parameter is ever materialised.
`aot.decode` does the same for decoding. The devices are N simulated CPU devices
(`runtime.num_cpu_devices`, set before JAX starts its backend), or, with libtpu installed (the
`aot` extra), a TPU topology from `jax.experimental.topologies` (`--topology v5e:16x16`): the
same program compiled by the TPU compiler for devices this machine does not have.

Memory comes from XLA's own analysis of the compiled per-device program
(`compiled.memory_analysis()`): arguments (the state's shard and the batch's), outputs, the
part of the outputs that reuses donated argument buffers (alias), and temporaries (activations
kept for the backward pass, gradients, collectives' buffers). The per-device total is
arguments + outputs - alias + temporaries: what the device holds at the step's peak, bar
fragmentation and the runtime's own reserve. Figures on CPU devices are those of XLA:CPU's
buffer assignment; a TPU/GPU compiler fuses and schedules differently, so treat them as
estimates (the state's share is exact; the topology path gives the TPU compiler's own figures).

The TPU compiler refuses a program that does not fit its HBM (RESOURCE_EXHAUSTED): that is an
answer, not a failure, so the result then says `fits: false` with the bytes the compiler needed
and had (`out_of_memory`). Any other compiler error becomes one `CompileError` line.
"""

from __future__ import annotations

import importlib.util
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.aot import gpu as aot_gpu
from jaxformer.config import Config, ConfigError
from jaxformer.errors import CompileError
from jaxformer.runtime.startup import build_mesh, quiet_libtpu
from jaxformer.tasks import get_task
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import state_shardings
from jaxformer.train.step import make_train_call

_UNITS = {
  "": 1,
  "B": 1,
  "KB": 10**3,
  "MB": 10**6,
  "GB": 10**9,
  "TB": 10**12,
  "KIB": 2**10,
  "MIB": 2**20,
  "GIB": 2**30,
  "TIB": 2**40,
}
# The TPU compiler's two out-of-memory messages (sizes such as "27.21G", powers of 1024).
_SIZE = r"([0-9.]+)\s*([KMGTP]?)i?B?"
_OOM_PATTERNS = (
  re.compile(rf"memory required for (?P<what>HLO temporaries) \({_SIZE}\) exceeds available HBM \({_SIZE}\)"),
  re.compile(rf"memory space hbm\. Used (?P<what>){_SIZE} of {_SIZE} hbm"),
)


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
  """The devices of TPU topology `name` (e.g. "v5e:16x16", "v5p:4x4x8"), from
  `jax.experimental.topologies` (after `runtime.startup.quiet_libtpu`), or of GPU topology `name` ("h100:8",
  `aot.gpu.gpu_devices`).

  Raises:
    ConfigError: libtpu (or the CUDA plugin) is not installed, or does not know `name` (one line each).
  """
  if aot_gpu.is_gpu(name):
    return aot_gpu.gpu_devices(name)
  if importlib.util.find_spec("libtpu") is None:
    raise ConfigError(
      f"--topology {name}: no TPU compiler for it here (libtpu is not installed); install it with "
      "pip install -e '.[aot]', or use --devices N for simulated CPU devices"
    )
  quiet_libtpu()
  from jax.experimental import topologies  # here: the optional path

  try:
    return list(topologies.get_topology_desc(name, "tpu").devices)
  except Exception as e:  # noqa: BLE001  (whatever libtpu says of the name: one line)
    raise ConfigError(
      f"--topology {name}: libtpu does not know it ({str(e).splitlines()[0][:200]}); write "
      "GENERATION:CHIPS, e.g. v5e:4x4, v5p:4x4x8 or v6e:16x16"
    ) from None


def device_memory(topology: str | None) -> int | None:
  """The memory to check a program against when the user gives no `--hbm`: a GPU topology's rated
  memory (XLA:GPU does not check it); None otherwise (the TPU compiler checks its own HBM)."""
  return aot_gpu.memory_bytes(topology) if topology and aot_gpu.is_gpu(topology) else None


def topology_mesh(config: Config, devices: list[Any] | None) -> Any:
  """`runtime.startup.build_mesh(config, devices)`; a mesh that a topology's physical axes cannot form (each
  mesh size must be a product of some of them: 4x4 makes 4 or 16, not 8) is a one-line ConfigError."""
  try:
    return build_mesh(config, devices)
  except NotImplementedError as e:
    cause = str(e).split(". ")[0][:200]
    raise ConfigError(
      f"the mesh does not map onto the topology's physical axes ({cause}); make each mesh.* size a "
      "product of some of the topology's dimensions"
    ) from None


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
    keys += ["targets_segment_ids", "targets_positions"] if get_task(config).translates else []
  return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in keys}


def memory_parts(compiled) -> dict[str, int]:
  """XLA's per-device memory analysis of a compiled program, bytes: `argument_bytes`,
  `output_bytes`, `alias_bytes` (outputs reusing donated arguments), `temp_bytes`, and their
  `total_bytes` = arguments + outputs - alias + temporaries (donated state counted once).
  Empty where the backend gives no analysis."""
  memory = compiled.memory_analysis()
  if memory is None:
    return {}
  parts = {
    "argument_bytes": memory.argument_size_in_bytes,
    "output_bytes": memory.output_size_in_bytes,
    "alias_bytes": memory.alias_size_in_bytes,
    "temp_bytes": memory.temp_size_in_bytes,
  }
  parts["total_bytes"] = parts["argument_bytes"] + parts["output_bytes"] - parts["alias_bytes"] + parts["temp_bytes"]
  return parts


def out_of_memory(message: str) -> dict[str, Any] | None:
  """The figures of a TPU compiler's out-of-memory error `message`, or None for any other error:
  `required_bytes` and `available_bytes` as the compiler reports them (it rounds to 2 decimals of
  its unit, so they are exact to about 0.5%), `required_for` (what it counted: "HLO temporaries",
  or "all buffers"), `compiler_message` (its first sentence)."""
  for pattern in _OOM_PATTERNS:
    match = pattern.search(message)
    if match:
      need, have = (int(float(match.group(i)) * 1024 ** " KMGTP".index(match.group(i + 1) or " ")) for i in (2, 4))
      line = next(x for x in message.splitlines() if "memory" in x).strip()
      return {
        "required_bytes": need,
        "available_bytes": have,
        "required_for": match.group("what") or "all buffers",
        "compiler_message": line.split(". Memory usage report")[0][:400],
      }
  return None


def compile_program(lowered, hbm_bytes: int | None, what: str, platform: str) -> dict[str, Any]:
  """Compiles `lowered` (a `jax.stages.Lowered`) and measures it: the per-device `memory_parts`
  (`total_bytes_per_device` for their total), `generated_code_bytes`, the compiler's cost analysis
  per device (`flops`, `bytes_accessed`; 0 where it gives none; XLA counts a loop's body once, so
  under `model.scan_layers` they count one layer of the stack), `compile_seconds`, and, with
  `hbm_bytes` or on `platform` "tpu" (whose compiler checks its memory), `fits`: the compiler
  accepted it and its total is at most `hbm_bytes` when given. A TPU compiler's out-of-memory
  refusal is `fits: false` with `out_of_memory`'s figures instead of the memory parts. `what`
  names the program in errors ("the train step").

  Raises:
    CompileError: any other compiler error, as one line naming the program and the fix.
  """
  start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    oom = out_of_memory(str(e))
    if oom is None:
      cause = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)[:300]
      raise CompileError(
        f"the compiler rejected {what}: {cause}; change the mesh, batch or model options it "
        "names, or try `jaxformer compile --devices N` to compile it for CPU devices"
      ) from None
    result = {"fits": False, **oom, "compile_seconds": round(time.perf_counter() - start, 2)}
    return {**result, "hbm_bytes": hbm_bytes} if hbm_bytes is not None else result
  seconds = time.perf_counter() - start
  parts = memory_parts(compiled)
  total = parts.pop("total_bytes", 0)
  cost, memory = compiled.cost_analysis() or {}, compiled.memory_analysis()
  result = {
    **{k: int(v) for k, v in parts.items()},
    "generated_code_bytes": int(memory.generated_code_size_in_bytes) if memory is not None else 0,
    "total_bytes_per_device": int(total),
    "flops": float(cost.get("flops", 0.0)),
    "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
    "compile_seconds": round(seconds, 2),
  }
  if hbm_bytes is not None:
    return {**result, "hbm_bytes": hbm_bytes, "fits": total <= hbm_bytes}
  return {**result, "fits": True} if platform == "tpu" else result


def describe(config: Config, mesh, params: Any) -> dict[str, Any]:
  """The fields every `jaxformer compile` result starts with: config name, devices, platform,
  mesh, parameter count, precision and layout options."""
  return {
    "config": config.name,
    "devices": mesh.devices.size,
    "platform": mesh.devices.flat[0].platform,
    "mesh": dict(mesh.shape),
    "params": sum(x.size for x in jax.tree.leaves(params)),
    "remat": config.model.remat,
    "scan_layers": config.model.scan_layers,
    "compute_dtype": config.model.dtype,
    "attention": config.model.attention,
  }


def compile_train_step(
  config: Config, devices: list[Any] | None = None, hbm_bytes: int | None = None
) -> dict[str, Any]:
  """Lowers and compiles `config`'s train step on a mesh over `devices` (default: all JAX
  devices) without running it; nothing is allocated but the compiled program.

  Returns a JSON-safe dict: `describe`'s fields, `batch_size`, `length`, `lower_seconds`
  (tracing and lowering), `compile_cpu_seconds` (this process's CPU time for lowering and
  compiling, a steadier figure on a shared machine) and `compile_program`'s fields, with
  `compile_seconds` the wall time of lowering and compiling together: bytes per device
  `argument_bytes`, `output_bytes`, `alias_bytes`, `temp_bytes`, `generated_code_bytes`,
  `total_bytes_per_device` (= argument + output - alias + temp), `flops`, `bytes_accessed`,
  `fits` (with `hbm_bytes` or on TPU), `hbm_bytes` when given; or, when the TPU compiler runs out of memory, `fits`
  false with `required_bytes`, `available_bytes`, `required_for` and `compiler_message`.

  Raises:
    ConfigError: the mesh does not fit the devices or a dimension does not divide over it
      (checked before compiling, one line).
    CompileError: the compiler rejected the program for another reason (one line).
  """
  start, cpu_start = time.perf_counter(), time.process_time()
  lowered, mesh, params = lower_train_step(config, devices)
  lower_seconds = time.perf_counter() - start
  program = compile_program(lowered, hbm_bytes, "the train step", mesh.devices.flat[0].platform)
  return {
    **describe(config, mesh, params),
    "batch_size": config.train.batch_size,
    "length": config.data.max_length,
    **program,
    "lower_seconds": round(lower_seconds, 2),
    "compile_seconds": round(lower_seconds + program["compile_seconds"], 2),
    "compile_cpu_seconds": round(time.process_time() - cpu_start, 2),
  }


def lower_train_step(
  config: Config, devices: list[Any] | None = None, platforms: tuple[str, ...] | None = None
) -> tuple[Any, Any, Any]:
  """(the `jax.stages.Lowered` train step of `config` on a mesh over `devices`, the mesh, the
  abstract params), from abstract inputs only. `platforms` (e.g. `("cuda",)`) lowers for another
  platform than the devices' own: StableHLO that platform's compiler would take, checked for
  ops and shardings with no lowering there (it cannot be compiled here).

  Raises:
    ConfigError: the mesh does not fit the devices (or their physical axes) or a dimension does not
      divide over it (one line).
  """
  mesh = topology_mesh(config, devices)
  rules = sh.rules_for(config.mesh)
  model = get_task(config).make_model()
  tx = make_optimizer(config.optim, config.model.d_model)
  abstract, shardings = state_shardings(model, tx, mesh, rules)  # jax.eval_shape: nothing allocated
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  key = jax.eval_shape(lambda: jax.random.key(0))
  rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sh.replicated(mesh))
  step = make_train_call(model, tx, config, mesh, shardings)
  with sh.bind(mesh, rules):
    lowered = step.jitted.trace(state, abstract_batch(config, mesh, rules), rng).lower(lowering_platforms=platforms)
  return lowered, mesh, abstract.params


def gib(n: int) -> str:
  """`n` bytes as "1.50 GiB" (from 1 GiB) or "3.20 MiB"."""
  return f"{n / 2**30:,.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.2f} MiB"


def program_lines(program: dict[str, Any], platform: str, indent: str = "") -> list[str]:
  """The per-device memory lines of one `compile_program` result for `platform`, and whether it
  fits (on TPU, a compiled program fits: its compiler checks the device memory)."""
  if "required_bytes" in program:
    return [
      f"{indent}does NOT fit: the compiler needs {gib(program['required_bytes'])} "
      f"({program['required_for']}) of the {gib(program['available_bytes'])} it has per device",
      f"{indent}  compiler: {program['compiler_message']}",
    ]
  lines = [f"{indent}per device:"]
  for key, label in (
    ("argument", "arguments"),
    ("output", "outputs"),
    ("alias", "- aliased (donated)"),
    ("temp", "temporaries"),
  ):
    lines.append(f"{indent}  {label:<20} {gib(program[key + '_bytes']):>14}")
  lines.append(f"{indent}  {'total':<20} {gib(program['total_bytes_per_device']):>14}")
  if "hbm_bytes" in program:
    verdict = "fits" if program["fits"] else "does NOT fit"
    lines.append(f"{indent}{verdict} in {gib(program['hbm_bytes'])} of device memory")
  elif "fits" in program:
    lines.append(f"{indent}fits (the {platform.upper()} compiler accepted it)")
  return lines


def format_report(result: dict[str, Any]) -> str:
  """A short human-readable summary of a `compile_train_step` result."""
  mesh = " ".join(f"{k}={v}" for k, v in result["mesh"].items() if v > 1) or "single device"
  head = (
    f"{result['config']}: {result['params']:,} parameters, batch {result['batch_size']} x {result['length']} "
    f"tokens, on {result['devices']} {result['platform']} devices ({mesh}); compiled in "
    f"{result['compile_seconds']:.1f} s"
  )
  return "\n".join([head, *program_lines(result, result["platform"])])
