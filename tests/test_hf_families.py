"""Published decoder-only families imported exactly: GPT-2, Llama, Mistral and Qwen2 models that
transformers itself builds from configs with each family's published options (two or more
variants each), every weight perturbed so biases and norms carry values, saved with
`save_pretrained`, then read by `hf_import`. Checked against transformers on the same ids (token
0 included, which is a real token in these vocabularies): our logits within 1e-4, and the export
back (`hf_export.hf_model`, the family's own class) computing the original model's logits.
torch/transformers are imported inside the tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import shakespeare_lines

pytestmark = pytest.mark.slow  # builds and runs transformers models (CI runs the slow set)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
VARIANTS = {
  # GPT-2's defaults: gelu_new, tied unscaled embeddings, LayerNorm eps 1e-5, biases everywhere.
  "gpt2-default": ("GPT2Config", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32)),
  "gpt2-gelu-untied": (
    "GPT2Config",
    dict(
      vocab_size=96,
      n_embd=32,
      n_layer=2,
      n_head=4,
      n_positions=32,
      n_inner=48,
      activation_function="gelu",
      tie_word_embeddings=False,
      layer_norm_epsilon=1e-6,
    ),
  ),
  # Llama 3-style: theta 500000 with llama3 scaling, tied, head_dim != d_model / heads, GQA, all biases.
  "llama3-tied-headdim": (
    "LlamaConfig",
    dict(
      SMALL,
      num_key_value_heads=2,
      head_dim=16,
      tie_word_embeddings=True,
      attention_bias=True,
      mlp_bias=True,
      max_position_embeddings=64,
      rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
      },
    ),
  ),
  "llama-linear": (
    "LlamaConfig",
    dict(
      SMALL,
      max_position_embeddings=64,
      rms_norm_eps=1e-5,
      rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
  ),
  "llama-yarn": (
    "LlamaConfig",
    dict(
      SMALL,
      num_key_value_heads=1,
      max_position_embeddings=64,
      rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
      },
    ),
  ),
  # Dynamic NTK past the trained context: 24 tokens on a model trained on 16.
  "llama-dynamic": (
    "LlamaConfig",
    dict(
      SMALL, max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    ),
  ),
  "mistral-window": (
    "MistralConfig",
    dict(SMALL, num_key_value_heads=2, sliding_window=5, max_position_embeddings=64, head_dim=8),
  ),
  "mistral-no-window": (
    "MistralConfig",
    dict(
      SMALL,
      num_key_value_heads=4,
      sliding_window=None,
      max_position_embeddings=64,
      head_dim=8,
      tie_word_embeddings=True,
    ),
  ),
  "qwen2-tied": (
    "Qwen2Config",
    dict(
      SMALL,
      num_key_value_heads=2,
      tie_word_embeddings=True,
      max_position_embeddings=64,
      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
  ),
  "qwen2-untied": ("Qwen2Config", dict(SMALL, num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6)),
}
LENGTH = 24


def _hf_model(name: str, seed: int = 0, config=None):
  """The transformers causal LM of variant `name` (or of `config`), every weight perturbed (biases and norms too)."""
  cls, kwargs = VARIANTS[name]
  config = config or getattr(transformers, cls)(**kwargs, attn_implementation="eager")
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():
    for param in model.parameters():
      param.add_(0.05 * torch.randn_like(param))
  return model


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(ids).long()).logits.float().numpy()


@pytest.fixture(scope="module")
def ids():
  rng = np.random.default_rng(0)
  out = rng.integers(0, 96, size=(2, LENGTH)).astype(np.int32)
  out[:, 3] = 0  # a real token here, not padding
  return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_import_gives_transformers_logits_and_exports_back(name, ids, tmp_path):
  from jaxformer.interop.hf_export import hf_model
  from jaxformer.interop.hf_import import params_from_hf, read_hf
  from jaxformer.tasks import get_task

  hf = _hf_model(name)
  hf.save_pretrained(str(tmp_path / "hf"))
  config, tensors = read_hf(tmp_path / "hf")
  params = params_from_hf(config, tensors)
  ours = np.asarray(get_task(config).make_model().apply({"params": params}, ids))
  expected = _hf_logits(hf, ids)
  np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=1e-4)

  back = hf_model(config, params, prefer=hf.config.architectures[0] if hf.config.architectures else None)
  assert type(back).__name__ == type(hf).__name__
  np.testing.assert_allclose(_hf_logits(back, ids), expected, atol=1e-4, rtol=1e-4)


def test_imported_options_are_the_published_ones(tmp_path):
  from jaxformer.interop.hf_import import read_hf

  _hf_model("llama3-tied-headdim").save_pretrained(str(tmp_path / "llama"))
  m = read_hf(tmp_path / "llama")[0].model
  assert (m.rope_theta, m.rope_scaling, m.rope_scaling_factor, m.rope_trained_length) == (500000.0, "llama3", 8.0, 16)
  assert (m.head_dim, m.kv_heads, m.attention_bias, m.mlp_bias) == (16, 2, "all", True)
  assert (m.tie_embeddings, m.embedding_scale, m.pad_id) == (True, False, -1)
  _hf_model("gpt2-default").save_pretrained(str(tmp_path / "gpt2"))
  m = read_hf(tmp_path / "gpt2")[0].model
  assert (m.ffn, m.norm_epsilon, m.attention_bias, m.tie_embeddings) == ("gelu_tanh", 1e-5, "all", True)


@pytest.mark.parametrize(
  "cls, kwargs, message",
  [
    ("LlamaConfig", dict(SMALL, hidden_act="gelu"), "hidden_act=gelu"),
    (
      "LlamaConfig",
      dict(
        SMALL,
        rope_parameters={
          "rope_type": "longrope",
          "rope_theta": 1e4,
          "short_factor": [1.0] * 4,
          "long_factor": [1.0] * 4,
          "original_max_position_embeddings": 16,
        },
      ),
      "rope_type=longrope",
    ),
    (
      "LlamaConfig",
      dict(
        SMALL,
        max_position_embeddings=64,
        rope_parameters={
          "rope_type": "yarn",
          "rope_theta": 1e4,
          "factor": 4.0,
          "beta_fast": 16,
          "original_max_position_embeddings": 16,
        },
      ),
      "beta_fast",
    ),
    ("Qwen2Config", dict(SMALL, use_sliding_window=True, sliding_window=4), "use_sliding_window"),
    (
      "GPT2Config",
      dict(vocab_size=96, n_embd=32, n_layer=1, n_head=4, scale_attn_by_inverse_layer_idx=True),
      "scale_attn_by_inverse_layer_idx",
    ),
  ],
)
def test_options_without_counterpart_are_one_line(cls, kwargs, message, tmp_path):
  from jaxformer.interop.hf_import import read_hf

  config = getattr(transformers, cls)(**kwargs)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match=message) as info:
    read_hf(tmp_path)
  assert "\n" not in str(info.value)


STYLES = {  # a published tokenizer's special tokens: GPT-2's one <|endoftext|>, Llama's <unk> <s> </s> and a BOS
  "gpt2": dict(specials=["<|endoftext|>"], bos="<|endoftext|>", eos="<|endoftext|>", unk=None, add_bos=False),
  "llama": dict(specials=["<unk>", "<s>", "</s>"], bos="<s>", eos="</s>", unk="<unk>", add_bos=True),
}


def _write_tokenizer(folder: Path, style: str) -> dict[str, int]:
  """A byte-level BPE tokenizer trained on Tiny Shakespeare, saved as transformers saves a model's
  (tokenizer.json + tokenizer_config.json); returns the special tokens' ids."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  spec = STYLES[style]
  tok = tokenizers.Tokenizer(models.BPE(unk_token=spec["unk"]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=320, special_tokens=spec["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(shakespeare_lines(2000), trainer)
  bos = tok.token_to_id(spec["bos"])
  if spec["add_bos"]:
    tok.post_processor = processors.TemplateProcessing(single=f"{spec['bos']} $A", special_tokens=[(spec["bos"], bos)])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"], unk_token=spec["unk"]
  )
  fast.save_pretrained(str(folder))
  return {"vocab_size": tok.get_vocab_size(), "bos_token_id": bos, "eos_token_id": tok.token_to_id(spec["eos"])}


def _published(folder: Path, name: str, style: str):
  """A transformers model of variant `name` with a trained tokenizer of `style`, saved to `folder`."""
  ids = _write_tokenizer(folder, style)
  cls, kwargs = VARIANTS[name]
  kwargs = {**kwargs, **ids}
  if cls == "GPT2Config":
    kwargs["n_positions"] = 64
  model = _hf_model(name, config=getattr(transformers, cls)(**kwargs, attn_implementation="eager"))
  model.save_pretrained(str(folder))
  return model


@pytest.mark.parametrize(
  "name, style",
  [("gpt2-default", "gpt2"), ("llama3-tied-headdim", "llama"), ("qwen2-tied", "gpt2"), ("mistral-window", "llama")],
)
def test_published_model_with_its_tokenizer_imports_generates_trains_and_exports(name, style, tmp_path):
  import jax

  import jaxformer
  from jaxformer.config import load_config
  from jaxformer.inference.decode import greedy_decode
  from jaxformer.interop.hf_import import import_hf

  hf = _published(tmp_path / "hf", name, style)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  workdir = tmp_path / "run"
  assert import_hf(tmp_path / "hf", workdir)["architecture"] == type(hf).__name__
  model = jaxformer.restore(workdir)
  m = model.config.model
  assert (m.bos_id, m.eos_id, m.pad_id) == (hf.config.bos_token_id, hf.config.eos_token_id, -1)
  assert model.config.data.tokenizer == "hf" and (workdir / "hf_tokenizer" / "tokenizer.json").is_file()

  # Real text through the model's own tokenizer: our ids and logits are transformers'.
  lines = shakespeare_lines(40)[30:32]
  ids = [tokenizer(t)["input_ids"] for t in lines]
  assert ids == [model.tokenizer.encode(t) for t in lines]
  assert (ids[0][0] == m.bos_id) == STYLES[style]["add_bos"]
  assert model.tokenizer.decode(ids[0]) == lines[0]
  batch = np.asarray([row[: min(map(len, ids))] for row in ids])
  np.testing.assert_allclose(jaxformer.logits(model, batch), _hf_logits(hf, batch), atol=1e-4, rtol=1e-4)

  # Greedy decoding equals transformers' generate, token for token (until its EOS).
  prompt = np.asarray([ids[0][:6]], np.int32)
  ours = np.asarray(jax.jit(lambda p, x: greedy_decode(model.model, p, x, 10))(model.params, prompt))[0]
  with torch.no_grad():
    theirs = hf.generate(torch.from_numpy(prompt).long(), max_new_tokens=10, do_sample=False, pad_token_id=m.eos_id)[
      0, 6:
    ].numpy()
  stop = int(np.argmax(ours == m.eos_id)) + 1 if (ours == m.eos_id).any() else len(ours)
  np.testing.assert_array_equal(ours[:stop], theirs[:stop])

  # Fine-tune 3 steps on the user's text, then export: transformers computes our logits.
  text = tmp_path / "train.txt"
  text.write_text("\n\n".join(shakespeare_lines(400)) + "\n")
  tuned = load_config(
    workdir / "config.yaml",
    [
      "data.dataset=files",
      f"data.train_files={text}",
      "data.max_length=32",
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
  out = jaxformer.export(workdir, tmp_path / "back")
  assert out["step"] == 3 and out["architecture"] == type(hf).__name__
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
  assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))(lines[0])["input_ids"] == ids[0]
  tuned_model = jaxformer.restore(workdir)
  ours = jaxformer.logits(tuned_model, batch)
  np.testing.assert_allclose(ours, _hf_logits(back, batch), atol=1e-4, rtol=1e-4)
  assert np.abs(ours - _hf_logits(hf, batch)).max() > 2e-4  # it did train (twice the tolerance above)
