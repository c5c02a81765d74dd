"""`jaxformer export | import`: Hugging Face interop (the parsers and handlers `jaxformer.cli` registers).

Each prints one JSON line last, naming the directory it wrote.
"""

from __future__ import annotations

import argparse
import json

from jaxformer.cli.args import positive_int


def add_parsers(sub) -> None:
  """Adds the `export` and `import` subcommands to the `jaxformer` subparsers `sub`."""
  x = sub.add_parser(
    "export",
    help="write a workdir's model as a Hugging Face Transformers directory (config, "
    "safetensors weights, tokenizer): MarianMTModel, LlamaForCausalLM, GPT2LMHeadModel or "
    "XLMRobertaXLForMaskedLM, whichever its options map to",
  )
  x.add_argument("--workdir", required=True)
  x.add_argument("--format", choices=("hf",), required=True, help="hf: Hugging Face Transformers")
  x.add_argument("--out", required=True, help="the new directory (must not exist)")
  which = x.add_mutually_exclusive_group()
  which.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  which.add_argument(
    "--average-last",
    type=positive_int,
    default=None,
    metavar="N",
    help="the mean params of the newest N checkpoints (paper section 6.1)",
  )
  x.add_argument(
    "--lora-format",
    choices=("merged", "peft"),
    default="merged",
    help="a LoRA workdir (model.lora_rank > 0): merged (default) folds the adapters into the weights; "
    "peft writes a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) with the "
    "frozen base model in OUT/base (the Llama family only)",
  )
  x.add_argument("overrides", nargs="*", help="runtime/mesh overrides, e.g. runtime.num_cpu_devices=1")

  im = sub.add_parser(
    "import",
    help="build a workdir from a local Hugging Face directory of a supported "
    "architecture (see export), to evaluate or fine-tune it; nothing downloads",
  )
  im.add_argument("--from-hf", required=True, metavar="DIR", help="a local Hugging Face model directory")
  im.add_argument("--workdir", required=True, help="the new workdir (must not exist)")


def cmd_export(args: argparse.Namespace) -> None:
  """`jaxformer export --format hf`: writes a workdir's model as a Hugging Face directory."""
  from jaxformer.config import runtime_from_overrides
  from jaxformer.runtime.startup import init_runtime

  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer.interop.hf_export import export_workdir

  print(
    json.dumps(export_workdir(args.workdir, args.out, args.step, args.average_last, args.overrides, args.lora_format)),
    flush=True,
  )


def cmd_import(args: argparse.Namespace) -> None:
  """`jaxformer import --from-hf`: builds a workdir from a local Hugging Face directory."""
  from jaxformer.config import runtime_from_overrides
  from jaxformer.runtime.startup import init_runtime

  init_runtime(runtime_from_overrides([]))
  from jaxformer.interop.hf_import import import_hf

  print(json.dumps(import_hf(args.from_hf, args.workdir)), flush=True)


COMMANDS = {"export": cmd_export, "import": cmd_import}
