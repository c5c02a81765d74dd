#!/usr/bin/env python
"""What int8 costs in translation quality, ours against CTranslate2's: test2016 BLEU of a trained
encoder-decoder decoded in float32 and in int8 by jaxformer (`--quantize int8`: int8 weights and
int8 products, `inference.quantize`) and by CTranslate2 (the exported model, `compute_type`
float32 and int8), greedy and beam search.

Each engine is compared with itself: the BLEU loss is its int8 score minus its float32 score.
Both decode at most model.max_length target tokens (EOS included) per sentence; beam search uses
each engine's own length normalisation (ours GNMT alpha 0.6, CTranslate2's default).

  PYTHONPATH=. .venv/bin/python benchmarks/int8_bleu.py --workdir runs/multi30k_small > int8_bleu.txt

Needs the `peers` extra. Prints a table; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lines(path: Path) -> list[str]:
  with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
    return f.read().splitlines()


def ours(workdir: str, sources: list[str], beams: list[int], batch_size: int) -> dict[tuple[str, int], list[str]]:
  """jaxformer's translations of `sources`: {(compute type, beam size): hypotheses}."""
  from jaxformer.inference import restore as inference_restore
  from jaxformer.inference.options import SearchOptions
  from jaxformer.tasks import evaluate

  config = inference_restore.workdir_config(workdir)
  out = {}
  for compute_type, quantize in (("float32", None), ("int8", "int8")):
    restored = inference_restore.restore(workdir, config, quantize=quantize)
    for k in beams:
      search = SearchOptions(beam_size=k, extra_tokens=config.model.max_length)
      out[(compute_type, k)] = evaluate.translate(restored, sources, batch_size, search)[0]
  return out


def theirs(
  workdir: str, sources: list[str], beams: list[int], batch_size: int, threads: int
) -> dict[tuple[str, int], list[str]]:
  """CTranslate2's translations of `sources` by the exported, converted model (float32 weights,
  run as float32 and as int8): {(compute type, beam size): hypotheses}."""
  import ctranslate2
  from transformers import AutoTokenizer

  from jaxformer.inference import restore as inference_restore
  from jaxformer.interop import ctranslate2 as ct2
  from jaxformer.interop.hf_export import export_workdir

  max_length = inference_restore.workdir_config(workdir).model.max_length
  out = {}
  with tempfile.TemporaryDirectory(prefix="int8-bleu-") as tmp:
    hf_dir, ct2_dir = Path(tmp) / "hf", Path(tmp) / "ct2"
    export_workdir(workdir, hf_dir)
    ct2.convert(hf_dir, ct2_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(sources)["input_ids"]]
    for compute_type in ("float32", "int8"):
      translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=compute_type, intra_threads=threads)
      for k in beams:
        results = translator.translate_batch(
          tokens, beam_size=k, max_batch_size=batch_size, max_decoding_length=max_length
        )
        out[(compute_type, k)] = [
          tokenizer.decode(tokenizer.convert_tokens_to_ids(r.hypotheses[0]), skip_special_tokens=True) for r in results
        ]
  return out


def main(argv: list[str] | None = None) -> int:
  """Runs the comparison (see the module docstring); returns the exit status."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="a trained encoder-decoder workdir (Marian-exportable)")
  p.add_argument("--beams", default="1,4", help="beam sizes, comma-separated (1: greedy)")
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--threads", type=int, default=2, help="CTranslate2 intra threads")
  args = p.parse_args(argv)
  from jaxformer.inference import restore as inference_restore
  from jaxformer.tasks.evaluate import score

  data = inference_restore.workdir_config(args.workdir).data
  raw = ROOT / "jaxformer" / "data" / "raw" / "multi30k"
  sources = _lines(raw / f"test_2016_flickr.{data.source_lang}.gz")
  references = _lines(raw / f"test_2016_flickr.{data.target_lang}.gz")
  beams = [int(b) for b in args.beams.split(",")]
  engines = {
    "jaxformer": ours(args.workdir, sources, beams, args.batch_size),
    "ctranslate2": theirs(args.workdir, sources, beams, args.batch_size, args.threads),
  }
  result: dict = {"workdir": args.workdir, "sentences": len(sources)}
  print("| engine | beam | float32 BLEU | int8 BLEU | int8 - float32 |")
  print("|---|---|---|---|---|")
  for engine, hyps in engines.items():
    for k in beams:
      f32, i8 = (score(hyps[(t, k)], references)["bleu"] for t in ("float32", "int8"))
      result[f"{engine}_beam{k}"] = {"float32": f32, "int8": i8, "loss": round(f32 - i8, 2)}
      print(f"| {engine} | {k} | {f32:.2f} | {i8:.2f} | {i8 - f32:+.2f} |")
  print(json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
