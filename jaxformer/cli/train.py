"""`jaxformer train | eval | average`: training a run, scoring its checkpoints, and averaging them (the parsers
and handlers `jaxformer.cli` registers)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxformer.cli.args import (
  CONFIG_HINT,
  add_checkpoint_args,
  add_distributed_args,
  add_draft_args,
  add_search_args,
  config_path,
  positive_int,
  search_options,
)
from jaxformer.config import load_config, parse_override, runtime_from_overrides


def add_parsers(sub) -> None:
  """Adds the `train`, `eval` and `average` subcommands to the `jaxformer` subparsers `sub`."""
  t = sub.add_parser("train", help="train (or resume) a model in a workdir", epilog=CONFIG_HINT)
  t.add_argument(
    "--config",
    required=True,
    help="YAML config, e.g. configs/multi30k_small.yaml (`jaxformer config --list` shows the shipped ones)",
  )
  t.add_argument("--workdir", required=True, help="directory for checkpoints, logs, config and tokenizer")
  t.add_argument("--dry-run", action="store_true", help="print the sharding summary and exit without training")
  t.add_argument("--verbose", action="store_true", help="print every parameter's sharding at the start (as --dry-run)")
  add_distributed_args(t)
  t.add_argument(
    "overrides",
    nargs="*",
    help="dotted overrides, e.g. train.num_steps=100 mesh.data=4 (`jaxformer config --show CONFIG` lists every key)",
  )

  e = sub.add_parser(
    "eval",
    help="restore a checkpoint and report BLEU/chrF (translation) or validation "
    "loss and perplexity (causal LM) or masked-token loss and accuracy (masked LM)",
  )
  e.add_argument("--workdir", required=True)
  add_checkpoint_args(e)
  e.add_argument(
    "--split",
    choices=("val", "test"),
    default=None,
    help="the split to evaluate (default: test for translation, val for language models)",
  )
  e.add_argument("--src", help="source file (one sentence per line) instead of --split")
  e.add_argument("--ref", help="reference file, line-aligned with --src")
  e.add_argument("--batch-size", type=positive_int, default=64, help="sentences per decoding batch")
  e.add_argument(
    "--output",
    help="hypotheses file (default: WORKDIR/hypotheses.<split>.<greedy|beamK|sampleS>.txt; "
    "a read-only WORKDIR gets them in a new temporary folder, named on stderr)",
  )
  add_search_args(e)
  add_draft_args(e)
  e.add_argument("overrides", nargs="*", help="runtime/mesh overrides, e.g. runtime.num_cpu_devices=4 mesh.data=4")

  a = sub.add_parser(
    "average",
    help="write the mean params of a run's last N checkpoints (paper section 6.1) "
    "as a workdir that eval, translate and generate read",
  )
  a.add_argument("--workdir", required=True)
  a.add_argument("--last", type=positive_int, required=True, help="how many of the newest checkpoints to average")
  a.add_argument("--output", default=None, help="the new workdir (default: WORKDIR/average-last-N)")
  a.add_argument("overrides", nargs="*", help="runtime/mesh overrides, e.g. runtime.num_cpu_devices=4")


def cmd_train(args) -> None:
  """`jaxformer train`: trains (or resumes) `--config` in `--workdir`."""
  from jaxformer.runtime import interrupt

  interrupt.install()  # before any library starts a thread (they inherit the blocked SIGINT/SIGTERM)
  config = load_config(config_path(args.config), args.overrides)  # before the runtime starts: a typo fails fast
  from jaxformer.runtime.distributed import initialize_from_args
  from jaxformer.runtime.startup import init_runtime

  initialize_from_args(args)  # before any other JAX use
  init_runtime(config.runtime)
  from jaxformer.train.loop import train

  train(config, args.workdir, dry_run=args.dry_run, verbose=args.verbose)


def cmd_eval(args) -> None:
  """`jaxformer eval`: scores a workdir's checkpoint on a split; prints one JSON line last."""
  for o in args.overrides:
    parse_override(o)
  from jaxformer.runtime.startup import init_runtime

  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer.inference import restore as inference_restore
  from jaxformer.tasks import evaluate, get_task
  from jaxformer.tasks.base import EvalOptions

  search = search_options(args)
  config = inference_restore.workdir_config(args.workdir, args.overrides)
  task = get_task(config)
  output = evaluate.hypotheses_destination(args.output, args.workdir) if task.translates else None
  restored = []

  def restore():
    restored.append(inference_restore.restore(args.workdir, config, args.step, args.average_last, args.quantize))
    return restored[-1]

  def draft():
    return inference_restore.restore_draft(
      args.draft_workdir, restored[-1], args.overrides, args.draft_tokens, args.quantize
    )

  options = EvalOptions(
    split=args.split,
    src=args.src,
    ref=args.ref,
    batch_size=args.batch_size,
    search=search,
    output=output,
    workdir=args.workdir,
    draft=draft if args.draft_workdir else None,
  )

  result = task.evaluate(restore, options)
  if args.average_last:
    result["averaged_steps"] = restored[-1].averaged
  if args.quantize:
    result["quantize"] = args.quantize
  if args.draft_workdir:
    result.update(draft_workdir=args.draft_workdir, draft_tokens=args.draft_tokens)
  print(evaluate.result_json(result), flush=True)


def cmd_average(args) -> None:
  """`jaxformer average`: writes the mean of a run's last N checkpoints as a workdir of its own."""
  from jaxformer.runtime.startup import init_runtime

  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer.checkpoint import average
  from jaxformer.inference import restore as inference_restore

  output = Path(args.output) if args.output else average.default_output(args.workdir, args.last)
  if output.exists():  # before reading any checkpoint
    raise ValueError(f"{output} already exists; remove it or pass another --output")
  config = inference_restore.workdir_config(args.workdir, args.overrides)
  restored = inference_restore.restore(args.workdir, config, average_last=args.last)
  average.write_averaged(args.workdir, output, restored.averaged, restored.params)
  print(json.dumps({"workdir": str(output), "averaged_steps": restored.averaged}), flush=True)


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "average": cmd_average}
