"""Reading a Hugging Face directory's weights without building the torch model
(`interop.hf_weights.HFWeights`, used by `hf_import.read_hf`): tiny models that transformers
writes itself (single file, sharded, float32/float16/bfloat16, a base model without its head, a
`pytorch_model.bin`), each tensor checked equal to the model's `state_dict()` in float32; and
every damaged or incomplete directory refused in one line, with `import_hf` leaving nothing behind.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from jaxformer.config import ConfigError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA = dict(
  vocab_size=64,
  hidden_size=16,
  intermediate_size=32,
  num_hidden_layers=1,
  num_attention_heads=2,
  num_key_value_heads=1,
  max_position_embeddings=32,
)
GPT2 = dict(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=1, eos_token_id=2)


def _llama(cls="LlamaForCausalLM", **kwargs):
  torch.manual_seed(0)
  return getattr(transformers, cls)(transformers.LlamaConfig(**LLAMA, **kwargs)).eval()


def _gpt2(cls="GPT2LMHeadModel"):
  torch.manual_seed(0)
  return getattr(transformers, cls)(transformers.GPT2Config(**GPT2)).eval()


def _state(model) -> dict[str, np.ndarray]:
  return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def _assert_reads(weights, want: dict[str, np.ndarray], names=None):
  """Every tensor `weights` lists (`names` of them, when given) equals `want`'s, exactly and as float32."""
  assert set(weights.names()) == set(names if names is not None else want)
  for name in weights.names():
    got = weights.get(name)
    assert got.dtype == np.float32 and weights.shape(name) == got.shape == want[name].shape, name
    np.testing.assert_array_equal(got, want[name], err_msg=name)


def _one_line_error(match: str, fn, *args):
  with pytest.raises(ConfigError, match=match) as info:
    fn(*args)
  assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
  return str(info.value)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_single_file_of_each_dtype_reads_as_the_state_dict(dtype, tmp_path, monkeypatch):
  from jaxformer.interop import hf_weights
  from jaxformer.interop.hf_weights import HFWeights

  monkeypatch.setattr(hf_weights, "CHUNK", 7)  # every tensor read in several chunks (odd-sized: a short last one)
  model = _llama().to(getattr(torch, dtype))
  model.save_pretrained(str(tmp_path))
  with HFWeights(tmp_path, "model") as weights:
    assert {weights.dtype(n) for n in weights} == {{"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]}
    _assert_reads(weights, _state(model))  # bf16/fp16 widen exactly: equal to torch's .float()
    assert "lm_head.weight" in weights and "lm_head" not in weights


def test_bfloat16_special_values_widen_exactly(tmp_path):
  from safetensors.torch import save_file

  from jaxformer.interop.hf_weights import HFWeights

  values = torch.tensor(
    [0.0, -0.0, 1.0, -1.5, 3.0e38, -3.0e38, 1e-40, float("inf"), float("-inf"), 2.0**-133, 0.1, float("nan")]
  ).to(torch.bfloat16)
  save_file({"x": values.reshape(3, 4)}, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text("{}")
  got = HFWeights(tmp_path).get("x")
  np.testing.assert_array_equal(got, values.float().reshape(3, 4).numpy())
  assert np.signbit(got[0, 1]) and np.isnan(got[2, 3])


def test_sharded_checkpoint_reads_every_shard(tmp_path):
  from jaxformer.interop.hf_weights import HFWeights

  model = _llama()
  model.save_pretrained(str(tmp_path), max_shard_size="4KB")
  shards = sorted(tmp_path.glob("model-*.safetensors"))
  assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
  _assert_reads(HFWeights(tmp_path, "model"), _state(model))


@pytest.mark.parametrize(
  "base, full, prefix", [("LlamaModel", "LlamaForCausalLM", "model"), ("GPT2Model", "GPT2LMHeadModel", "transformer")]
)
def test_base_model_file_gets_the_architecture_prefix(base, full, prefix, tmp_path):
  from jaxformer.interop.hf_weights import HFWeights

  model = _llama(base) if base.startswith("Llama") else _gpt2(base)
  model.save_pretrained(str(tmp_path))
  want = {f"{prefix}.{k}": v for k, v in _state(model).items()}
  weights = HFWeights(tmp_path, getattr(transformers, full).base_model_prefix)
  _assert_reads(weights, want)
  assert all(name.startswith(prefix + ".") for name in weights.names())
  # A full model's names already carry the prefix: none is added (the head keeps its own name).
  whole = _llama(full) if base.startswith("Llama") else _gpt2(full)
  whole.save_pretrained(str(tmp_path / "full"))
  names = set(HFWeights(tmp_path / "full", prefix).names())
  assert set(want) <= names <= set(whole.state_dict())  # GPT-2 ties its head: no lm_head.weight in the file


def test_buffers_that_are_not_weights_are_left_out(tmp_path):
  """GPT-2's hub files (no `transformer.` prefix) hold causal-mask buffers; older files position ids."""
  from safetensors.numpy import save_file

  from jaxformer.interop.hf_weights import HFWeights

  state = _state(_gpt2("GPT2Model"))
  mask = np.tril(np.ones((1, 1, 32, 32), np.float32))
  save_file(
    {
      **state,
      "h.0.attn.bias": mask,
      "h.0.attn.masked_bias": np.array(-1e4, np.float32),
      "embeddings.position_ids": np.arange(32, dtype=np.int64)[None],
    },
    str(tmp_path / "model.safetensors"),
  )
  (tmp_path / "config.json").write_text("{}")
  weights = HFWeights(tmp_path, "transformer")
  _assert_reads(weights, {f"transformer.{k}": v for k, v in state.items()})
  assert "transformer.h.0.attn.c_attn.bias" in weights  # a real bias ending in "attn.bias" stays


def test_legacy_layernorm_names_read_as_the_state_dict_names(tmp_path):
  """BERT's hub files name LayerNorm parameters `gamma`/`beta` (and leave out the `bert.` of the base model)."""
  from safetensors.numpy import save_file

  from jaxformer.interop.hf_weights import HFWeights

  torch.manual_seed(0)
  model = transformers.BertModel(
    transformers.BertConfig(
      vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    ),
    add_pooling_layer=False,
  )
  state = _state(model)
  legacy = {
    k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
    for k, v in state.items()
  }
  assert sum(k.endswith(".gamma") for k in legacy) == 3
  save_file(legacy, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text("{}")
  _assert_reads(
    HFWeights(tmp_path, transformers.BertForMaskedLM.base_model_prefix), {f"bert.{k}": v for k, v in state.items()}
  )


@pytest.mark.parametrize("sharded", [False, True])
def test_pytorch_bin_is_converted_outside_the_model_directory(sharded, tmp_path):
  from jaxformer.interop.hf_weights import HFWeights

  model = _gpt2()  # tied: lm_head.weight shares wte's storage, and the pickle holds both names
  model.config.save_pretrained(str(tmp_path))
  if sharded:
    state = list(model.state_dict().items())
    halves = {"pytorch_model-00001-of-00002.bin": dict(state[:5]), "pytorch_model-00002-of-00002.bin": dict(state[5:])}
    for name, part in halves.items():
      torch.save(part, tmp_path / name)
    weight_map = {k: name for name, part in halves.items() for k in part}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
  else:
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
  before = sorted(p.name for p in tmp_path.iterdir())
  with HFWeights(tmp_path, "transformer") as weights:
    converted = weights._tmp
    assert converted is not None and converted.is_dir() and tmp_path not in converted.parents
    _assert_reads(weights, _state(model))
    assert "lm_head.weight" in weights
  assert not converted.exists()  # removed when closed
  assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_pytorch_bin_without_torch_names_the_install(tmp_path, monkeypatch):
  from jaxformer.interop.hf_weights import HFWeights

  (tmp_path / "config.json").write_text("{}")
  torch.save(_gpt2().state_dict(), tmp_path / "pytorch_model.bin")
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
  message = _one_line_error("pytorch_model.bin", HFWeights, tmp_path)
  assert 'pip install "jaxformer[hf]"' in message and "save_pretrained(safe_serialization=True)" in message


def _damage(tmp_path, kind: str):
  """A Llama directory damaged as `kind` says; the error's expected words."""
  _llama().save_pretrained(str(tmp_path), **({"max_shard_size": "4KB"} if kind == "missing shard" else {}))
  if kind == "no config":
    (tmp_path / "config.json").unlink()
    return "config.json is missing"
  if kind == "no weights":
    (tmp_path / "model.safetensors").unlink()
    return "holds no weights.*download"
  if kind == "truncated":
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    return "model.safetensors is truncated or corrupt.*download it again"
  if kind == "corrupt header":
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    data[8:16] = b"\xff" * 8
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    return "model.safetensors is truncated or corrupt.*download it again"
  if kind == "missing shard":
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    return f"names {shard}, which is missing.*download every shard"
  if kind == "corrupt bin":
    (tmp_path / "model.safetensors").unlink()
    torch.save(_llama().state_dict(), tmp_path / "pytorch_model.bin")
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    return "pytorch_model.bin cannot be read as a torch state dict.*download it again"
  raise AssertionError(kind)


KINDS = ["no config", "no weights", "truncated", "corrupt header", "missing shard", "corrupt bin"]


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_directory_is_one_line(kind, tmp_path):
  from jaxformer.interop.hf_weights import HFWeights

  match = _damage(tmp_path, kind)
  _one_line_error(match, HFWeights, tmp_path, "model")


@pytest.mark.parametrize("kind", ["no weights", "truncated", "missing shard", "no tokenizer"])
def test_import_of_a_damaged_directory_writes_nothing(kind, tmp_path):
  from jaxformer.interop.hf_import import import_hf

  if kind == "no tokenizer":  # refused before any weight is read
    _llama().save_pretrained(str(tmp_path / "hf"))
    match = "has no tokenizer .*save the model's tokenizer beside it"
  else:
    match = _damage(tmp_path / "hf", kind)
    import tokenizers

    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    (tmp_path / "hf" / "tokenizer.json").write_text(words.to_str())  # a tokenizer: the weights fail first
  _one_line_error(match, import_hf, tmp_path / "hf", tmp_path / "run")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no workdir, no run.incomplete


def test_read_hf_returns_the_files_tensors_by_state_dict_name(tmp_path):
  from jaxformer.interop.hf_import import read_hf

  llama = _llama().to(torch.bfloat16)
  llama.save_pretrained(str(tmp_path / "llama"), max_shard_size="4KB")
  _, tensors = read_hf(tmp_path / "llama")
  want = _state(llama)
  assert tensors.keys() == want.keys()
  for name, value in want.items():
    assert tensors[name].dtype == np.float32
    np.testing.assert_array_equal(tensors[name], value, err_msg=name)
  gpt2 = _gpt2()  # tied: transformers leaves lm_head.weight out of the file, and so does read_hf
  gpt2.save_pretrained(str(tmp_path / "gpt2"))
  _, tensors = read_hf(tmp_path / "gpt2")
  want = _state(gpt2)
  assert tensors.keys() == want.keys() - {"lm_head.weight"}
  for name, value in tensors.items():
    np.testing.assert_array_equal(value, want[name], err_msg=name)


@pytest.mark.parametrize("tied", [False, True])
def test_params_read_one_tensor_at_a_time_are_those_of_the_state_dict(tied, tmp_path):
  """Import reads each tensor on request (`open_hf`), converting and checking it before the next:
  the params equal those of the whole state dict (`read_hf`), and a scanned layout's stacks, filled
  as each layer is read, equal `layout.stack_layers` of the unrolled params."""
  import dataclasses

  import jax

  from jaxformer.interop.hf_import import open_hf, params_from_hf, read_hf
  from jaxformer.interop.links import flatten
  from jaxformer.models import layout
  from jaxformer.tasks import get_task

  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(
    transformers.LlamaConfig(**{**LLAMA, "num_hidden_layers": 3}, tie_word_embeddings=tied)
  )
  model.to(torch.bfloat16).save_pretrained(str(tmp_path))
  config, tensors = read_hf(tmp_path)
  unrolled = dataclasses.replace(config, model=dataclasses.replace(config.model, scan_layers=False))
  scanned = dataclasses.replace(config, model=dataclasses.replace(config.model, scan_layers=True))
  want = params_from_hf(unrolled, tensors)
  with open_hf(tmp_path)[1] as weights:
    got = flatten(params_from_hf(unrolled, weights))
    assert got.keys() == flatten(want).keys()
    for name, value in flatten(want).items():
      np.testing.assert_array_equal(got[name], value, err_msg=name)
    stacked = params_from_hf(scanned, weights)
  want = layout.stack_layers(want, layout.layer_stacks(get_task(scanned).make_model()))
  assert jax.tree.structure(stacked) == jax.tree.structure(want)
  for got, value in zip(jax.tree.leaves(stacked), jax.tree.leaves(want)):
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.asarray(value))


def test_blockwise_allclose_is_numpys():
  from jaxformer.interop.links import allclose

  rng = np.random.default_rng(0)
  for shape in [(), (5,), (7, 3), (0, 4), (6, 2, 3)]:
    a = rng.standard_normal(shape).astype(np.float32)
    for b in (a.copy(), a + np.float32(1e-7), a * np.float32(1 + 1e-3)):
      assert allclose(a, b, block=4) == np.allclose(a, b, rtol=1e-5, atol=1e-6), shape
  assert not allclose(np.zeros((9, 2)), np.eye(9, 2), block=2)


def test_import_failing_while_writing_leaves_nothing(tmp_path, monkeypatch):
  """A failure after the temporary workdir exists (here: the checkpoint save) removes it."""
  from conftest import TINY

  from jaxformer.checkpoint import manager as ckpt
  from jaxformer.config import load_config
  from jaxformer.interop.hf_import import write_workdir

  class Tokenizer:
    serialized = b"not a real tokenizer"

  def fail(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(ckpt, "save_host_params", fail)
  with pytest.raises(OSError, match="disk full"):
    write_workdir(load_config(TINY), {"w": np.zeros(2, np.float32)}, Tokenizer(), tmp_path / "run", {})
  assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_nothing(tmp_path):
  from jaxformer.interop.hf_export import staged_dir

  out = tmp_path / "export"
  with pytest.raises(RuntimeError, match="disk full"), staged_dir(out) as tmp:
    (tmp / "config.json").write_text("{}")
    raise RuntimeError("disk full")
  assert list(tmp_path.iterdir()) == []
  with staged_dir(out) as tmp:
    (tmp / "config.json").write_text("{}")
  assert [p.name for p in tmp_path.iterdir()] == ["export"] and (out / "config.json").is_file()
