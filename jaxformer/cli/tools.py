"""`jaxformer config | bench | compile`: the shipped configs and every key, the train step's speed, and
ahead-of-time compilation for larger meshes (the parsers and handlers `jaxformer.cli` registers)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxformer.cli.args import CONFIGS_DIR, add_compile_args, config_path, positive_int
from jaxformer.config import load_config


def add_parsers(sub) -> None:
  """Adds the `config`, `bench` and `compile` subcommands to the `jaxformer` subparsers `sub`."""
  c = sub.add_parser(
    "config", help="list the shipped configs, or show a resolved config with every key's type, default and description"
  )
  what = c.add_mutually_exclusive_group(required=True)
  what.add_argument("--list", action="store_true", help="the shipped configs with their one-line descriptions")
  what.add_argument("--show", metavar="CONFIG", help="a YAML config (path or shipped name) with overrides applied")
  c.add_argument("overrides", nargs="*", help="dotted overrides for --show, e.g. train.num_steps=100")

  b = sub.add_parser(
    "bench",
    help="time the train step on synthetic batches: compile time, tokens/s, MFU, "
    "memory; also the same model in PyTorch when it is installed",
  )
  b.add_argument("--config", required=True)
  b.add_argument(
    "--batch-size", type=positive_int, default=None, help="sentence pairs per step (default: train.batch_size)"
  )
  b.add_argument("--src-length", type=int, default=32, help="source tokens per pair")
  b.add_argument("--tgt-length", type=int, default=32, help="target tokens per pair")
  b.add_argument("--steps", type=int, default=10, help="timed steps after warm-up (the median is reported)")
  b.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
  b.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
  b.add_argument("--output", help="also write the JSON result to this file")
  b.add_argument(
    "overrides", nargs="*", help="dotted overrides, e.g. precision.policy=compute=bfloat16 runtime.num_cpu_devices=2"
  )

  co = sub.add_parser(
    "compile",
    help="compile the train step (or, with --decode, the decode step and prefill) "
    "ahead of time for N simulated devices, a TPU topology or described GPUs, without running it: "
    "per-device memory and whether it fits",
  )
  add_compile_args(co)


def cmd_config(args) -> None:
  """`jaxformer config`: lists the shipped configs, or prints every key of one (value, type, default, help)."""
  if args.list:
    configs = []
    for path in sorted(CONFIGS_DIR.glob("*.yaml")):
      head = []
      for line in path.read_text().splitlines():  # the leading comment block, up to its first full stop
        if not line.startswith("#"):
          break
        head.append(line[1:].strip())
      description = " ".join(head).split(". ")[0].rstrip(".")
      configs.append({"name": path.stem, "path": str(path), "description": description})
    width = max(len(c["name"]) for c in configs)
    for c in configs:
      print(f"{c['name'].ljust(width)}  {c['description']}")
    print(json.dumps({"configs": configs}), flush=True)
    return
  from jaxformer.config import to_dict
  from jaxformer.config.schema import describe

  config = load_config(config_path(args.show), args.overrides)
  rows = describe(config)
  width = max(len(r["key"]) for r in rows)
  for r in rows:
    value = json.dumps(r["value"])
    default = "" if r["value"] == r["default"] else f", default {json.dumps(r['default'])}"
    print(f"{r['key'].ljust(width)} = {value}  ({r['type']}{default})  {r['description']}")
  print(json.dumps(to_dict(config)), flush=True)


def cmd_bench(args) -> None:
  """`jaxformer bench`: times the train step of `--config`; prints one JSON line."""
  config = load_config(config_path(args.config), args.overrides)
  from jaxformer.runtime.startup import init_runtime

  init_runtime(config.runtime)
  from jaxformer.bench import step as bench

  options = bench.BenchOptions(
    args.batch_size or config.train.batch_size,
    args.src_length,
    args.tgt_length,
    args.steps,
    args.warmup,
    peer=not args.no_torch,
  ).validate(config.model)
  result = bench.run_bench(config, options)
  print(bench.format_table(result), flush=True)
  if args.output:
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
  print(json.dumps(result), flush=True)


def cmd_compile(args) -> None:
  """`jaxformer compile`: compiles `--config`'s train step (or decode step and prefill) ahead of time and
  reports its memory; a TPU compiler's out-of-memory refusal is a result (`fits: false`), not an error."""
  # Simulated CPU devices, or a TPU/GPU topology compiled for by a process that runs nothing: its own
  # backend is the CPU's, so no local accelerator is ever opened.
  cpu = [f"runtime.num_cpu_devices={args.devices}"] if args.devices else []
  config = load_config(config_path(args.config), [*args.overrides, *cpu, "runtime.platform=cpu"])
  from jaxformer.aot import train_step as aot

  hbm = aot.parse_size(args.hbm) if args.hbm else aot.device_memory(args.topology)
  from jaxformer.runtime.startup import init_runtime, quiet_libtpu

  if args.topology:
    quiet_libtpu()  # before any backend starts
  init_runtime(config.runtime)
  devices = aot.topology_devices(args.topology) if args.topology else None
  if args.decode:
    from jaxformer.aot import decode as aot_decode

    result = aot_decode.compile_decode(config, devices, hbm, args.context, args.page_size or 0)
    print(aot_decode.format_report(result), flush=True)
  else:
    result = aot.compile_train_step(config, devices, hbm)
    print(aot.format_report(result), flush=True)
  print(json.dumps(result), flush=True)


COMMANDS = {"config": cmd_config, "bench": cmd_bench, "compile": cmd_compile}
