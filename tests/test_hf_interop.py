"""jaxformer.interop: Hugging Face export and import, and CTranslate2 conversion.

Tiny random models of each supported option mix (params perturbed away from their init, so
every norm and bias carries values) are exported with `export_params`, loaded back with
`AutoModel*`/`AutoTokenizer` from the written directory, and checked on real Multi30k
sentences: logits within 1e-4 of ours, `generate()` greedy equal to our greedy decoding, the
tokenizer equal to ours, and import giving back identical params. One imported workdir is
fine-tuned by `train` for two steps. torch/transformers are imported inside the tests.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY

from jaxformer.config import ConfigError, load_config

# Builds and exports four models, then runs transformers: with the slow tests (CI runs them).
pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("transformers")

RAW = Path(__file__).resolve().parents[1] / "jaxformer" / "data" / "raw" / "multi30k"
SHAPE = ["model.num_encoder_layers=1", "model.num_decoder_layers=1", "model.dropout_rate=0"]
MIXES = {  # our option mixes -> the architecture each exports to
  "MarianMTModel": [],
  "LlamaForCausalLM": [
    "model.kind=decoder_only",
    "model.pre_norm=true",
    "model.position=rope",
    "model.norm=rmsnorm",
    "model.ffn=swiglu",
    "model.num_kv_heads=2",
    "model.tie_embeddings=false",
  ],
  "GPT2LMHeadModel": ["model.kind=decoder_only", "model.pre_norm=true", "model.position=learned", "model.ffn=gelu"],
  "XLMRobertaXLForMaskedLM": [
    "model.kind=encoder_only",
    "model.pre_norm=true",
    "model.position=learned",
    "model.ffn=gelu",
    "model.vocab_size=1001",
  ],  # [MASK] after the 1000 pieces
}
NEW_TOKENS = 6


def _sentences(lang: str, n: int = 4) -> list[str]:
  with gzip.open(RAW / f"test_2016_flickr.{lang}.gz", "rt", encoding="utf-8") as f:
    return [next(f).rstrip("\n") for _ in range(n)]


def _random_params(config, seed: int = 0):
  """A random init of `config`'s model with every leaf perturbed (float32 numpy tree)."""
  import flax.linen as nn

  from jaxformer.tasks import get_task

  model = get_task(config).make_model()
  ids = jnp.ones((1, 4), jnp.int32)

  @jax.jit
  def init(key):
    params = nn.meta.unbox(model.init(key, ids, ids)["params"])
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
    return tree.unflatten([x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])

  return model, jax.device_get(init(jax.random.key(seed)))


@pytest.fixture(scope="module")
def exported(multi30k_dir, tmp_path_factory):
  """`{architecture: (config, model, params, export dir)}`, and the tokenizer."""
  from jaxformer.interop.hf_export import export_params
  from jaxformer.tasks import get_task

  vocab, _ = get_task(load_config(TINY, [f"data.data_dir={multi30k_dir}"])).load_data(only=("test",))
  root = tmp_path_factory.mktemp("hf")
  out = {}
  for arch, mix in MIXES.items():
    config = load_config(TINY, [f"data.data_dir={multi30k_dir}", *SHAPE, *mix])
    model, params = _random_params(config)
    result = export_params(config, params, vocab.target, root / arch)
    assert result["architecture"] == arch
    out[arch] = (config, model, params, root / arch)
  return out, vocab.target


def _greedy(model, params, inputs: np.ndarray) -> np.ndarray:
  """Our greedy decoding of NEW_TOKENS tokens (one jitted call)."""
  from jaxformer.inference.decode import greedy_decode

  return np.asarray(jax.jit(lambda p, x: greedy_decode(model, p, x, NEW_TOKENS))(params, jnp.asarray(inputs)))


def _hf(directory: Path):
  import transformers

  config = json.loads((directory / "config.json").read_text())
  model = getattr(transformers, config["architectures"][0]).from_pretrained(str(directory)).eval()
  return model, transformers.AutoTokenizer.from_pretrained(str(directory))


def _batch(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """(our ids with PAD 0, attention mask) of `texts` tokenized by the exported tokenizer."""
  enc = tokenizer(texts, padding=True, return_tensors="np")
  return np.where(enc["attention_mask"] == 1, enc["input_ids"], 0), enc["attention_mask"]


def test_tokenizer_gives_our_ids(exported):
  from jaxformer.data.tokenizer import EOS_ID

  models, ours = exported
  texts = _sentences("en", 50) + _sentences("de", 50)
  marian = _hf(models["MarianMTModel"][3])[1]  # a translation source ends with EOS
  llama = _hf(models["LlamaForCausalLM"][3])[1]
  for text in texts:
    assert marian(text)["input_ids"] == ours.encode(text) + [EOS_ID]
    assert llama(text)["input_ids"] == ours.encode(text)
  assert marian.decode(marian(texts[0])["input_ids"], skip_special_tokens=True) == texts[0]
  assert marian.pad_token_id == 1000 and marian.convert_ids_to_tokens(0) == "<blank>"  # Marian's pad: the last id
  assert _hf(models["XLMRobertaXLForMaskedLM"][3])[1].mask_token_id == 1000  # [MASK]: the model's last id


@pytest.mark.parametrize("arch", list(MIXES))
def test_logits_equal_ours(exported, arch):
  import torch

  from jaxformer.models.transformer import shift_right

  models, _ = exported
  config, model, params, directory = models[arch]
  hf, tokenizer = _hf(directory)
  inputs, mask = _batch(tokenizer, _sentences("en"))
  with torch.no_grad():
    if arch == "MarianMTModel":
      targets, target_mask = _batch(tokenizer, _sentences("de"))
      ours = jax.jit(model.apply)({"params": params}, jnp.asarray(inputs), jnp.asarray(targets))
      decoder_inputs = np.asarray(shift_right(jnp.asarray(targets)))
      theirs = hf(
        input_ids=torch.tensor(inputs),
        attention_mask=torch.tensor(mask),
        decoder_input_ids=torch.tensor(decoder_inputs),
        decoder_attention_mask=torch.tensor(target_mask),
      ).logits
      theirs, valid = theirs[..., : config.model.vocab_size], target_mask == 1  # Marian's extra last id: its pad
      assert hf.config.vocab_size == config.model.vocab_size + 1
    else:
      ours = jax.jit(model.apply)({"params": params}, jnp.asarray(inputs))
      theirs = hf(input_ids=torch.tensor(inputs), attention_mask=torch.tensor(mask)).logits
      valid = mask == 1
  ours, theirs = np.asarray(ours)[valid], theirs.numpy()[valid]
  assert ours.shape == theirs.shape and np.abs(ours).max() > 1.0
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["MarianMTModel", "LlamaForCausalLM", "GPT2LMHeadModel"])
def test_generate_greedy_equals_our_greedy(exported, arch):
  import torch

  from jaxformer.data.tokenizer import EOS_ID

  models, _ = exported
  config, model, params, directory = models[arch]
  hf, tokenizer = _hf(directory)
  inputs, mask = _batch(tokenizer, _sentences("en"))
  ours = _greedy(model, params, inputs)
  for row, (ids, m) in enumerate(zip(inputs, mask)):  # one row at a time: no padding conventions involved
    prompt = torch.tensor(ids[m == 1][None])
    with torch.no_grad():
      out = hf.generate(input_ids=prompt, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0).numpy()[0]
    theirs = out[1:] if arch == "MarianMTModel" else out[prompt.shape[1] :]  # Marian: column 0 is BOS
    mine = ours[row][: len(theirs)]
    end = (list(mine).index(EOS_ID) + 1) if EOS_ID in mine else len(mine)
    np.testing.assert_array_equal(theirs[:end], mine[:end])


@pytest.mark.parametrize("arch", list(MIXES))
def test_import_gives_identical_params(exported, arch):
  from jaxformer.interop.hf_import import params_from_hf, read_hf
  from jaxformer.interop.links import flatten

  models, _ = exported
  config, _, params, directory = models[arch]
  imported_config, tensors = read_hf(directory)
  assert imported_config == config  # the run config travels in config.json
  got, want = flatten(params_from_hf(imported_config, tensors)), flatten(params)
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.slow
def test_import_then_train_fine_tunes_and_export_cli(exported, tmp_path, capsys):
  from jaxformer.checkpoint import manager as ckpt
  from jaxformer.checkpoint import run_files as rf
  from jaxformer.cli import main
  from jaxformer.interop.hf_import import import_hf
  from jaxformer.interop.links import flatten
  from jaxformer.train.loop import train

  models, _ = exported
  config, _, params, directory = models["MarianMTModel"]
  workdir = tmp_path / "imported"
  assert import_hf(directory, workdir)["architecture"] == "MarianMTModel"
  with pytest.raises(ConfigError, match="already exists"):
    import_hf(directory, workdir)
  tuned = load_config(
    workdir / rf.CONFIG_FILE,
    [
      "train.num_steps=2",
      "train.batch_size=8",
      "data.buckets=[64]",
      "train.checkpoint_every=2",
      "train.async_checkpoint=false",
    ],
  )
  train(tuned, workdir)
  assert ckpt.Checkpointer(workdir, read_only=True).all_steps() == [0, 2]
  # `export` of the fine-tuned step: two Adam steps from the imported params, not a fresh init.
  assert main(["export", "--workdir", str(workdir), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
  from jaxformer.interop.hf_import import params_from_hf, read_hf

  export_info = json.loads((tmp_path / "hf" / "jaxformer_export.json").read_text())
  assert export_info["step"] == 2
  got = flatten(params_from_hf(*read_hf(tmp_path / "hf")))
  moved = max(float(np.abs(got[k] - v).max()) for k, v in flatten(params).items())
  assert 0 < moved < 0.05
  # --average-last 2: the mean of the imported (step 0) and the fine-tuned (step 2) params.
  capsys.readouterr()
  assert (
    main(["export", "--workdir", str(workdir), "--format", "hf", "--out", str(tmp_path / "avg"), "--average-last", "2"])
    == 0
  )
  printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert printed["out"] == str(tmp_path / "avg") and printed["averaged_steps"] == [0, 2]
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(printed["files"])
  mean = flatten(params_from_hf(*read_hf(tmp_path / "avg")))
  for k, v in flatten(params).items():
    np.testing.assert_allclose(mean[k], (v + got[k]) / 2, atol=1e-6, err_msg=k)


def test_unsupported_option_mix_is_one_line():
  from jaxformer.interop.hf_export import select_mapping

  config = load_config(
    TINY,
    [
      "model.kind=decoder_only",
      "model.pre_norm=true",
      "model.position=alibi",
      "model.norm=rmsnorm",
      "model.ffn=swiglu",
    ],
  )
  with pytest.raises(
    ConfigError,
    match=r"no Hugging Face counterpart for model.position=alibi \(closest "
    r"architecture: LlamaForCausalLM\)",
  ):
    select_mapping(config)
  # transformers' dynamic NTK counts from max_position_embeddings (our max_length): a model trained
  # on a shorter context has no counterpart, one trained on max_length exports.
  llama = [
    *MIXES["LlamaForCausalLM"],
    "model.rope_scaling=dynamic",
    "model.rope_scaling_factor=2",
    "model.max_length=64",
  ]
  with pytest.raises(ConfigError, match=r"model.rope_trained_length=32"):
    select_mapping(load_config(TINY, [*llama, "model.rope_trained_length=32"]))
  assert select_mapping(load_config(TINY, [*llama, "model.rope_trained_length=64"])).ARCHITECTURE == "LlamaForCausalLM"


def test_ctranslate2_translates_like_us(exported, tmp_path):
  pytest.importorskip("ctranslate2")
  from jaxformer.interop import ctranslate2 as ct2

  models, ours_tokenizer = exported
  config, model, params, directory = models["MarianMTModel"]
  ct2.convert(directory, tmp_path / "ct2")
  sources = _sentences("en")
  _, tokenizer = _hf(directory)
  inputs, _ = _batch(tokenizer, sources)
  ours = ours_tokenizer.decode_batch(_greedy(model, params, inputs))
  assert ct2.translate(tmp_path / "ct2", directory, sources, NEW_TOKENS) == ours


def test_import_a_llama_made_by_transformers(exported, tmp_path):
  """A Llama written by transformers itself (tied unscaled embeddings, no MLP biases, no jaxformer
  config) imports as such, and our model then computes its logits."""
  import torch
  import transformers

  from jaxformer.interop.hf_import import params_from_hf, read_hf
  from jaxformer.interop.hf_tokenizer import save_tokenizer
  from jaxformer.tasks import get_task

  _, tokenizer = exported
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(
    transformers.LlamaConfig(
      vocab_size=1000,
      hidden_size=64,
      intermediate_size=96,
      num_hidden_layers=1,
      num_attention_heads=4,
      num_key_value_heads=2,
      rms_norm_eps=1e-6,
      max_position_embeddings=64,
      tie_word_embeddings=True,
    )
  ).eval()
  hf.save_pretrained(str(tmp_path))
  save_tokenizer(tokenizer, tmp_path, 1000, add_eos=False)
  config, tensors = read_hf(tmp_path)
  m = config.model
  assert (m.kind, m.num_kv_heads, m.tie_embeddings, m.embedding_scale, m.mlp_bias) == (
    "decoder_only",
    2,
    True,
    False,
    False,
  )
  params = params_from_hf(config, tensors)
  assert "bi" not in params["layer_0"]["ffn"] and "output_proj" not in params  # no MLP biases, one tied matrix
  inputs = np.asarray([tokenizer.encode(_sentences("en", 1)[0])])
  ours = jax.jit(get_task(config).make_model().apply)({"params": params}, jnp.asarray(inputs))
  with torch.no_grad():
    theirs = hf(input_ids=torch.tensor(inputs)).logits.numpy()
  np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-4, rtol=0)
