"""What a process pays before its first step: `import jax`, and compiling the model's init.

Prints, as medians over `--rounds`:
- `import jax` in a fresh interpreter (each round its own process), which is where the pinned
  `ml_dtypes` shows (0.7.0 took 0.8-1.0 s to import);
- the XLA compile of the jitted init with one Threefry hash per draw (`model.init`, the peer) and
  with the hashes merged (`jaxformer.models.batched_threefry`, what `init_params` uses on one
  device), on one
  device and with the params sharded over an fsdp mesh of `--devices` simulated CPU devices.
Every round traces anew and the persistent compilation cache is off. Ends with one JSON line.

Usage: PYTHONPATH=. python benchmarks/init_compile.py [--config configs/tiny.yaml] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def import_seconds(rounds: int) -> float:
  """Median seconds `import jax` takes in a fresh interpreter, over `rounds` processes."""
  code = "import time; t = time.perf_counter(); import jax; print(time.perf_counter() - t)"
  runs = [
    float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    for _ in range(rounds)
  ]
  return statistics.median(runs)


def compile_seconds(config_path: str, devices: int, rounds: int) -> dict:
  """{"<init> <n> device(s)": median XLA compile seconds}: `model.init` and `batched_threefry` of the
  config's model, its params sharded over an fsdp mesh of 1 and of `devices` devices."""
  import flax.linen as nn
  import jax

  from jaxformer import sharding as sh
  from jaxformer.config import MeshConfig, load_config
  from jaxformer.models.abstract import _boxed_params, param_shardings
  from jaxformer.models.batched_threefry import batched_threefry
  from jaxformer.tasks import get_task

  model = get_task(load_config(config_path)).make_model()
  out = {}
  for n in (1, devices):
    mesh = sh.make_mesh(MeshConfig(data=1, fsdp=n), jax.devices()[:n])
    _, shardings = param_shardings(model, mesh)
    for name in ("model.init", "batched_threefry"):
      times = []
      for _ in range(rounds):
        if name == "batched_threefry":
          fn = batched_threefry(lambda key: nn.meta.unbox(_boxed_params(model, key)))  # traced anew each round
        else:
          fn = lambda key: nn.meta.unbox(_boxed_params(model, key))  # noqa: E731
        with sh.bind(mesh, sh.LOGICAL_RULES):
          lowered = jax.jit(fn, out_shardings=shardings).lower(jax.random.key(0))
        start = time.perf_counter()
        lowered.compile()
        times.append(time.perf_counter() - start)
      out[f"{name} {n} device{'s' if n > 1 else ''}"] = statistics.median(times)
  return out


def main() -> None:
  """Prints the table and the JSON line (see the module docstring)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/tiny.yaml")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--devices", type=int, default=8)
  args = parser.parse_args()
  os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
  result = {"import jax s": import_seconds(args.rounds), **compile_seconds(args.config, args.devices, args.rounds)}
  for name, seconds in result.items():
    print(f"{name:28s} {seconds:7.3f} s")
  for n in (1, args.devices):
    suffix = f"{n} device{'s' if n > 1 else ''}"
    result[f"speedup {suffix}"] = result[f"model.init {suffix}"] / result[f"batched_threefry {suffix}"]
    print(f"{'speedup ' + suffix:28s} {result[f'speedup {suffix}']:7.2f}x")
  print(json.dumps({"config": args.config, "rounds": args.rounds, **result}))


if __name__ == "__main__":
  main()
