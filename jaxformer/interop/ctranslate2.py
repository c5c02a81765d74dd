"""CTranslate2 conversion of an exported encoder-decoder (`hf_export`, `MarianMTModel`).

CTranslate2's Transformers converter reads the exported directory as it reads any Marian
model; two Marian conventions it assumes differ from ours, and `Converter` corrects them in
the converted spec, so CTranslate2 decodes our model:
  * Marian starts the decoder from a zero embedding (its pad); ours starts from BOS (`<s>`);
  * our PAD (`<blank>`, id 0) is never generated: its output bias is -1e9, as our decoding
    masks it (`inference.cache.no_pad`). The extra Marian pad (the last id) the converter drops.
Needs the `peers` extra (ctranslate2).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxformer.data.tokenizer import BOS_ID, PAD_ID

NEVER = -1e9  # the output bias of a token that is never generated


def _converter_class():
  import ctranslate2  # noqa: PLC0415  (the peers extra)

  class Converter(ctranslate2.converters.TransformersConverter):
    """`TransformersConverter` for `hf_export`'s Marian directories (see the module docstring)."""

    def _load(self):
      spec = super()._load()
      vocabulary = spec.target_vocabularies[0] if hasattr(spec, "target_vocabularies") else None
      spec.decoder.start_from_zero_embedding = False
      spec.config.decoder_start_token = vocabulary[BOS_ID] if vocabulary else "<s>"
      bias = np.zeros(spec.decoder.projection.weight.shape[0], np.float32)
      if spec.decoder.projection.has_bias():
        bias = np.asarray(spec.decoder.projection.bias, np.float32).copy()
      bias[PAD_ID] = NEVER
      spec.decoder.projection.bias = bias
      return spec

  return Converter


def convert(hf_dir: str | Path, out: str | Path, quantization: str = "float32") -> str:
  """Converts the exported Marian directory `hf_dir` to a CTranslate2 model in `out`
  (float32 by default); returns `out`."""
  return _converter_class()(str(hf_dir)).convert(str(out), quantization=quantization, force=True)


def translate(
  ct2_dir: str | Path, hf_dir: str | Path, sources: list[str], max_length: int, batch_size: int = 64, threads: int = 2
) -> list[str]:
  """Greedy translations of `sources` by the converted model `ct2_dir`, with the exported
  tokenizer of `hf_dir` (source ids end with EOS, as ours); at most `max_length` target
  tokens (EOS included) per sentence, our decoding's cap at model.max_length."""
  import ctranslate2  # noqa: PLC0415
  from transformers import AutoTokenizer  # noqa: PLC0415

  tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
  translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32", intra_threads=threads)
  tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(sources)["input_ids"]]
  results = translator.translate_batch(tokens, beam_size=1, max_batch_size=batch_size, max_decoding_length=max_length)
  return [tokenizer.decode(tokenizer.convert_tokens_to_ids(r.hypotheses[0]), skip_special_tokens=True) for r in results]
