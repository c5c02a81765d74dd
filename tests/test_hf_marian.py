"""Published Marian / OPUS-MT models imported exactly (`interop/hf_marian.py`, `data/tokenizer_marian.py`).

A tiny Marian tokenizer is built as the published ones are laid out: two SentencePiece models trained
on Multi30k (German sources, English targets), one `vocab.json` over both with `</s>` = 0, `<unk>`, a
language code and `<pad>` last, some target pieces left out (they encode as `<unk>`), saved by
transformers' `MarianTokenizer`. Its ids and texts are compared with `MarianTokenizer`'s. The models
are `MarianMTModel`s transformers builds from `MarianConfig`s with published options (pad = decoder
start = the last id, EOS 0, BOS named as EOS), every weight perturbed (the pad row too) and a random
`final_logits_bias`. Checked against transformers on real Multi30k text through the model's tokenizer:
logits within 1e-4, greedy decoding token for token, and after import -> 3 training steps -> export,
transformers' logits of the export equal ours. Options without a counterpart are refused in one line.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import fine_tune_on_pair_files, tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")  # MarianTokenizer's

RAW = Path(__file__).resolve().parents[1] / "jaxformer" / "data" / "raw" / "multi30k"
SPM_SIZE = 160
SMALL = dict(
  d_model=32,
  encoder_layers=2,
  decoder_layers=2,
  encoder_attention_heads=4,
  decoder_attention_heads=4,
  encoder_ffn_dim=48,
  decoder_ffn_dim=48,
  max_position_embeddings=64,
)
VARIANTS = {  # name: MarianConfig options (published models: tied and shared, swish or relu, scaled or not)
  "tied-swish-scaled": dict(activation_function="swish", scale_embedding=True),
  "untied-relu-unscaled": dict(
    activation_function="relu", scale_embedding=False, share_encoder_decoder_embeddings=False, tie_word_embeddings=False
  ),
  "shared-own-head-gelu": dict(activation_function="gelu", scale_embedding=True, tie_word_embeddings=False),
  "separate-tied-head": dict(
    activation_function="swish", scale_embedding=False, share_encoder_decoder_embeddings=False
  ),
}


def _lines(split: str, lang: str, n: int) -> list[str]:
  with gzip.open(RAW / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
    return [line.strip() for _, line in zip(range(n), f)]


def _write_tokenizer(folder: Path) -> int:
  """A Marian tokenizer directory (see the module docstring); returns its vocabulary size."""
  import sentencepiece as spm

  folder.mkdir(parents=True, exist_ok=True)
  pieces = {}
  for side, lang in (("source", "de"), ("target", "en")):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
      sentence_iterator=iter(_lines("train", lang, 3000)),
      model_writer=model,
      vocab_size=SPM_SIZE,
      character_coverage=1.0,
      num_threads=1,
      minloglevel=2,
    )
    (folder / f"{side}.spm").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces[side] = [
      sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_control(i) and not sp.is_unknown(i)
    ]
  left_out = [p for p in pieces["target"] if p not in pieces["source"]][:3]  # frequent, yet <unk>: not in vocab
  words = sorted((set(pieces["source"]) | set(pieces["target"])) - set(left_out))
  vocab = {token: i for i, token in enumerate(["</s>", "<unk>", ">>deu<<", *words, "<pad>"])}
  (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
  tokenizer = transformers.MarianTokenizer(
    str(folder / "source.spm"),
    str(folder / "target.spm"),
    str(folder / "vocab.json"),
    source_lang="de",
    target_lang="en",
  )
  tokenizer.save_pretrained(str(folder))
  return len(vocab)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
  folder = tmp_path_factory.mktemp("marian_tokenizer")
  _write_tokenizer(folder)
  return folder


def test_tokenizer_ids_and_texts_are_marian_tokenizers(tokenizer_dir):
  """Sources (source model), targets (target model), a language code, unknown pieces and decoding
  equal `MarianTokenizer`'s; the serialized sides restore unchanged."""
  from jaxformer.data.tokenizer import tokenizer_from_bytes
  from jaxformer.data.tokenizer_marian import MarianTokenizer

  theirs = transformers.MarianTokenizer.from_pretrained(str(tokenizer_dir))
  target = MarianTokenizer.load(tokenizer_dir)
  source = target.with_side("source")
  de, en = _lines("val", "de", 60), _lines("val", "en", 60)
  assert [source.encode(t) for t in de] == theirs(de)["input_ids"]
  expected = theirs(text_target=en)["input_ids"]
  assert [target.encode(t) for t in en] == expected
  assert any(theirs.unk_token_id in row for row in expected)  # left-out pieces are <unk> in both
  assert source.encode(">>deu<< " + de[0]) == theirs(">>deu<< " + de[0])["input_ids"]
  assert [target.decode(row) for row in expected] == theirs.batch_decode(expected, skip_special_tokens=True)
  ids = target.special_ids
  assert (ids.eos, ids.unk, ids.pad, ids.bos, target.vocab_size) == (0, 1, len(theirs) - 1, -1, len(theirs))
  assert target.encode_plain(en[0]) + [0] == target.encode(en[0])
  again = tokenizer_from_bytes(source.serialized)
  assert again.side == "source" and again.encode(de[1]) == source.encode(de[1])


def test_tokenizer_files_errors_are_one_line(tokenizer_dir, tmp_path):
  from jaxformer.data.tokenizer_marian import MarianTokenizer

  with pytest.raises(FileNotFoundError, match="source.spm, target.spm or vocab.json"):
    MarianTokenizer.load(tmp_path)
  for name in ("source.spm", "target.spm"):
    (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
  (tmp_path / "vocab.json").write_text(json.dumps({"</s>": 0, "<unk>": 1}))
  with pytest.raises(ValueError, match="no entry for the special token '<pad>'") as info:
    MarianTokenizer.load(tmp_path)
  assert "\n" not in str(info.value)


def _config(vocab_size: int, **options):
  """A `MarianConfig` with published special ids (pad = decoder start = last id, EOS 0, BOS named as EOS)."""
  pad = vocab_size - 1
  return transformers.MarianConfig(
    vocab_size=vocab_size,
    pad_token_id=pad,
    decoder_start_token_id=pad,
    eos_token_id=0,
    bos_token_id=0,
    forced_eos_token_id=0,
    **{**SMALL, **options},
    attn_implementation="eager",
  )


@pytest.mark.parametrize(
  "options, message",
  [
    (dict(decoder_vocab_size=50), "decoder_vocab_size=50"),
    (dict(activation_function="tanh"), "activation_function=tanh"),
    (dict(decoder_ffn_dim=64), "decoder_attention_heads/ffn_dim"),
    (dict(normalize_before=True), "normalize_before=True"),
    (dict(static_position_embeddings=False), "static_position_embeddings=False"),
  ],
)
def test_options_without_a_counterpart_are_one_line(options, message):
  from jaxformer.interop import hf_marian

  with pytest.raises(ValueError, match=message) as info:
    hf_marian.model_config(_config(60, **options))
  assert "\n" not in str(info.value)


def test_logits_bias_is_an_encoder_decoder_option():
  from jaxformer.config import ConfigError
  from jaxformer.tasks import get_task

  get_task(tiny_config(None, "model.logits_bias=true")).validate()
  with pytest.raises(ConfigError, match="model.logits_bias=true"):
    get_task(tiny_config("decoder_only", "model.logits_bias=true")).validate()


def _published(folder: Path, name: str, seed: int = 0, noise: float = 0.05):
  """A transformers `MarianMTModel` of variant `name` with the tokenizer in `folder`, saved there."""
  vocab_size = _write_tokenizer(folder)
  model = transformers.MarianMTModel(_config(vocab_size, **VARIANTS[name])).eval()
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "embed_positions" not in name:  # Marian's sinusoids: computed, not saved
        param.add_(noise * torch.randn_like(param))
    model.final_logits_bias.copy_(noise * torch.randn_like(model.final_logits_bias))  # transformers' is zeros
  model.save_pretrained(str(folder))
  return model


def _batch(tokenizer, pad: int):
  """Two Multi30k pairs through `tokenizer`: sources `[2, S]` and decoder inputs `[2, T]` (pad first,
  then the target shifted), each padded with `pad`, and the valid decoder positions `[2, T]`."""
  pairs = tokenizer(_lines("val", "de", 2), text_target=_lines("val", "en", 2))
  src, dec = pairs["input_ids"], [[pad] + row[:-1] for row in pairs["labels"]]
  width, height = max(map(len, src)), max(map(len, dec))
  inputs = np.asarray([row + [pad] * (width - len(row)) for row in src], np.int32)
  decoder = np.asarray([row + [pad] * (height - len(row)) for row in dec], np.int32)
  valid = np.asarray([[i < len(row) for i in range(height)] for row in dec])
  return inputs, decoder, valid


def _hf_logits(model, inputs, decoder, pad):
  with torch.no_grad():
    return (
      model(
        input_ids=torch.from_numpy(inputs).long(),
        attention_mask=torch.from_numpy(inputs != pad).long(),
        decoder_input_ids=torch.from_numpy(decoder).long(),
      )
      .logits.float()
      .numpy()
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_import_gives_transformers_logits_and_exports_back(name, tmp_path):
  """Our logits on real text are transformers' for every tie/share/activation/scale variant; the
  export back (`hf_model`) computes them too."""
  from jaxformer.interop.hf_export import hf_model
  from jaxformer.interop.hf_import import params_from_hf, read_hf
  from jaxformer.tasks import get_task

  hf = _published(tmp_path, name)
  config, tensors = read_hf(tmp_path)
  m = config.model
  pad = hf.config.pad_token_id
  assert (m.pad_id, m.special_ids.start, m.eos_id, m.bos_id, m.norm_epsilon) == (pad, pad, 0, -1, 1e-5)
  assert (m.logits_bias, m.attention_bias, m.embedding_scale) == (True, "all", hf.config.scale_embedding)
  assert config.data.tokenizer == "marian"
  params = params_from_hf(config, tensors)
  inputs, decoder, valid = _batch(transformers.MarianTokenizer.from_pretrained(str(tmp_path)), pad)
  model = get_task(config).make_model()
  ours = np.asarray(
    model.apply({"params": params}, inputs, decoder, method=lambda m, x, y: m.decode(m.encode(x), x, y))
  )
  expected = _hf_logits(hf, inputs, decoder, pad)
  np.testing.assert_allclose(ours[valid], expected[valid], atol=1e-4, rtol=1e-4)
  back = hf_model(config, params, prefer="MarianMTModel")
  np.testing.assert_allclose(_hf_logits(back, inputs, decoder, pad)[valid], expected[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tied-swish-scaled", "untied-relu-unscaled"])
def test_published_model_imports_generates_trains_and_exports(name, tmp_path):
  """import -> restore (ids, logits, greedy decoding = transformers') -> translate -> 3 training steps on
  Multi30k text -> export: transformers' logits of the export are ours, its tokenizer encodes the same."""
  import jax

  import jaxformer
  from jaxformer.inference.decode import greedy_decode
  from jaxformer.interop.hf_import import import_hf

  hf = _published(tmp_path / "hf", name, seed=1, noise=0.3)
  theirs = transformers.MarianTokenizer.from_pretrained(str(tmp_path / "hf"))
  workdir = tmp_path / "run"
  assert import_hf(tmp_path / "hf", workdir)["architecture"] == "MarianMTModel"
  assert (workdir / "hf_tokenizer" / "target.spm").is_file() and (workdir / "source_tokenizer.model").is_file()
  restored = jaxformer.restore(workdir)
  pad = restored.config.model.pad_id
  de = _lines("val", "de", 2)
  assert [restored.source_tokenizer.encode(t) for t in de] == theirs(de)["input_ids"]
  inputs, decoder, valid = _batch(theirs, pad)
  expected = _hf_logits(hf, inputs, decoder, pad)
  np.testing.assert_allclose(jaxformer.logits(restored, inputs, decoder)[valid], expected[valid], atol=1e-4, rtol=1e-4)

  n = 12  # greedy: ours never generate pad, theirs start with the decoder start token (pad)
  with torch.no_grad():
    generated = hf.generate(
      torch.from_numpy(inputs).long(),
      attention_mask=torch.from_numpy(inputs != pad).long(),
      max_new_tokens=n,
      do_sample=False,
      num_beams=1,
      suppress_tokens=[pad],
      forced_eos_token_id=None,
    ).numpy()[:, 1:]
  ours = np.asarray(jax.jit(lambda p, x: greedy_decode(restored.model, p, x, n))(restored.params, inputs))
  for row_ours, row_theirs in zip(ours, generated):
    stop = list(row_theirs).index(0) + 1 if 0 in row_theirs else len(row_theirs)
    np.testing.assert_array_equal(row_ours[:stop], row_theirs[:stop])
    assert restored.tokenizer.decode(row_ours) == theirs.decode(row_theirs[:stop], skip_special_tokens=True)
  assert all(isinstance(t, str) for t in jaxformer.translate(restored, de))

  last = fine_tune_on_pair_files(workdir, tmp_path, _lines("train", "de", 300), _lines("train", "en", 300), "de", "en")
  assert last["step"] == 3 and np.isfinite(last["loss"])
  out = jaxformer.export(workdir, tmp_path / "back")
  assert out["step"] == 3 and out["architecture"] == "MarianMTModel"
  back = transformers.MarianMTModel.from_pretrained(str(tmp_path / "back")).eval()
  exported = transformers.MarianTokenizer.from_pretrained(str(tmp_path / "back"))
  assert exported(de)["input_ids"] == theirs(de)["input_ids"]
  ours = jaxformer.logits(jaxformer.restore(workdir), inputs, decoder)
  np.testing.assert_allclose(ours[valid], _hf_logits(back, inputs, decoder, pad)[valid], atol=1e-4, rtol=1e-4)
  assert np.abs(ours - expected)[valid].max() > 2e-4  # it did train (twice the tolerance above)
