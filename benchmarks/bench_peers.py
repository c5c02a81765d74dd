#!/usr/bin/env python
"""Decoding speed against the fastest CPU engines: jaxformer, Hugging Face transformers
(`MarianMTModel.generate`, PyTorch) and CTranslate2 (`Translator.translate_batch`), greedy and
beam search, on one model shape and one batch of random sources.

All engines run the same weights: a random init of `--config`'s model (default
configs/multi30k_small.yaml: post-LN, static sinusoidal positions, one embedding shared by
encoder, decoder and logits, ReLU, embeddings x sqrt(d_model); Vaswani et al. 2017, sections
3.1-3.5), exported to transformers' `MarianMTModel` by `jaxformer.interop.hf_export` (the one
mapping from our params to Marian's) and converted from that to CTranslate2 by
`jaxformer.interop.ctranslate2`. Every engine decodes the same int32 sources
`[batch, src_len]` (ids in [4, vocab)) for exactly `--new-tokens` tokens per row: EOS can never
end a row (jaxformer: an EOS id no argmax returns; transformers: min_new_tokens; CTranslate2:
min_decoding_length), so all do the same work whatever the random weights predict.

Marian keeps its pad token as one extra id at the end of the vocabulary (`vocab + 1` rows in
transformers, never generated; the converter drops it, leaving CTranslate2 with `vocab` rows as
jaxformer).

`--quantize int8` runs jaxformer with int8 weights and int8 products (`inference.quantize`, every
kernel quantized, as `--quantize int8` restores them) and CTranslate2 with `compute_type="int8"` on
the same converted float32 model (it quantizes at load); transformers stays float32.

Timing: one process, float32 (or the int8 above), the same thread count for all (`--threads`, default every usable
CPU: XLA:CPU's pool through NPROC, `torch.set_num_threads`, CTranslate2's intra_threads with one
inter thread). Each of the six decoders runs once untimed (compiles, first-call set-up), then
`--rounds` interleaved rounds (jaxformer, transformers, CTranslate2, jaxformer, ...) so load from
other processes falls on all engines alike; the median round gives target tokens/s
= batch x new tokens / seconds. On a shared machine read the ratios, not the absolute figures, and
keep `--threads` below the idle cores: torch and CTranslate2 (OpenMP) slow down many-fold when a
thread of theirs waits for a core.

  PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/bench_peers.py > /tmp/bench_peers.txt

Needs the `peers` extra (`pip install -e .[peers]`). Prints a table; the last stdout line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ctranslate2
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models

from jaxformer import sharding as sh
from jaxformer.config import Config, ConfigError, load_config
from jaxformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from jaxformer.inference.quantize import quantize_params
from jaxformer.interop.ctranslate2 import convert
from jaxformer.interop.hf_export import hf_model, select_mapping
from jaxformer.runtime.startup import build_mesh
from jaxformer.tasks import get_task

Decoder = Callable[[np.ndarray], np.ndarray]  # int32 sources [batch, src_len] -> ids [batch, new_tokens]
ENGINES = ("jaxformer", "transformers", "ctranslate2")
PAUSE_S = 0.1  # between timed calls: lets one engine's OpenMP threads stop spinning before the next runs


def random_sources(batch: int, src_len: int, vocab: int, seed: int) -> np.ndarray:
  """int32 `[batch, src_len]`: random ids in [4, vocab) (no special tokens), no padding."""
  return np.random.default_rng(seed).integers(4, vocab, (batch, src_len)).astype(np.int32)


def jaxformer_params(cfg: Config, seed: int) -> Any:
  """A random init (float32 params pytree) of `cfg`'s model."""
  model = get_task(cfg).make_model()
  ids = jnp.ones((1, 1), jnp.int32)
  return jax.jit(lambda k: nn.meta.unbox(model.init(k, ids, ids)["params"]))(jax.random.key(seed))


def jaxformer_decoder(cfg: Config, params: Any, beam_size: int, src_len: int, new_tokens: int) -> Decoder:
  """jaxformer's greedy (beam_size 1) or beam search over sources of `src_len` tokens, exactly
  `new_tokens` per row (the only code here that calls jaxformer's decoding API).

  Raises:
    ConfigError: new_tokens < src_len or > model.max_length (today's API sets the output length
      to src_len + extra_tokens, capped by the cache size).
  """
  # Imported here, so a change of decoding API touches one function.
  from jaxformer.inference.decode import SearchOptions, make_decode_fn

  if not src_len <= new_tokens <= cfg.model.max_length:
    raise ConfigError(
      f"jaxformer decodes src_len + extra tokens: --new-tokens must be in [--src-len={src_len}, "
      f"model.max_length={cfg.model.max_length}], got {new_tokens}"
    )
  options = SearchOptions(beam_size=beam_size, extra_tokens=new_tokens - src_len, eos_id=-1)  # -1: never argmax
  decode = make_decode_fn(
    get_task(cfg).make_model(), build_mesh(cfg), cfg.model.max_length, options, rules=sh.rules_for(cfg.mesh)
  )

  def run(inputs: np.ndarray) -> np.ndarray:
    return np.asarray(decode(params, jnp.asarray(inputs)))

  return run


def marian_model(cfg: Config, params: Any) -> transformers.MarianMTModel:
  """`params` of `cfg`'s model as a float32 `MarianMTModel` in eval mode (`interop.hf_export`).

  Raises:
    ConfigError: `cfg`'s model has no Marian counterpart (one line naming the options).
  """
  if select_mapping(cfg).ARCHITECTURE != "MarianMTModel":
    raise ConfigError(f"the peers are Marian models; {cfg.model.kind} maps to {select_mapping(cfg).ARCHITECTURE}")
  return hf_model(cfg, params)


def transformers_decoder(model: transformers.MarianMTModel, beam_size: int, new_tokens: int) -> Decoder:
  """`model.generate` (KV cache, do_sample False) of exactly `new_tokens` tokens per row; the
  export's generation config suppresses both pads (ours, id 0, and Marian's extra last id), so
  all engines choose among the same ids."""

  def run(inputs: np.ndarray) -> np.ndarray:
    ids = torch.from_numpy(inputs.astype(np.int64))
    with torch.inference_mode():
      out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        num_beams=beam_size,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
      )
    return out[:, 1:].numpy()  # column 0 is the decoder-start token (BOS)

  return run


def token_names(vocab_size: int) -> list[str]:
  """Strings for ids 0..vocab_size (CTranslate2 takes tokens, not ids); the last, vocab_size, is
  Marian's `<pad>`, which the converter drops."""
  special = {PAD_ID: "<blank>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
  return [special.get(i, f"w{i}") for i in range(vocab_size)] + ["<pad>"]


def ctranslate2_translator(
  model: transformers.MarianMTModel, directory: str | Path, threads: int, compute_type: str = "float32"
) -> ctranslate2.Translator:
  """`model` saved with `save_pretrained` (plus a word-level tokenizer over `token_names`: random
  weights have no SentencePiece model) under `directory`/hf, converted to float32 CTranslate2 in
  `directory`/ct2 (`interop.ctranslate2.convert`), loaded on the CPU to run in `compute_type`
  (float32, or int8: quantized at load)."""
  names = token_names(model.config.vocab_size - 1)
  tokenizer = transformers.PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>")),
    unk_token="<unk>",
    eos_token="</s>",
    pad_token="<pad>",
  )
  hf_dir, ct2_dir = Path(directory) / "hf", Path(directory) / "ct2"
  model.save_pretrained(hf_dir)
  tokenizer.save_pretrained(hf_dir)
  convert(hf_dir, ct2_dir)
  return ctranslate2.Translator(
    str(ct2_dir), device="cpu", compute_type=compute_type, inter_threads=1, intra_threads=threads
  )


def ctranslate2_decoder(
  translator: ctranslate2.Translator, vocab_size: int, beam_size: int, new_tokens: int
) -> Decoder:
  """`translator.translate_batch` of exactly `new_tokens` tokens per row (ids in and out)."""
  names = token_names(vocab_size)
  ids = {n: i for i, n in enumerate(names)}

  def run(inputs: np.ndarray) -> np.ndarray:
    results = translator.translate_batch(
      [[names[i] for i in row] for row in inputs.tolist()],
      beam_size=beam_size,
      min_decoding_length=new_tokens,
      max_decoding_length=new_tokens,
      return_scores=False,
    )
    return np.array([[ids[t] for t in r.hypotheses[0]] for r in results])

  return run


def interleaved_seconds(
  decoders: dict[Any, Decoder], inputs: np.ndarray, rounds: int
) -> tuple[dict[Any, list[float]], dict[Any, np.ndarray]]:
  """Wall seconds of each decoder's call on `inputs` per round, and each one's output: one
  untimed call each (compiles, warm-up; its output is returned), then `rounds` rounds calling
  every decoder once, in order."""
  outputs = {name: decode(inputs) for name, decode in decoders.items()}
  seconds: dict[Any, list[float]] = {name: [] for name in decoders}
  for _ in range(rounds):
    for name, decode in decoders.items():
      time.sleep(PAUSE_S)
      start = time.perf_counter()
      decode(inputs)
      seconds[name].append(time.perf_counter() - start)
  return seconds, outputs


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--config", default="configs/multi30k_small.yaml", help="model shape (random weights)")
  p.add_argument("--batch-size", type=int, default=32, help="source rows decoded per call")
  p.add_argument("--src-len", type=int, default=20, help="tokens per source row")
  p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per row (EOS never stops a row)")
  p.add_argument("--beam-size", type=int, default=4, help="beam width of the beam-search runs")
  p.add_argument("--rounds", type=int, default=5, help="timed interleaved rounds (median reported)")
  p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads of every engine")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--quantize",
    choices=("int8",),
    default=None,
    help="jaxformer with int8 weights and products, CTranslate2 with compute_type=int8",
  )
  p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.d_model=512")
  return p


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark (see the module docstring); returns the exit status."""
  args = _parser().parse_args(argv)
  os.environ["NPROC"] = str(args.threads)  # XLA:CPU sizes its thread pool from it when the backend starts
  torch.set_num_threads(args.threads)
  transformers.logging.disable_progress_bar()
  try:
    cfg = load_config(args.config, args.overrides)
    if min(args.batch_size, args.src_len, args.new_tokens, args.beam_size, args.rounds, args.threads) < 1:
      raise ConfigError("--batch-size, --src-len, --new-tokens, --beam-size, --rounds and --threads must be >= 1")
    m = cfg.model
    params = jaxformer_params(cfg, args.seed)
    hf = marian_model(cfg, params)
    searches = {"greedy": 1, f"beam{args.beam_size}": args.beam_size}
    ours = jax.jit(lambda p: quantize_params(p, min_size=1))(params) if args.quantize else params
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
      translator = ctranslate2_translator(hf, tmp, args.threads, args.quantize or "float32")
      inputs = random_sources(args.batch_size, args.src_len, m.vocab_size, args.seed)
      decoders = {}
      for search, k in searches.items():
        engines = (
          jaxformer_decoder(cfg, ours, k, args.src_len, args.new_tokens),
          transformers_decoder(hf, k, args.new_tokens),
          ctranslate2_decoder(translator, m.vocab_size, k, args.new_tokens),
        )
        decoders.update({(search, e): d for e, d in zip(ENGINES, engines)})
      seconds, outputs = interleaved_seconds(decoders, inputs, args.rounds)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for (search, engine), out in outputs.items():  # tokens/s below assumes every row got all its tokens
    if out.shape != (args.batch_size, args.new_tokens):
      print(
        f"error: {engine} {search} returned ids of shape {out.shape}, not {(args.batch_size, args.new_tokens)}",
        file=sys.stderr,
      )
      return 1
  tokens = args.batch_size * args.new_tokens
  result: dict[str, Any] = {
    "model": cfg.name,
    "batch_size": args.batch_size,
    "src_len": args.src_len,
    "new_tokens": args.new_tokens,
    "rounds": args.rounds,
    "threads": args.threads,
    "quantize": args.quantize,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "versions": {
      "jax": jax.__version__,
      "torch": torch.__version__,
      "transformers": transformers.__version__,
      "ctranslate2": ctranslate2.__version__,
    },
  }
  print(
    f"{cfg.name}, {args.batch_size} rows x {args.new_tokens} new tokens, {args.threads} threads, "
    f"{args.quantize or 'float32'} (transformers float32), "
    f"median of {args.rounds} rounds: target tokens/s"
  )
  print("| search | jaxformer | transformers | ctranslate2 | jaxformer/transformers | jaxformer/ctranslate2 |")
  print("|---|---|---|---|---|---|")
  for search in searches:
    median = {e: statistics.median(seconds[(search, e)]) for e in ENGINES}
    rate = {e: tokens / median[e] for e in ENGINES}
    row = {
      **{f"{e}_s": median[e] for e in ENGINES},
      **{f"{e}_rounds_s": seconds[(search, e)] for e in ENGINES},
      **{f"{e}_tokens_per_s": rate[e] for e in ENGINES},
      "jaxformer_over_transformers": rate["jaxformer"] / rate["transformers"],
      "jaxformer_over_ctranslate2": rate["jaxformer"] / rate["ctranslate2"],
    }
    result[search] = row
    print(
      f"| {search} | {rate['jaxformer']:.0f} | {rate['transformers']:.0f} | {rate['ctranslate2']:.0f} | "
      f"{row['jaxformer_over_transformers']:.2f} | {row['jaxformer_over_ctranslate2']:.2f} |"
    )
  print(json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
