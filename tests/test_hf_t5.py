"""T5 imported exactly (`interop/hf_t5.py`): `T5ForConditionalGeneration` models that transformers
builds from configs (v1.0: ReLU, tied head with the d_model**-0.5 rescale; v1.1 / Flan-T5: gated-GELU,
d_kv != d_model / heads, a head of its own, or one transformers ties to `shared.weight` and leaves
out of the checkpoint), every weight perturbed, saved with `save_pretrained`, read by `hf_import`.
Checked against transformers: logits within 1e-4 on padded sources, the export back computing the
same logits, greedy decoding token for token (pad suppressed in both), and our bucket function against T5's own.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fine_tune_on_pair_files

pytestmark = pytest.mark.slow  # builds and runs transformers models (CI runs the slow set)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(
  vocab_size=96,
  d_model=32,
  d_ff=48,
  num_layers=2,
  num_decoder_layers=2,
  num_heads=4,
  relative_attention_num_buckets=32,
  relative_attention_max_distance=20,
  decoder_start_token_id=0,
)
VARIANTS = {  # name: (config kwargs, whether the head is a tensor of its own)
  "v1.0-relu-tied": (dict(SMALL, d_kv=8, feed_forward_proj="relu", tie_word_embeddings=True), False),
  "v1.1-gated-gelu-own-head": (
    dict(SMALL, d_kv=16, feed_forward_proj="gated-gelu", tie_word_embeddings=False, layer_norm_epsilon=1e-5),
    True,
  ),
  "v1.1-gated-gelu-head-left-out": (
    dict(SMALL, d_kv=16, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    False,
  ),
}


def _hf_model(name: str, seed: int = 0, noise: float = 0.05):
  """The transformers T5 of variant `name`, every weight perturbed (norms and bias tables too)."""
  kwargs, own_head = VARIANTS[name]
  config = transformers.T5Config(**kwargs, attn_implementation="eager")
  torch.manual_seed(seed)
  model = transformers.T5ForConditionalGeneration(config).eval()
  if own_head:  # as Flan-T5's checkpoints: transformers 5 ties the head unless the checkpoint holds its own
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
  with torch.no_grad():
    for param in model.parameters():
      param.add_(noise * torch.randn_like(param))
  return model


def _inputs():
  """Source ids `[2, 12]` (row 1 padded with 0 at the end) and decoder inputs `[2, 9]` starting with 0."""
  rng = np.random.default_rng(0)
  src = rng.integers(2, 96, size=(2, 12)).astype(np.int32)
  src[0, -1] = src[1, 8] = 1  # EOS
  src[1, 9:] = 0
  dec = rng.integers(2, 96, size=(2, 9)).astype(np.int32)
  dec[:, 0] = 0
  return src, dec


def _hf_logits(model, src, dec) -> np.ndarray:
  with torch.no_grad():
    return (
      model(
        input_ids=torch.from_numpy(src).long(),
        attention_mask=torch.from_numpy(src != 0).long(),
        decoder_input_ids=torch.from_numpy(dec).long(),
      )
      .logits.float()
      .numpy()
    )


def _imported(hf, tmp_path):
  from jaxformer.interop.hf_import import params_from_hf, read_hf
  from jaxformer.tasks import get_task

  hf.save_pretrained(str(tmp_path / "hf"))
  config, tensors = read_hf(tmp_path / "hf")
  return config, params_from_hf(config, tensors), get_task(config).make_model()


def _our_logits(model, params, src, dec) -> np.ndarray:
  return np.asarray(model.apply({"params": params}, src, dec, method=lambda m, x, y: m.decode(m.encode(x), x, y)))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_import_gives_transformers_logits_and_exports_back(name, tmp_path):
  """Our logits are transformers' (padded source, decoder from pad); the export back computes them too."""
  from jaxformer.interop.hf_export import hf_model

  hf = _hf_model(name)
  config, params, model = _imported(hf, tmp_path)
  m = config.model
  assert (m.position, m.norm, m.pre_norm, m.pad_id, m.eos_id, m.special_ids.start) == ("t5", "rmsnorm", True, 0, 1, 0)
  assert m.tie_embeddings == (name == "v1.0-relu-tied")
  src, dec = _inputs()
  expected = _hf_logits(hf, src, dec)
  np.testing.assert_allclose(_our_logits(model, params, src, dec), expected, atol=1e-4, rtol=1e-4)

  back = hf_model(config, params, prefer="T5ForConditionalGeneration")
  assert type(back).__name__ == "T5ForConditionalGeneration"
  np.testing.assert_allclose(_hf_logits(back, src, dec), expected, atol=1e-4, rtol=1e-4)
  back.save_pretrained(str(tmp_path / "back"))  # v1.1's own head survives transformers' save and load
  again = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "back")).eval()
  np.testing.assert_allclose(_hf_logits(again, src, dec), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["v1.0-relu-tied", "v1.1-gated-gelu-own-head"])
def test_greedy_decoding_matches_generate(name, tmp_path):
  """`greedy_decode` gives `generate`'s tokens (after its decoder start token) through EOS."""
  import jax

  from jaxformer.inference.decode import greedy_decode

  hf = _hf_model(name, seed=1, noise=0.5)  # outputs that vary from step to step
  config, params, model = _imported(hf, tmp_path)
  src, _ = _inputs()
  n = 10  # ours never generate pad; theirs start with the decoder start token
  with torch.no_grad():
    theirs = hf.generate(
      torch.from_numpy(src).long(),
      attention_mask=torch.from_numpy(src != 0).long(),
      max_new_tokens=n,
      do_sample=False,
      suppress_tokens=[0],
    ).numpy()[:, 1:]
  ours = np.asarray(jax.jit(lambda p, x: greedy_decode(model, p, x, n))(params, src))
  for row_ours, row_theirs in zip(ours, theirs):
    stop = list(row_theirs).index(1) + 1 if 1 in row_theirs else len(row_theirs)
    np.testing.assert_array_equal(row_ours[:stop], row_theirs[:stop])


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (32, 20), (8, 10), (16, 300)])
def test_bucket_function_is_t5s(num_buckets, max_distance):
  """`t5_buckets` equals `T5Attention._relative_position_bucket` on distances -300..300, both directions."""
  from transformers.models.t5.modeling_t5 import T5Attention

  from jaxformer.layers.positions import t5_buckets

  relative = np.arange(-300, 301, dtype=np.int32)
  for bidirectional in (True, False):
    theirs = T5Attention._relative_position_bucket(
      torch.from_numpy(relative).long(), bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    ).numpy()
    ours = np.asarray(t5_buckets(relative, bidirectional, num_buckets, max_distance))
    np.testing.assert_array_equal(ours, theirs)


def test_options_without_a_counterpart_are_named():
  """A T5 option with no counterpart (gated ReLU) is refused in one line naming it."""
  from jaxformer.interop import hf_t5

  config = transformers.T5Config(**dict(SMALL, d_kv=8, feed_forward_proj="gated-relu"))
  with pytest.raises(ValueError, match="feed_forward_proj=gated-relu"):
    hf_t5.model_config(config)


def _multi30k(split: str, lang: str, n: int) -> list[str]:
  import gzip
  from pathlib import Path

  raw = Path(__file__).resolve().parents[1] / "jaxformer" / "data" / "raw" / "multi30k"
  with gzip.open(raw / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
    return [line.strip() for _, line in zip(range(n), f)]


def test_published_t5_with_only_spiece_imports_trains_and_exports(tmp_path):
  """A T5 directory as the original checkpoints ship it: `spiece.model` (pad 0, eos 1, unk 2) and no
  tokenizer.json. Import converts it as transformers does (our ids are `T5Tokenizer`'s on Multi30k),
  logits and greedy decoding equal transformers', 3 training steps, and the export computes ours."""
  import io

  import jax
  import sentencepiece as spm

  import jaxformer
  from jaxformer.inference.decode import greedy_decode
  from jaxformer.interop.hf_import import import_hf

  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(_multi30k("train", "en", 2000) + _multi30k("train", "de", 2000)),
    model_writer=model,
    vocab_size=200,
    character_coverage=1.0,
    num_threads=1,
    pad_id=0,
    eos_id=1,
    unk_id=2,
    bos_id=-1,
    minloglevel=2,
  )
  (hf_dir / "spiece.model").write_bytes(model.getvalue())
  (hf_dir / "tokenizer_config.json").write_text('{"tokenizer_class": "T5Tokenizer", "extra_ids": 0}')
  theirs = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
  config = transformers.T5Config(
    **dict(SMALL, vocab_size=200, d_kv=8, feed_forward_proj="relu"), attn_implementation="eager"
  )
  torch.manual_seed(2)
  hf = transformers.T5ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for param in hf.parameters():
      param.add_(0.3 * torch.randn_like(param))
  hf.save_pretrained(str(hf_dir))

  workdir = tmp_path / "run"
  import_hf(hf_dir, workdir)
  assert (workdir / "hf_tokenizer" / "tokenizer.json").is_file()
  restored = jaxformer.restore(workdir)
  lines = _multi30k("val", "en", 2)
  ids = theirs(lines)["input_ids"]
  assert ids == [restored.source_tokenizer.encode(t) for t in lines]
  sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
  assert ids == [sp.encode(t) + [1] for t in lines]  # SentencePiece itself, then T5's EOS
  src = np.zeros((2, max(map(len, ids))), np.int32)
  for row, x in zip(src, ids):
    row[: len(x)] = x
  dec = src[:, :6].copy()
  dec[:, 0] = 0
  expected = _hf_logits(hf, src, dec)
  np.testing.assert_allclose(jaxformer.logits(restored, src, dec), expected, atol=1e-4, rtol=1e-4)
  with torch.no_grad():
    generated = hf.generate(
      torch.from_numpy(src).long(),
      attention_mask=torch.from_numpy(src != 0).long(),
      max_new_tokens=8,
      do_sample=False,
      suppress_tokens=[0],
    ).numpy()[:, 1:]
  ours = np.asarray(jax.jit(lambda p, x: greedy_decode(restored.model, p, x, 8))(restored.params, src))
  for row_ours, row_theirs in zip(ours, generated):
    stop = list(row_theirs).index(1) + 1 if 1 in row_theirs else len(row_theirs)
    np.testing.assert_array_equal(row_ours[:stop], row_theirs[:stop])
    assert restored.tokenizer.decode(row_ours) == theirs.decode(row_theirs[:stop], skip_special_tokens=True)

  source, target = _multi30k("train", "en", 300), _multi30k("train", "de", 300)
  assert fine_tune_on_pair_files(workdir, tmp_path, source, target, "en", "de")["step"] == 3
  jaxformer.export(workdir, tmp_path / "back")
  back = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "back")).eval()
  assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))(lines)["input_ids"] == ids
  tuned_logits = jaxformer.logits(jaxformer.restore(workdir), src, dec)
  np.testing.assert_allclose(tuned_logits, _hf_logits(back, src, dec), atol=1e-4, rtol=1e-4)
  assert np.abs(tuned_logits - expected).max() > 2e-4  # it did train
