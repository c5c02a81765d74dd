"""The command line's shared argument types and flag groups (`jaxformer.cli` and its command groups).

Each `add_*` function adds one group of flags to a subcommand's parser; `search_options` and
`config_path` turn parsed flags into library values.
"""

from __future__ import annotations

import argparse
from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"  # the top-level configs/, shipped in the package
CONFIG_HINT = (
  "configs: `jaxformer config --list` lists the shipped configs; `jaxformer config --show CONFIG "
  "[key=value ...]` prints every key with its value, type, default and description"
)


def positive_int(text: str) -> int:
  """argparse type: an int >= 1 (a usage error names the flag otherwise)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} must be >= 1")
  return value


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
  """`--step N` or `--average-last N`: which params eval/translate/generate/serve restore;
  `--quantize int8`: how they are stored for decoding."""
  which = p.add_mutually_exclusive_group()
  which.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  which.add_argument(
    "--average-last",
    type=positive_int,
    default=None,
    metavar="N",
    help="the mean params of the newest N checkpoints (paper section 6.1: 5 for base, 20 for big)",
  )
  p.add_argument(
    "--quantize",
    choices=("int8",),
    default=None,
    help="int8 weights for decoding (per-channel scales, about 4x smaller; int8 x int8 products)",
  )


def add_draft_args(p: argparse.ArgumentParser) -> None:
  """`--draft-workdir DIR [--draft-tokens K]`: speculative greedy decoding with a small draft model."""
  p.add_argument(
    "--draft-workdir",
    default=None,
    metavar="DIR",
    help="a small model with the same tokenizer that proposes tokens the target verifies in one pass "
    "(speculative decoding; greedy only; the output equals the target's greedy output)",
  )
  p.add_argument(
    "--draft-tokens", type=positive_int, default=4, metavar="K", help="tokens the draft proposes per round"
  )


def add_distributed_args(p: argparse.ArgumentParser) -> None:
  """Multi-process flags; without them JAXFORMER_* or SLURM variables are used (see runtime/distributed.py)."""
  g = p.add_argument_group(
    "multi-process",
    "give all three to run as one of several processes (one per host); "
    "default: JAXFORMER_COORDINATOR/_NUM_PROCESSES/_PROCESS_ID or SLURM, else one process",
  )
  g.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's coordinator service")
  g.add_argument("--num-processes", type=int, default=None, help="number of processes in the run")
  g.add_argument("--process-id", type=int, default=None, help="this process's index in [0, num_processes)")


def add_search_args(p: argparse.ArgumentParser) -> None:
  """Decoding flags of `eval`/`translate`. Strategy: --beam-size > 1 is beam search; else
  any of --temperature/--top-k/--top-p turns on sampling; else greedy search."""
  g = p.add_argument_group(
    "decoding",
    "beam search if --beam-size > 1; sampling if --beam-size is 1 and any of "
    "--temperature/--top-k/--top-p is given; greedy otherwise",
  )
  g.add_argument("--beam-size", type=int, default=1, help="beams per sentence; 1 = greedy (paper: 4)")
  g.add_argument(
    "--length-penalty", type=float, default=0.6, help="GNMT length-penalty alpha for beam search (paper: 0.6)"
  )
  g.add_argument(
    "--max-length",
    type=int,
    default=50,
    help="tokens allowed beyond the source length (paper: 50); capped by model.max_length",
  )
  g.add_argument("--temperature", type=float, default=None, help="sampling temperature > 0 (default 1.0 when sampling)")
  g.add_argument("--top-k", type=int, default=None, help="sample among the k most probable tokens (0 = all)")
  g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (1 = all)")
  g.add_argument(
    "--seed", type=int, default=0, help="sampling seed; a sentence's sample depends only on the seed and the sentence"
  )


def add_compile_args(p: argparse.ArgumentParser) -> None:
  """`jaxformer compile`'s flags: where (`--devices N` or `--topology NAME`), `--hbm`, and `--decode`
  with its `--context` and `--page-size`."""
  p.add_argument("--config", required=True)
  where = p.add_mutually_exclusive_group(required=True)
  where.add_argument(
    "--devices", type=positive_int, help="simulated CPU devices, e.g. 256 (sets runtime.num_cpu_devices)"
  )
  where.add_argument(
    "--topology",
    help="a TPU topology, e.g. v5e:4x4, v5p:4x4x8 or v6e:16x16, compiled by the TPU "
    "compiler on this machine (needs the aot extra: pip install -e '.[aot]'); or GPUs, h100:8 "
    "or h200:4x8 (needs the CUDA plugin, see jaxformer/aot/gpu.py)",
  )
  p.add_argument(
    "--hbm",
    help="device memory to check against, e.g. 80GiB or 16GB (default on GPUs: their rated "
    "memory; on TPU the compiler checks its own)",
  )
  p.add_argument(
    "--decode",
    action="store_true",
    help="compile the KV-cache decode step and the prefill for "
    "train.batch_size rows instead of the train step; reports the cache's and weights' memory",
  )
  p.add_argument(
    "--context",
    type=positive_int,
    default=None,
    help="--decode: tokens per row, cached and prefilled (default: model.max_length)",
  )
  p.add_argument(
    "--page-size",
    type=positive_int,
    default=None,
    help="--decode: the serving engine's paged cache with pages of this many tokens (default: contiguous)",
  )
  p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.fsdp=64 mesh.tensor=4 train.batch_size=512")


def search_options(args):
  """SearchOptions from the decoding flags (and `--draft-workdir`, which needs plain greedy
  search); ValueError (one line) on a bad combination."""
  from jaxformer.inference.options import SearchOptions

  sampling = [
    f
    for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k), ("--top-p", args.top_p))
    if v is not None
  ]
  if args.beam_size > 1 and sampling:
    raise ValueError(
      f"--beam-size {args.beam_size} cannot be combined with {'/'.join(sampling)}: sampling needs --beam-size 1"
    )
  options = SearchOptions(
    beam_size=args.beam_size,
    length_penalty=args.length_penalty,
    extra_tokens=args.max_length,
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    seed=args.seed,
  ).validate()
  if getattr(args, "draft_workdir", None):
    options.check_speculative()  # before anything is restored
  return options


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
  """`parser`'s arguments of `argv`, with dotted overrides (`key=value`) accepted anywhere among
  the flags: argparse takes one run of positionals, so later ones are added to `overrides`.

  Raises:
    SystemExit: an argument that is neither a flag of the command nor an override (argparse's message).
  """
  args, extra = parser.parse_known_args(argv)
  strays = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
  if strays:
    parser.error(f"unrecognized arguments: {' '.join(strays)}")
  if extra:
    args.overrides = [*args.overrides, *extra]
  return args


def config_path(name: str) -> str:
  """A config path as given, or a shipped config's name (`tiny`, `multi30k_small`)."""
  shipped = CONFIGS_DIR / f"{name}.yaml"
  return str(shipped) if not Path(name).is_file() and shipped.is_file() else name
