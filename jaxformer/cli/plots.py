"""`jaxformer plot | attention`: pictures of a run (the parsers and handlers `jaxformer.cli` registers).

Each prints one JSON line last, naming the PNG it wrote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parsers(sub) -> None:
  """Adds the `plot` and `attention` subcommands to the `jaxformer` subparsers `sub`."""
  p = sub.add_parser(
    "plot",
    help="draw training loss, validation loss and learning rate against step for one or "
    "more workdirs (overlaid, legend by workdir name) as a PNG",
  )
  p.add_argument("--workdir", required=True, nargs="+", metavar="DIR", help="workdirs with a metrics.jsonl")
  p.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")

  a = sub.add_parser(
    "attention",
    help="draw encoder self-, decoder self- and encoder-decoder attention of every "
    "layer and head for one sentence pair, tokens on the axes, as a PNG",
  )
  a.add_argument("--workdir", required=True)
  a.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  a.add_argument("--text", required=True, help="the source sentence (a language model's text)")
  a.add_argument("--target", default=None, help="the target sentence (default: the model's greedy translation)")
  a.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
  a.add_argument("overrides", nargs="*", help="runtime/mesh overrides, e.g. runtime.num_cpu_devices=1")


def cmd_plot(args: argparse.Namespace) -> None:
  """`jaxformer plot`: draws the training curves of the workdirs to `--out` (PNG)."""
  from jaxformer import plots

  plots.plot_training(args.workdir, args.out)
  print(json.dumps({"out": args.out, "workdirs": args.workdir}), flush=True)


def cmd_attention(args: argparse.Namespace) -> None:
  """`jaxformer attention`: draws the attention maps of one sentence (pair) to `--out` (PNG)."""
  from jaxformer import plots
  from jaxformer.config import runtime_from_overrides
  from jaxformer.runtime.startup import init_runtime

  plots.check_out(args.out)  # before the minute a restore and a decode may take
  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer.inference import restore as inference_restore
  from jaxformer.inference.attention_maps import attention_maps

  config = inference_restore.workdir_config(args.workdir, args.overrides)
  restored = inference_restore.restore(args.workdir, config, args.step)
  result = attention_maps(restored, args.text, args.target)
  plots.plot_attention(result.maps, args.out, title=f"{Path(args.workdir).name} (step {restored.step})")
  print(json.dumps({"out": args.out, "step": restored.step, "text": args.text, "target": result.target}), flush=True)


COMMANDS = {"plot": cmd_plot, "attention": cmd_attention}
