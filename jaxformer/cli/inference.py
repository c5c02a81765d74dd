"""`jaxformer translate | generate | serve`: using a trained model (the parsers and handlers `jaxformer.cli`
registers)."""

from __future__ import annotations

import sys

from jaxformer.cli.args import add_checkpoint_args, add_draft_args, add_search_args, positive_int, search_options
from jaxformer.config import runtime_from_overrides


def add_parsers(sub) -> None:
  """Adds the `translate`, `generate` and `serve` subcommands to the `jaxformer` subparsers `sub`."""
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

  s = sub.add_parser(
    "serve",
    help="serve a trained model over HTTP: OpenAI-compatible /v1/completions and "
    "/v1/chat/completions, /v1/translate or /v1/generate, with continuous batching, streaming "
    "(server-sent events), API keys, /health and /metrics",
  )
  s.add_argument("--workdir", required=True)
  add_checkpoint_args(s)
  s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
  s.add_argument("--port", type=int, default=8000)
  s.add_argument("--max-batch", type=positive_int, default=8, help="requests decoded together per step")
  s.add_argument("--max-queue", type=positive_int, default=64, help="waiting requests at most; more get 503")
  s.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV-cache page")
  s.add_argument(
    "--num-pages",
    type=positive_int,
    default=None,
    help="KV-cache pages per pool (default: enough for --max-batch requests at model.max_length)",
  )
  s.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request is cancelled (504)")
  s.add_argument(
    "--batching",
    choices=("continuous", "static"),
    default="continuous",
    help="continuous: requests join the running batch at any step; static: a new batch starts only "
    "when the running one has finished (for comparison)",
  )
  s.add_argument(
    "--api-key",
    default=None,
    metavar="KEY",
    help="require 'Authorization: Bearer KEY' on every /v1/* route (default: $JAXFORMER_API_KEY; none: open)",
  )
  s.add_argument(
    "--max-request-bytes",
    type=positive_int,
    default=1 << 20,
    help="largest request body in bytes; larger ones get 413 (default: 1 MiB)",
  )
  s.add_argument("--model-name", default=None, help="the model's id in /v1/models (default: the workdir's name)")
  s.add_argument("overrides", nargs="*", help="runtime/mesh overrides, e.g. runtime.num_cpu_devices=1")


def cmd_translate(args) -> None:
  """`jaxformer translate`: translates the UTF-8 lines of stdin with a workdir's model, one per line."""
  from jaxformer.runtime.startup import init_runtime

  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer.inference import restore as inference_restore
  from jaxformer.tasks import evaluate

  search = search_options(args)
  config = inference_restore.workdir_config(args.workdir, args.overrides)
  from jaxformer.tasks import get_task

  if not get_task(config).translates:
    raise ValueError(
      f"{args.workdir} holds a language model (model.kind={config.model.kind}); translate needs a "
      "translation model, and `jaxformer generate` samples from a causal LM"
    )
  restored = inference_restore.restore(args.workdir, config, args.step, args.average_last, args.quantize)
  draft = (
    inference_restore.restore_draft(args.draft_workdir, restored, args.overrides, args.draft_tokens, args.quantize)
    if args.draft_workdir
    else None
  )
  lines = []
  for number, raw in enumerate(sys.stdin.buffer, 1):
    try:
      lines.append(raw.decode("utf-8").rstrip("\r\n"))
    except UnicodeDecodeError as e:
      raise ValueError(
        f"stdin line {number} is not valid UTF-8 (byte {raw[e.start]:#04x} at column "
        f"{e.start + 1}); translate reads UTF-8 text"
      ) from None
  if lines:
    hyps, _ = evaluate.translate(restored, lines, args.batch_size, search, draft)
    sys.stdout.write("".join(h + "\n" for h in hyps))


def cmd_generate(args) -> None:
  """`jaxformer generate`: continues a prompt with a workdir's language model."""
  from jaxformer.runtime.startup import init_runtime

  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer.inference import generate as lm
  from jaxformer.inference import restore as inference_restore

  config = inference_restore.workdir_config(args.workdir, args.overrides)
  if args.draft_workdir and args.top_k != 1:
    raise ValueError("speculative decoding (--draft-workdir) is greedy: pass --top-k 1")
  restored = inference_restore.restore(args.workdir, config, args.step, args.average_last, args.quantize)
  draft = (
    inference_restore.restore_draft(args.draft_workdir, restored, args.overrides, args.draft_tokens, args.quantize)
    if args.draft_workdir
    else None
  )
  texts = lm.generate(
    restored,
    args.prompt,
    args.max_new_tokens,
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    seed=args.seed,
    num_samples=args.num_samples,
    draft=draft,
  )
  sys.stdout.write("\n---\n".join(args.prompt + t for t in texts) + "\n")


def cmd_serve(args) -> None:
  """`jaxformer serve`: serves a workdir's model over HTTP until interrupted."""
  from jaxformer.runtime.startup import init_runtime

  init_runtime(runtime_from_overrides(args.overrides))
  from jaxformer import serve
  from jaxformer.inference import restore as inference_restore

  config = inference_restore.workdir_config(args.workdir, args.overrides)
  restored = inference_restore.restore(args.workdir, config, args.step, args.average_last, args.quantize)
  from jaxformer.serve.auth import resolve_api_key

  serve.serve(
    restored,
    host=args.host,
    port=args.port,
    max_batch=args.max_batch,
    max_queue=args.max_queue,
    page_size=args.page_size,
    num_pages=args.num_pages,
    request_timeout=args.request_timeout,
    batching=args.batching,
    api_key=resolve_api_key(args.api_key),
    max_request_bytes=args.max_request_bytes,
    model_name=args.model_name,
  )


COMMANDS = {"translate": cmd_translate, "generate": cmd_generate, "serve": cmd_serve}
