"""`jaxformer train | eval | translate`: thin wiring of config, runtime and the library.

User mistakes (bad config, mesh, paths, missing checkpoints) print one `error:` line and
exit with status 2; results are JSON lines on stdout (the last line of `eval` is one
JSON object).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxformer.checkpoint import CheckpointError
from jaxformer.config import ConfigError, load_config, parse_override


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxformer", description="Train and use Transformer models in JAX.")
  sub = p.add_subparsers(dest="command", required=True)

  t = sub.add_parser("train", help="train (or resume) a model in a workdir")
  t.add_argument("--config", required=True, help="YAML config, e.g. configs/multi30k_small.yaml")
  t.add_argument("--workdir", required=True, help="directory for checkpoints, logs, config and tokenizer")
  t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.num_steps=100 mesh.data=4")

  e = sub.add_parser("eval", help="restore a checkpoint, translate a split and report BLEU/chrF")
  e.add_argument("--workdir", required=True)
  e.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  e.add_argument("--split", choices=("val", "test"), default="test")
  e.add_argument("--src", help="source file (one sentence per line) instead of --split")
  e.add_argument("--ref", help="reference file, line-aligned with --src")
  e.add_argument("--batch-size", type=int, default=64, help="sentences per decoding batch")
  e.add_argument("--output", help="hypotheses file (default: WORKDIR/hypotheses.<split>.txt)")
  e.add_argument("overrides", nargs="*", help="runtime/mesh overrides, e.g. runtime.num_cpu_devices=4 mesh.data=4")

  tr = sub.add_parser("translate", help="translate stdin lines to stdout")
  tr.add_argument("--workdir", required=True)
  tr.add_argument("--step", type=int, default=None)
  tr.add_argument("--batch-size", type=int, default=64)
  tr.add_argument("overrides", nargs="*")
  return p


def _read_lines(path: str, what: str) -> list[str]:
  file = Path(path)
  if not file.is_file():
    raise FileNotFoundError(f"{what} file {path} does not exist")
  lines = file.read_text(encoding="utf-8").splitlines()
  if not lines:
    raise ValueError(f"{what} file {path} is empty")
  return lines


def _runtime_from_overrides(overrides: list[str]):
  """The RuntimeConfig implied by overrides alone (for eval/translate before loading)."""
  from jaxformer.config import config_from_dict
  runtime_overrides = [o for o in overrides if o.startswith("runtime.")]
  return config_from_dict({}, runtime_overrides).runtime


def cmd_train(args) -> None:
  from jaxformer.runtime import init_runtime
  config = load_config(args.config, args.overrides)
  init_runtime(config.runtime)
  from jaxformer.train.loop import train
  train(config, args.workdir)


def _eval_sources(args, splits_loader):
  if args.src or args.ref:
    if not (args.src and args.ref):
      raise ValueError("--src and --ref must be given together")
    src, ref = _read_lines(args.src, "--src"), _read_lines(args.ref, "--ref")
    if len(src) != len(ref):
      raise ValueError(f"--src has {len(src)} lines but --ref has {len(ref)}; they must be line-aligned")
    return "custom", src, ref
  split = {"val": "validation", "test": "test"}[args.split]
  data = splits_loader()[split]
  return args.split, data.source_texts, data.target_texts


def cmd_eval(args) -> None:
  for o in args.overrides:
    parse_override(o)
  from jaxformer.runtime import init_runtime
  init_runtime(_runtime_from_overrides(args.overrides))
  from jaxformer import evaluate
  from jaxformer.train.loop import load_data
  config = evaluate.workdir_config(args.workdir, args.overrides)
  name, sources, references = _eval_sources(args, lambda: load_data(config)[1])
  restored = evaluate.restore(args.workdir, config, args.step)
  hyps, speed = evaluate.translate(restored, sources, args.batch_size)
  output = Path(args.output) if args.output else Path(args.workdir) / f"hypotheses.{name}.txt"
  evaluate.write_lines_atomic(output, hyps)
  result = {"step": restored.step, "split": name, "num_sentences": len(sources),
            **evaluate.score(hyps, references), **{k: round(v, 3) for k, v in speed.items()},
            "hypotheses": str(output)}
  print(json.dumps(result), flush=True)


def cmd_translate(args) -> None:
  from jaxformer.runtime import init_runtime
  init_runtime(_runtime_from_overrides(args.overrides))
  from jaxformer import evaluate
  config = evaluate.workdir_config(args.workdir, args.overrides)
  restored = evaluate.restore(args.workdir, config, args.step)
  lines = [line.rstrip("\n") for line in sys.stdin]
  if lines:
    hyps, _ = evaluate.translate(restored, lines, args.batch_size)
    sys.stdout.write("".join(h + "\n" for h in hyps))


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  commands = {"train": cmd_train, "eval": cmd_eval, "translate": cmd_translate}
  try:
    commands[args.command](args)
  except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
