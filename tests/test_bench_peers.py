"""benchmarks/bench_peers.py (needs the `peers` extra): at a tiny shape, every engine decodes exactly
the fixed number of tokens per row, CTranslate2 runs the very model transformers runs, and the
script's table and JSON hold together."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("ctranslate2")

import torch  # noqa: E402

from jaxformer.config import ConfigError, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = [
  "model.d_model=16",
  "model.num_heads=2",
  "model.d_ff=32",
  "model.num_encoder_layers=1",
  "model.num_decoder_layers=1",
  "model.vocab_size=37",
]
BATCH, SRC_LEN, NEW_TOKENS = 8, 3, 3  # 8 rows: one per simulated device of the data-parallel mesh


def _load_script():
  spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "benchmarks" / "bench_peers.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


bp = _load_script()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
  cfg = load_config(ROOT / "configs" / "multi30k_small.yaml", TINY)
  params = bp.jaxformer_params(cfg, seed=0)
  hf = bp.marian_model(cfg, params)
  translator = bp.ctranslate2_translator(hf, tmp_path_factory.mktemp("peers"), threads=1)
  return cfg, params, hf, translator


@pytest.mark.parametrize("beam_size", [1, 4])
def test_every_engine_decodes_exactly_new_tokens(engines, beam_size):
  cfg, params, hf, translator = engines
  inputs = bp.random_sources(BATCH, SRC_LEN, 37, seed=1)
  assert inputs.min() >= 4 and inputs.max() < 37
  outs = {
    "jaxformer": bp.jaxformer_decoder(cfg, params, beam_size, SRC_LEN, NEW_TOKENS)(inputs),
    "transformers": bp.transformers_decoder(hf, beam_size, NEW_TOKENS)(inputs),
    "ctranslate2": bp.ctranslate2_decoder(translator, 37, beam_size, NEW_TOKENS)(inputs),
  }
  for name, out in outs.items():
    assert out.shape == (BATCH, NEW_TOKENS), name
    assert 1 <= out.min() and out.max() < 37, name  # neither pad (ours 0, Marian's extra 37) is chosen
  if beam_size == 1:  # same weights, same argmax: the converted model is the transformers model
    np.testing.assert_array_equal(outs["ctranslate2"], outs["transformers"])


def test_marian_has_the_config_shape(engines):
  cfg, _, hf, _ = engines
  c = hf.config
  assert (c.d_model, c.encoder_attention_heads, c.encoder_ffn_dim, c.encoder_layers, c.decoder_layers) == (
    16,
    2,
    32,
    1,
    1,
  )
  assert c.vocab_size == 38 and hf.model.decoder.embed_scale == 4.0  # + Marian's pad; sqrt(16)
  assert hf.lm_head.weight.data_ptr() == hf.model.encoder.embed_tokens.weight.data_ptr()  # one shared matrix


def test_user_mistakes_are_one_line(engines):
  cfg, params, _, _ = engines
  with pytest.raises(ConfigError, match="--new-tokens must be in"):
    bp.jaxformer_decoder(cfg, params, 1, src_len=5, new_tokens=4)
  with pytest.raises(ConfigError, match="no Hugging Face counterpart for model.pre_norm=True"):
    bp.marian_model(load_config(ROOT / "configs" / "multi30k_small.yaml", [*TINY, "model.pre_norm=true"]), params)


def test_main_prints_a_table_and_consistent_json(monkeypatch, capsys):
  monkeypatch.setenv("NPROC", "1")  # main sets it for XLA; monkeypatch restores the original
  threads = torch.get_num_threads()
  try:
    assert (
      bp.main(
        [
          "--batch-size",
          str(BATCH),
          "--src-len",
          str(SRC_LEN),
          "--new-tokens",
          str(NEW_TOKENS),
          "--beam-size",
          "2",
          "--rounds",
          "2",
          "--threads",
          "1",
          *TINY,
        ]
      )
      == 0
    )
  finally:
    torch.set_num_threads(threads)
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[1].startswith("| search | jaxformer | transformers | ctranslate2 |")
  result = json.loads(lines[-1])
  assert (result["new_tokens"], result["rounds"], result["threads"]) == (NEW_TOKENS, 2, 1)
  for search in ("greedy", "beam2"):
    row = result[search]
    for engine in bp.ENGINES:
      assert row[f"{engine}_tokens_per_s"] == pytest.approx(BATCH * NEW_TOKENS / row[f"{engine}_s"])
    assert row["jaxformer_over_ctranslate2"] == pytest.approx(row["ctranslate2_s"] / row["jaxformer_s"])
    assert row["jaxformer_over_transformers"] == pytest.approx(row["transformers_s"] / row["jaxformer_s"])
