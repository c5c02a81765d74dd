"""Published BERT and RoBERTa masked LMs imported exactly: `BertForMaskedLM` and `RobertaForMaskedLM`
that transformers builds from its default configs (shrunk), two variants each, every weight perturbed
so biases, norms, the token-type rows and RoBERTa's padding position rows carry values, saved with
`save_pretrained`, then read by `hf_import`. Checked against transformers on the same ids, one row
padded at the end (transformers gets an `attention_mask` 0 there; only real positions are compared)
and RoBERTa rows holding token 0 (`<s>`, a real token there): our logits within 1e-4, also with
`model.scan_layers`, and the export back (`hf_export.hf_model`, the family's own class) computing the
original logits. Also: the new model options (`embedding_norm`, `type_vocab_size`, `position_offset`,
`mlm_head`) are off by default, and with dropout, packing, scan_layers and remat behave like the rest
of the model. torch/transformers are imported inside the tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, shakespeare_lines

from jaxformer.config import ConfigError, load_config

pytestmark = pytest.mark.slow  # builds and runs transformers models (CI runs the slow set)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=2,
  num_attention_heads=4,
  max_position_embeddings=40,
)
VARIANTS = {
  # BERT's defaults: erf GELU, LayerNorm eps 1e-12, two token types, tied, pad 0.
  "bert-default": ("BertConfig", SMALL),
  "bert-gelu-new-untied": (
    "BertConfig",
    dict(SMALL, hidden_act="gelu_new", layer_norm_eps=1e-5, tie_word_embeddings=False),
  ),
  # RoBERTa as published (one token type; positions from pad_token_id + 1 = 2), and with two types, untied.
  "roberta-published": ("RobertaConfig", dict(SMALL, type_vocab_size=1, layer_norm_eps=1e-5)),
  "roberta-two-types-untied": ("RobertaConfig", dict(SMALL, type_vocab_size=2, tie_word_embeddings=False)),
}
ARCHITECTURES = {"BertConfig": "BertForMaskedLM", "RobertaConfig": "RobertaForMaskedLM"}
LENGTH = 24
BERT_OPTIONS = [
  "model.kind=encoder_only",
  "model.position=learned",
  "model.embedding_norm=true",
  "model.type_vocab_size=2",
  "model.mlm_head=true",
  "model.attention_bias=all",
  "model.embedding_scale=false",
  "model.ffn=gelu",
]


def _hf_model(name: str, seed: int = 0):
  """The transformers masked LM of variant `name`, every weight perturbed (biases and norms too)."""
  cls, kwargs = VARIANTS[name]
  config = getattr(transformers, cls)(**kwargs, attn_implementation="eager")
  torch.manual_seed(seed)
  model = getattr(transformers, ARCHITECTURES[cls])(config).eval()
  with torch.no_grad():
    for param in model.parameters():
      param.add_(0.05 * torch.randn_like(param))
  return model


def _ids(pad: int) -> np.ndarray:
  """int32 `[2, LENGTH]` ids: no `pad` inside, token 0 at position 3 (real unless pad is 0), row 1
  padded with `pad` from position 17."""
  rng = np.random.default_rng(0)
  ids = rng.integers(2, 96, size=(2, LENGTH)).astype(np.int32)
  ids[:, 3] = 0 if pad != 0 else 7
  ids[1, 17:] = pad
  return ids


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
  mask = torch.from_numpy((ids != model.config.pad_token_id).astype(np.int64))
  with torch.no_grad():
    return model(torch.from_numpy(ids).long(), attention_mask=mask).logits.float().numpy()


def _ours(config, params, ids: np.ndarray) -> np.ndarray:
  from jaxformer.tasks import get_task

  return np.asarray(get_task(config).make_model().apply({"params": params}, jnp.asarray(ids)))


def _import(name: str, path):
  from jaxformer.interop.hf_import import params_from_hf, read_hf

  hf = _hf_model(name)
  hf.save_pretrained(str(path))
  config, tensors = read_hf(path)
  return hf, config, tensors, params_from_hf(config, tensors)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_import_gives_transformers_logits_and_exports_back(name, tmp_path):
  from jaxformer.interop.hf_export import hf_model

  hf, config, _, params = _import(name, tmp_path / "hf")
  ids = _ids(hf.config.pad_token_id)
  real = ids != hf.config.pad_token_id
  expected = _hf_logits(hf, ids)
  np.testing.assert_allclose(_ours(config, params, ids)[real], expected[real], atol=1e-4, rtol=1e-4)

  back = hf_model(config, params, prefer=hf.config.architectures[0])
  assert type(back).__name__ == type(hf).__name__
  np.testing.assert_allclose(_hf_logits(back, ids)[real], expected[real], atol=1e-4, rtol=1e-4)


def test_scanned_layers_give_the_same_logits(tmp_path):
  from jaxformer.interop.hf_import import params_from_hf

  hf, config, tensors, params = _import("roberta-two-types-untied", tmp_path / "hf")
  scanned = dataclasses.replace(config, model=dataclasses.replace(config.model, scan_layers=True))
  ids = _ids(hf.config.pad_token_id)
  real = ids != hf.config.pad_token_id
  np.testing.assert_allclose(
    _ours(scanned, params_from_hf(scanned, tensors), ids)[real], _hf_logits(hf, ids)[real], atol=1e-4, rtol=1e-4
  )


def test_imported_options_are_the_published_ones(tmp_path):
  from jaxformer.interop.hf_import import read_hf

  _hf_model("bert-default").save_pretrained(str(tmp_path / "bert"))
  m = read_hf(tmp_path / "bert")[0].model
  assert (m.pre_norm, m.embedding_norm, m.mlm_head, m.type_vocab_size, m.position_offset) == (False, True, True, 2, 0)
  assert (m.ffn, m.norm_epsilon, m.attention_bias, m.embedding_scale, m.pad_id, m.max_length) == (
    "gelu",
    1e-12,
    "all",
    False,
    0,
    40,
  )
  _hf_model("roberta-published").save_pretrained(str(tmp_path / "roberta"))
  m = read_hf(tmp_path / "roberta")[0].model
  assert (m.type_vocab_size, m.position_offset, m.pad_id, m.max_length, m.tie_embeddings) == (1, 2, 1, 38, True)


@pytest.mark.parametrize(
  "cls, kwargs, message",
  [
    ("BertConfig", dict(SMALL, hidden_act="quick_gelu"), "hidden_act=quick_gelu"),
    ("BertConfig", dict(SMALL, is_decoder=True), "is_decoder=True"),
    ("BertConfig", dict(SMALL, add_cross_attention=True), "add_cross_attention=True"),
    ("BertConfig", dict(SMALL, position_embedding_type="relative_key"), "position_embedding_type=relative_key"),
    ("RobertaConfig", dict(SMALL, hidden_act="gelu_new"), "RoBERTa model .*hidden_act=gelu_new"),
    ("RobertaConfig", dict(SMALL, pad_token_id=None), "pad_token_id=None"),
  ],
)
def test_options_without_counterpart_are_one_line(cls, kwargs, message, tmp_path):
  from jaxformer.interop.hf_import import read_hf

  config = getattr(transformers, cls)(**kwargs)
  config.architectures = [ARCHITECTURES[cls]]
  config.save_pretrained(str(tmp_path))  # the options are refused before any weight is read
  with pytest.raises(ValueError, match=message) as info:
    read_hf(tmp_path)
  assert "\n" not in str(info.value)


def test_our_options_select_the_architecture():
  from jaxformer.interop.hf_export import select_mapping

  pick = lambda *extra: select_mapping(load_config(TINY, [*BERT_OPTIONS, *extra])).ARCHITECTURE  # noqa: E731
  assert pick() == "BertForMaskedLM"
  assert pick("model.ffn=relu", "model.pad_id=5") == "BertForMaskedLM"
  assert pick("model.position_offset=1") == "RobertaForMaskedLM"  # pad_id 0 + 1
  assert (
    pick(
      "model.kind=encoder_only",
      "model.pre_norm=true",
      "model.position=learned",
      "model.ffn=gelu",
      "model.embedding_norm=false",
      "model.type_vocab_size=0",
      "model.mlm_head=false",
      "model.attention_bias=none",
      "model.embedding_scale=true",
    )
    == "XLMRobertaXLForMaskedLM"
  )
  with pytest.raises(ConfigError, match="model.pre_norm=True .*closest architecture: BertForMaskedLM"):
    pick("model.pre_norm=true")
  with pytest.raises(ConfigError, match="model.embedding_norm=True"):  # GPT-2 has no embedding norm
    select_mapping(
      load_config(
        TINY,
        [
          "model.kind=decoder_only",
          "model.pre_norm=true",
          "model.position=learned",
          "model.ffn=gelu",
          "model.embedding_norm=true",
        ],
      )
    )


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["model.kind=decoder_only", "model.mlm_head=true"], "model.mlm_head=true is the masked LM's"),
    (["model.embedding_norm=true"], "model.embedding_norm=True acts in the decoder_only and encoder_only"),
    (["model.type_vocab_size=2"], "model.type_vocab_size=2 acts in the decoder_only"),
    (["model.kind=encoder_only", "model.position_offset=2"], "model.position_offset=2 shifts .*model.position=learned"),
    (["model.kind=encoder_only", "model.type_vocab_size=-1"], "model.type_vocab_size must be >= 0"),
  ],
)
def test_option_mistakes_are_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message) as info:
    load_config(TINY, overrides)
  assert "\n" not in str(info.value)


def test_defaults_leave_models_unchanged():
  from jaxformer.config import ModelConfig
  from jaxformer.tasks import get_task

  m = ModelConfig()
  assert (m.embedding_norm, m.type_vocab_size, m.position_offset, m.mlm_head) == (False, 0, 0, False)
  for kind in ("encoder_only", "decoder_only"):
    config = load_config(TINY, [f"model.kind={kind}", "model.position=learned"])
    ids = jnp.ones((1, 4), jnp.int32)
    params = jax.eval_shape(get_task(config).make_model().init, jax.random.key(0), ids, ids)["params"]
    assert set(params) == {"embed", "positions", "layer_0", "layer_1"}  # tiny.yaml: post-LN, tied
    assert params["positions"]["embedding"].value.shape == (config.model.max_length, config.model.d_model)


def _bert_config(*extra: str):
  """Our encoder-only model's config with BERT's options, RoBERTa's position offset and dropout on."""
  return load_config(
    TINY,
    [*BERT_OPTIONS, "model.position_offset=1", "model.dropout_rate=0.2", "model.attention_dropout_rate=0.1", *extra],
  )


def _bert_model(seed: int = 0):
  """The model of `_bert_config()` and its params, perturbed so every norm and bias carries values."""
  import flax.linen as nn

  from jaxformer.tasks import get_task

  model = get_task(_bert_config()).make_model()
  ids = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(seed), ids, ids)["params"])
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return model, tree.unflatten([x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_scan_and_remat_keep_logits_and_dropout_masks():
  from jaxformer.models.layout import layer_stacks, stack_layers
  from jaxformer.tasks import get_task

  unrolled, params = _bert_model()
  scanned = get_task(_bert_config("model.scan_layers=true", "model.remat=full")).make_model()
  stacked = stack_layers(params, layer_stacks(scanned))
  ids = jnp.asarray(_ids(0))
  key = jax.random.key(3)
  for rngs in (None, {"dropout": key}):
    a, b = (
      np.asarray(model.apply({"params": p}, ids, deterministic=rngs is None, rngs=rngs))
      for model, p in ((unrolled, params), (scanned, stacked))
    )
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  assert not np.allclose(a, np.asarray(unrolled.apply({"params": params}, ids)), atol=1e-3)  # dropout acted


def test_packed_examples_equal_unpacked():
  from jaxformer.models.transformer import segment_positions

  model, params = _bert_model()
  rng = np.random.default_rng(2)
  first, second = rng.integers(4, 1000, 7), rng.integers(4, 1000, 5)
  packed = np.zeros((1, 16), np.int32)
  packed[0, :7], packed[0, 7:12] = first, second
  segments = jnp.asarray(np.array([[1] * 7 + [2] * 5 + [0] * 4], np.int32))
  logits = np.asarray(
    model.apply({"params": params}, jnp.asarray(packed), segment_ids=segments, positions=segment_positions(segments))
  )
  for example, start in ((first, 0), (second, 7)):
    alone = np.zeros((1, 16), np.int32)
    alone[0, : len(example)] = example
    expected = np.asarray(model.apply({"params": params}, jnp.asarray(alone)))[0, : len(example)]
    np.testing.assert_allclose(logits[0, start : start + len(example)], expected, atol=1e-5, rtol=1e-5)


def _wordpiece(folder, lines: list[str]) -> dict[str, int]:
  """A BERT WordPiece tokenizer trained on `lines` ([CLS] text [SEP]), saved as transformers saves a
  model's; returns the config's vocab size and pad id."""
  import tokenizers
  from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

  specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
  tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
  tok.normalizer = normalizers.BertNormalizer(lowercase=True)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece()
  tok.train_from_iterator(lines, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
  tok.post_processor = processors.TemplateProcessing(
    single="[CLS] $A [SEP]", special_tokens=[(s, tok.token_to_id(s)) for s in ("[CLS]", "[SEP]")]
  )
  transformers.BertTokenizerFast(
    tokenizer_object=tok,
    pad_token="[PAD]",
    unk_token="[UNK]",
    cls_token="[CLS]",
    sep_token="[SEP]",
    mask_token="[MASK]",
  ).save_pretrained(str(folder))
  return {"vocab_size": tok.get_vocab_size(), "pad_token_id": tok.token_to_id("[PAD]")}


def test_published_bert_with_its_tokenizer_imports_trains_and_exports(tmp_path):
  """A BERT as downloaded (WordPiece tokenizer with its own [MASK]): import keeps the tokenizer's
  ids, masked-LM training draws replacements from real tokens only, and the export computes ours."""
  import jaxformer
  from jaxformer.interop.hf_import import import_hf
  from jaxformer.tasks import get_task

  lines = shakespeare_lines(600)
  ids = _wordpiece(tmp_path / "hf", lines)
  config = transformers.BertConfig(**dict(SMALL, **ids), attn_implementation="eager")
  torch.manual_seed(0)
  hf = transformers.BertForMaskedLM(config).eval()
  hf.save_pretrained(str(tmp_path / "hf"))
  workdir = tmp_path / "run"
  import_hf(tmp_path / "hf", workdir)
  model = jaxformer.restore(workdir)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  assert model.config.model.mask_id == tokenizer.mask_token_id and model.config.model.pad_id == 0
  encoded = [tokenizer(t)["input_ids"] for t in lines[:2]]
  assert encoded == [model.tokenizer.encode(t) for t in lines[:2]]
  task = get_task(model.config)
  assert task.reserved_ids == 0 and task.mask_id == tokenizer.mask_token_id
  assert set(task.never_drawn) >= {
    tokenizer.pad_token_id,
    tokenizer.mask_token_id,
    tokenizer.cls_token_id,
    tokenizer.sep_token_id,
  }

  text = tmp_path / "train.txt"
  text.write_text("\n\n".join(lines) + "\n")
  tuned = load_config(
    workdir / "config.yaml",
    [
      "data.dataset=files",
      f"data.train_files={text}",
      "data.max_length=32",
      "data.buckets=[32]",
      "train.num_steps=3",
      "train.batch_size=8",
      "train.checkpoint_every=3",
      "train.async_checkpoint=false",
      "train.log_every=1",
      f"data.data_dir={tmp_path / 'cache'}",
    ],
  )
  last = jaxformer.fit(tuned, workdir)
  assert last["step"] == 3 and np.isfinite(last["loss"])
  jaxformer.export(workdir, tmp_path / "back")
  back = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "back")).eval()
  batch = np.asarray([row[: min(map(len, encoded))] for row in encoded])
  ours = jaxformer.logits(jaxformer.restore(workdir), batch)
  np.testing.assert_allclose(ours, _hf_logits(back, batch), atol=1e-4, rtol=1e-4)
  assert np.abs(ours - _hf_logits(hf, batch)).max() > 2e-4  # it did train
