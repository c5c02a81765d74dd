#!/usr/bin/env python
"""Greedy translations of a trained encoder-decoder by jaxformer and by CTranslate2, after
`jaxformer export --format hf` and CTranslate2's Transformers converter
(`jaxformer.interop.ctranslate2`): the share of identical sentences, and the differing ones.

Both decode at most model.max_length target tokens (EOS included) per sentence, so any
difference left is float rounding at a near tie of the two best logits (Marian's LayerNorm
epsilon is 1e-5, ours 1e-6, and the engines sum in other orders); each differing sentence is
printed with both translations.

  PYTHONPATH=. .venv/bin/python benchmarks/ct2_agreement.py --workdir runs/multi30k_small > ct2.txt

Needs the `peers` extra. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compare(workdir: str, sources: list[str], batch_size: int = 64, threads: int = 2) -> dict:
  """Exports `workdir`, converts it, translates `sources` with both engines; returns
  `{"sentences", "identical", "fraction", "differing": [{"index", "jaxformer", "ctranslate2"}]}`."""
  from jaxformer.inference import restore as inference_restore
  from jaxformer.inference.options import SearchOptions
  from jaxformer.interop import ctranslate2 as ct2
  from jaxformer.interop.hf_export import export_workdir
  from jaxformer.tasks import evaluate

  config = inference_restore.workdir_config(workdir)
  max_length = config.model.max_length
  restored = inference_restore.restore(workdir, config)
  ours, _ = evaluate.translate(restored, sources, batch_size, SearchOptions(extra_tokens=max_length))
  with tempfile.TemporaryDirectory(prefix="ct2-agreement-") as tmp:
    export_workdir(workdir, Path(tmp) / "hf")
    ct2.convert(Path(tmp) / "hf", Path(tmp) / "ct2")
    theirs = ct2.translate(Path(tmp) / "ct2", Path(tmp) / "hf", sources, max_length, batch_size, threads)
  differing = [{"index": i, "jaxformer": a, "ctranslate2": b} for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
  same = len(sources) - len(differing)
  return {"sentences": len(sources), "identical": same, "fraction": same / len(sources), "differing": differing}


def main(argv: list[str] | None = None) -> int:
  """Runs the comparison (see the module docstring); returns the exit status."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="a trained encoder-decoder workdir")
  p.add_argument("--src", default=None, help="source sentences, one a line (default: test2016 of the source side)")
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--threads", type=int, default=2, help="CTranslate2 intra threads")
  args = p.parse_args(argv)
  from jaxformer.inference import restore as inference_restore

  lang = inference_restore.workdir_config(args.workdir).data.source_lang
  src = Path(args.src) if args.src else ROOT / "jaxformer" / "data" / "raw" / "multi30k" / f"test_2016_flickr.{lang}.gz"
  opener = gzip.open if src.suffix == ".gz" else open
  with opener(src, "rt", encoding="utf-8") as f:
    sources = f.read().splitlines()
  result = compare(args.workdir, sources, args.batch_size, args.threads)
  for d in result["differing"]:
    print(f"{d['index']}:\n  jaxformer:   {d['jaxformer']}\n  ctranslate2: {d['ctranslate2']}")
  print(f"identical: {result['identical']}/{result['sentences']} ({100 * result['fraction']:.1f}%)")
  print(json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
