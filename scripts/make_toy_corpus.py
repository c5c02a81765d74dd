#!/usr/bin/env python3
"""Writes a small example corpus in every format `data.dataset=files` reads, for the README.

The "other language" is Pig Latin made from the shipped Multi30k English captions (a word's
leading consonants move to its end, followed by "ay"; a vowel-initial word gets "way"), so a
model has a real, learnable mapping between two languages other than en-de:

  OUT/{train,valid,test}.en, OUT/{train,valid,test}.pig   aligned plain-text files
  OUT/train.jsonl, OUT/train.tsv                          the same pairs as JSONL / TSV (fields en, pig)
  OUT/captions.txt                                        documents (paragraphs of 5 captions) for a causal LM
  OUT/captions.jsonl                                      the same documents as JSONL (field text) for a masked LM

Usage: python scripts/make_toy_corpus.py OUT [--train-pairs N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

RAW = Path(__file__).resolve().parent.parent / "jaxformer" / "data" / "raw" / "multi30k"


def pig_latin(sentence: str) -> str:
  """Each alphabetic word of `sentence` in Pig Latin; punctuation and case stay in place."""

  def word(match: re.Match) -> str:
    w = match.group(0)
    head = re.match(r"[^aeiouAEIOU]*", w).group(0)
    if not head or len(head) == len(w):
      return w + ("way" if not head else "ay")
    out = w[len(head) :] + head.lower() + "ay"
    return out[0].upper() + out[1:] if w[0].isupper() else out

  return re.sub(r"[A-Za-z]+", word, sentence)


def read(name: str) -> list[str]:
  """The non-empty, stripped lines of the gzipped shipped file `name`."""
  with gzip.open(RAW / name, "rt", encoding="utf-8") as f:
    return [line.strip() for line in f if line.strip()]


def main() -> None:
  """Writes the corpus (see the module docstring)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out", type=Path)
  parser.add_argument("--train-pairs", type=int, default=29000, help="train pairs to write (at most 29000)")
  args = parser.parse_args()
  args.out.mkdir(parents=True, exist_ok=True)
  splits = {
    "train": read("train.en.gz")[: args.train_pairs],
    "valid": read("val.en.gz"),
    "test": read("test_2016_flickr.en.gz"),
  }
  for split, english in splits.items():
    (args.out / f"{split}.en").write_text("".join(s + "\n" for s in english), encoding="utf-8")
    (args.out / f"{split}.pig").write_text("".join(pig_latin(s) + "\n" for s in english), encoding="utf-8")
  train = splits["train"]
  with open(args.out / "train.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps({"en": s, "pig": pig_latin(s)}) + "\n" for s in train)
  with open(args.out / "train.tsv", "w", encoding="utf-8") as f:
    f.write("en\tpig\n")
    f.writelines(f"{s}\t{pig_latin(s)}\n" for s in train)
  docs = ["\n".join(train[i : i + 5]) for i in range(0, len(train), 5)]
  (args.out / "captions.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
  with open(args.out / "captions.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
  print(f"wrote {len(train)} train pairs (en -> pig) and {len(docs)} documents to {args.out}")


if __name__ == "__main__":
  main()
