"""`jaxformer train | eval | translate | generate | bench | compile | config`: thin wiring of config, runtime and
the library.
`jaxformer plot | attention` live in cli_plots.py, `jaxformer export | import` in cli_interop.py,
the shared flags and argument types in cli_args.py.

User mistakes (bad config, mesh, paths, missing checkpoints) print one `error:` line and
exit with status 2; results are JSON lines on stdout (the last line of `eval` is one
JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from jaxformer import cli_interop, cli_plots
from jaxformer.cli_args import (
  CONFIG_HINT,
  CONFIGS_DIR,
  add_checkpoint_args,
  add_compile_args,
  add_distributed_args,
  add_draft_args,
  add_search_args,
  config_path,
  parse_command_line,
  positive_int,
  search_options,
)
from jaxformer.config import ConfigError, load_config, parse_override, runtime_from_overrides
from jaxformer.errors import CheckpointError, NonFiniteError


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxformer", description="Train and use Transformer models in JAX.",
                              epilog=CONFIG_HINT)
  sub = p.add_subparsers(dest="command", required=True)

  t = sub.add_parser("train", help="train (or resume) a model in a workdir", epilog=CONFIG_HINT)
  t.add_argument("--config", required=True, help="YAML config, e.g. configs/multi30k_small.yaml "
                 "(`jaxformer config --list` shows the shipped ones)")
  t.add_argument("--workdir", required=True, help="directory for checkpoints, logs, config and tokenizer")
  t.add_argument("--dry-run", action="store_true", help="print the sharding summary and exit without training")
  t.add_argument("--verbose", action="store_true", help="print every parameter's sharding at the start (as --dry-run)")
  add_distributed_args(t)
  t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.num_steps=100 mesh.data=4 "
                 "(`jaxformer config --show CONFIG` lists every key)")

  c = sub.add_parser("config", help="list the shipped configs, or show a resolved config with every key's "
                     "type, default and description")
  what = c.add_mutually_exclusive_group(required=True)
  what.add_argument("--list", action="store_true", help="the shipped configs with their one-line descriptions")
  what.add_argument("--show", metavar="CONFIG", help="a YAML config (path or shipped name) with overrides applied")
  c.add_argument("overrides", nargs="*", help="dotted overrides for --show, e.g. train.num_steps=100")

  e = sub.add_parser("eval", help="restore a checkpoint and report BLEU/chrF (translation) or validation "
                     "loss and perplexity (causal LM) or masked-token loss and accuracy (masked LM)")
  e.add_argument("--workdir", required=True)
  add_checkpoint_args(e)
  e.add_argument("--split", choices=("val", "test"), default=None,
                 help="the split to evaluate (default: test for translation, val for language models)")
  e.add_argument("--src", help="source file (one sentence per line) instead of --split")
  e.add_argument("--ref", help="reference file, line-aligned with --src")
  e.add_argument("--batch-size", type=positive_int, default=64, help="sentences per decoding batch")
  e.add_argument("--output", help="hypotheses file (default: WORKDIR/hypotheses.<split>.<greedy|beamK|sampleS>.txt; "
                 "a read-only WORKDIR gets them in a new temporary folder, named on stderr)")
  add_search_args(e)
  add_draft_args(e)
  e.add_argument("overrides", nargs="*", help="runtime/mesh overrides, e.g. runtime.num_cpu_devices=4 mesh.data=4")

  tr = sub.add_parser("translate", help="translate stdin lines to stdout")
  tr.add_argument("--workdir", required=True)
  add_checkpoint_args(tr)
  tr.add_argument("--batch-size", type=positive_int, default=64)
  add_search_args(tr)
  add_draft_args(tr)
  tr.add_argument("overrides", nargs="*")

  g = sub.add_parser("generate", help="sample text from a causal LM (decoder_only) with the KV cache")
  g.add_argument("--workdir", required=True)
  add_checkpoint_args(g)
  g.add_argument("--prompt", required=True, help="text to continue, e.g. $'\\n' or 'ROMEO:'")
  g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per sample")
  g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature > 0")
  g.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (0 = all)")
  g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = all)")
  g.add_argument("--seed", type=int, default=0, help="sampling seed: same seed, same text")
  g.add_argument("--num-samples", type=int, default=1, help="independent samples, separated by a '---' line")
  add_draft_args(g)
  g.add_argument("overrides", nargs="*")

  s = sub.add_parser("serve", help="serve a trained model over HTTP: OpenAI-compatible /v1/completions and "
                     "/v1/chat/completions, /v1/translate or /v1/generate, with continuous batching, streaming "
                     "(server-sent events), API keys, /health and /metrics")
  s.add_argument("--workdir", required=True)
  add_checkpoint_args(s)
  s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
  s.add_argument("--port", type=int, default=8000)
  s.add_argument("--max-batch", type=positive_int, default=8, help="requests decoded together per step")
  s.add_argument("--max-queue", type=positive_int, default=64, help="waiting requests at most; more get 503")
  s.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV-cache page")
  s.add_argument("--num-pages", type=positive_int, default=None,
                 help="KV-cache pages per pool (default: enough for --max-batch requests at model.max_length)")
  s.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request is cancelled (504)")
  s.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                 help="continuous: requests join the running batch at any step; static: a new batch starts only "
                 "when the running one has finished (for comparison)")
  s.add_argument("--api-key", default=None, metavar="KEY",
                 help="require 'Authorization: Bearer KEY' on every /v1/* route (default: $JAXFORMER_API_KEY; "
                 "none: open)")
  s.add_argument("--max-request-bytes", type=positive_int, default=1 << 20,
                 help="largest request body in bytes; larger ones get 413 (default: 1 MiB)")
  s.add_argument("--model-name", default=None, help="the model's id in /v1/models (default: the workdir's name)")
  s.add_argument("overrides", nargs="*", help="runtime/mesh overrides, e.g. runtime.num_cpu_devices=1")

  a = sub.add_parser("average", help="write the mean params of a run's last N checkpoints (paper section 6.1) "
                     "as a workdir that eval, translate and generate read")
  a.add_argument("--workdir", required=True)
  a.add_argument("--last", type=positive_int, required=True, help="how many of the newest checkpoints to average")
  a.add_argument("--output", default=None, help="the new workdir (default: WORKDIR/average-last-N)")
  a.add_argument("overrides", nargs="*", help="runtime/mesh overrides, e.g. runtime.num_cpu_devices=4")

  b = sub.add_parser("bench", help="time the train step on synthetic batches: compile time, tokens/s, MFU, "
                     "memory; also torch.nn.Transformer when PyTorch is installed")
  b.add_argument("--config", required=True)
  b.add_argument("--batch-size", type=positive_int, default=None,
                 help="sentence pairs per step (default: train.batch_size)")
  b.add_argument("--src-length", type=int, default=32, help="source tokens per pair")
  b.add_argument("--tgt-length", type=int, default=32, help="target tokens per pair")
  b.add_argument("--steps", type=int, default=10, help="timed steps after warm-up (the median is reported)")
  b.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
  b.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
  b.add_argument("--output", help="also write the JSON result to this file")
  b.add_argument("overrides", nargs="*",
                 help="dotted overrides, e.g. precision.policy=compute=bfloat16 runtime.num_cpu_devices=2")

  co = sub.add_parser("compile", help="compile the train step (or, with --decode, the decode step and prefill) "
                      "ahead of time for N simulated devices, a TPU topology or described GPUs, without running it: "
                      "per-device memory and whether it fits")
  add_compile_args(co)
  cli_plots.add_parsers(sub)
  cli_interop.add_parsers(sub)
  return p


def cmd_train(args) -> None:
  """`jaxformer train`: trains (or resumes) `--config` in `--workdir`."""
  from jaxformer import interrupt
  interrupt.install()   # before any library starts a thread (they inherit the blocked SIGINT/SIGTERM)
  config = load_config(config_path(args.config), args.overrides)   # before any JAX import: a typo fails fast
  from jaxformer.distributed import initialize_from_args
  from jaxformer.runtime import init_runtime
  initialize_from_args(args)  # before any other JAX use
  init_runtime(config.runtime)
  from jaxformer.train.loop import train
  train(config, args.workdir, dry_run=args.dry_run, verbose=args.verbose)


def cmd_eval(args) -> None:
  """`jaxformer eval`: scores a workdir's checkpoint on a split; prints one JSON line last."""
  for o in args.overrides:
    parse_override(o)
  from jaxformer.runtime import init_runtime
  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer import evaluate
  from jaxformer.data import PAIRS
  from jaxformer.inference import restore as inference_restore
  from jaxformer.tasks import get_task
  from jaxformer.tasks.base import EvalOptions
  search = search_options(args)
  config = inference_restore.workdir_config(args.workdir, args.overrides)
  task = get_task(config)
  output = evaluate.hypotheses_destination(args.output, args.workdir) if task.data_kind == PAIRS else None
  restored = []

  def restore():
    restored.append(inference_restore.restore(args.workdir, config, args.step, args.average_last, args.quantize))
    return restored[-1]

  def draft():
    return inference_restore.restore_draft(args.draft_workdir, restored[-1], args.overrides, args.draft_tokens,
                                           args.quantize)
  options = EvalOptions(split=args.split, src=args.src, ref=args.ref, batch_size=args.batch_size, search=search,
                        output=output, workdir=args.workdir, draft=draft if args.draft_workdir else None)

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
  from jaxformer.runtime import init_runtime
  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer import average
  from jaxformer.inference import restore as inference_restore
  output = Path(args.output) if args.output else average.default_output(args.workdir, args.last)
  if output.exists():   # before reading any checkpoint
    raise ValueError(f"{output} already exists; remove it or pass another --output")
  config = inference_restore.workdir_config(args.workdir, args.overrides)
  restored = inference_restore.restore(args.workdir, config, average_last=args.last)
  average.write_averaged(args.workdir, output, restored.averaged, restored.params)
  print(json.dumps({"workdir": str(output), "averaged_steps": restored.averaged}), flush=True)


def cmd_translate(args) -> None:
  """`jaxformer translate`: translates the UTF-8 lines of stdin with a workdir's model, one per line."""
  from jaxformer.runtime import init_runtime
  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer import evaluate
  from jaxformer.inference import restore as inference_restore
  search = search_options(args)
  config = inference_restore.workdir_config(args.workdir, args.overrides)
  from jaxformer.data import PAIRS
  from jaxformer.tasks import get_task
  if get_task(config).data_kind != PAIRS:
    raise ValueError(f"{args.workdir} holds a language model (model.kind={config.model.kind}); translate needs a "
                     "translation model, and `jaxformer generate` samples from a causal LM")
  restored = inference_restore.restore(args.workdir, config, args.step, args.average_last, args.quantize)
  draft = (inference_restore.restore_draft(args.draft_workdir, restored, args.overrides, args.draft_tokens,
                                           args.quantize) if args.draft_workdir else None)
  lines = []
  for number, raw in enumerate(sys.stdin.buffer, 1):
    try:
      lines.append(raw.decode("utf-8").rstrip("\r\n"))
    except UnicodeDecodeError as e:
      raise ValueError(f"stdin line {number} is not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                       f"{e.start + 1}); translate reads UTF-8 text") from None
  if lines:
    hyps, _ = evaluate.translate(restored, lines, args.batch_size, search, draft)
    sys.stdout.write("".join(h + "\n" for h in hyps))


def cmd_generate(args) -> None:
  """`jaxformer generate`: continues a prompt with a workdir's language model."""
  from jaxformer.runtime import init_runtime
  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer.inference import generate as lm
  from jaxformer.inference import restore as inference_restore
  config = inference_restore.workdir_config(args.workdir, args.overrides)
  if args.draft_workdir and args.top_k != 1:
    raise ValueError("speculative decoding (--draft-workdir) is greedy: pass --top-k 1")
  restored = inference_restore.restore(args.workdir, config, args.step, args.average_last, args.quantize)
  draft = (inference_restore.restore_draft(args.draft_workdir, restored, args.overrides, args.draft_tokens,
                                           args.quantize) if args.draft_workdir else None)
  texts = lm.generate(restored, args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, seed=args.seed, num_samples=args.num_samples, draft=draft)
  sys.stdout.write("\n---\n".join(args.prompt + t for t in texts) + "\n")


def cmd_serve(args) -> None:
  """`jaxformer serve`: serves a workdir's model over HTTP until interrupted."""
  from jaxformer.runtime import init_runtime
  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer import serve
  from jaxformer.inference import restore as inference_restore
  config = inference_restore.workdir_config(args.workdir, args.overrides)
  restored = inference_restore.restore(args.workdir, config, args.step, args.average_last, args.quantize)
  from jaxformer.serve.auth import resolve_api_key
  serve.serve(restored, host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
              page_size=args.page_size, num_pages=args.num_pages, request_timeout=args.request_timeout,
              batching=args.batching, api_key=resolve_api_key(args.api_key),
              max_request_bytes=args.max_request_bytes, model_name=args.model_name)


def cmd_bench(args) -> None:
  """`jaxformer bench`: times the train step of `--config`; prints one JSON line."""
  config = load_config(config_path(args.config), args.overrides)
  from jaxformer.runtime import init_runtime
  init_runtime(config.runtime)
  from jaxformer import bench
  options = bench.BenchOptions(args.batch_size or config.train.batch_size, args.src_length, args.tgt_length,
                               args.steps, args.warmup, peer=not args.no_torch).validate(config.model)
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
  from jaxformer import aot
  hbm = aot.parse_size(args.hbm) if args.hbm else aot.device_memory(args.topology)
  from jaxformer.runtime import init_runtime, quiet_libtpu
  if args.topology:
    quiet_libtpu()   # before any backend starts
  init_runtime(config.runtime)
  devices = aot.topology_devices(args.topology) if args.topology else None
  if args.decode:
    from jaxformer import aot_decode
    result = aot_decode.compile_decode(config, devices, hbm, args.context, args.page_size or 0)
    print(aot_decode.format_report(result), flush=True)
  else:
    result = aot.compile_train_step(config, devices, hbm)
    print(aot.format_report(result), flush=True)
  print(json.dumps(result), flush=True)


def cmd_config(args) -> None:
  """`jaxformer config`: lists the shipped configs, or prints every key of one (value, type, default, help)."""
  if args.list:
    configs = []
    for path in sorted(CONFIGS_DIR.glob("*.yaml")):
      head = []
      for line in path.read_text().splitlines():   # the leading comment block, up to its first full stop
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
  from jaxformer.schema import describe
  config = load_config(config_path(args.show), args.overrides)
  rows = describe(config)
  width = max(len(r["key"]) for r in rows)
  for r in rows:
    value = json.dumps(r["value"])
    default = "" if r["value"] == r["default"] else f", default {json.dumps(r['default'])}"
    print(f"{r['key'].ljust(width)} = {value}  ({r['type']}{default})  {r['description']}")
  print(json.dumps(to_dict(config)), flush=True)


def main(argv: list[str] | None = None) -> int:
  """Runs the `jaxformer` command line `argv` (default: `sys.argv[1:]`).

  Returns:
    The exit status: 0, or 2 after printing a user mistake as one `error:` line on stderr.
  """
  commands = {"train": cmd_train, "eval": cmd_eval, "translate": cmd_translate, "generate": cmd_generate,
              "serve": cmd_serve, "average": cmd_average, "bench": cmd_bench, "compile": cmd_compile,
              "config": cmd_config,
              **cli_plots.COMMANDS, **cli_interop.COMMANDS}
  try:
    args = parse_command_line(_parser(), argv)   # inside: a Ctrl-C while parsing exits 130 like one during the command
    commands[args.command](args)
  except (ConfigError, CheckpointError, NonFiniteError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    from jaxformer.interrupt import exit_interrupted
    exit_interrupted()   # status 130 (SIGINT) or 143 (SIGTERM), without a teardown that native threads could race
  except BrokenPipeError:   # stdout closed early (`| head`): stop quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
