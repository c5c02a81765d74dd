"""LoRA (`model.lora_*`, layers/lora.py, train/lora.py, interop/hf_peft.py): adapters beside the
named projections start as the base model's function, train alone (the base bitwise frozen, no
optimizer state for it), merge into the kernels exactly, run the same under scan, remat,
grad accumulation, meshes and the KV cache, fine-tune a workdir written without them, and export
merged or as a PEFT adapter that `peft` loads on top of the transformers base with our logits."""

from __future__ import annotations

import dataclasses
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, sweep, tiny_config

from jaxformer import sharding as sh
from jaxformer.config import ConfigError, MeshConfig, load_config
from jaxformer.data import global_batch
from jaxformer.inference import cache as kv
from jaxformer.layers import lora
from jaxformer.tasks import get_task
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_train_step

V, T = 64, 12
LLAMA = [
  "model.kind=decoder_only",
  "model.pre_norm=true",
  "model.position=rope",
  "model.norm=rmsnorm",
  "model.ffn=swiglu",
  "model.num_kv_heads=2",
  "model.tie_embeddings=false",
  "model.embedding_scale=false",
  f"model.vocab_size={V}",
  "model.d_model=32",
  "model.num_heads=4",
  "model.d_ff=48",
  "model.num_decoder_layers=2",
  "model.dropout_rate=0",
  "model.max_length=16",
  "data.max_length=16",
]
ALL = "model.lora_targets=[query,key,value,out,mlp_in,mlp_out]"
TRAIN = [
  "optim.optimizer=adamw",
  "optim.weight_decay=0.1",
  "optim.clip_grad_norm=1.0",
  "optim.schedule=constant",
  "optim.learning_rate=1e-2",
  "optim.warmup_steps=1",
  "optim.eps=1e-4",
]


def _config(*overrides: str):
  return tiny_config(None, *LLAMA, *overrides)


def _init(config, seed: int = 0):
  model = get_task(config).make_model()
  ids = jnp.ones((1, 4), jnp.int32)
  return model, jax.device_get(nn.meta.unbox(jax.jit(lambda k: model.init(k, ids))(jax.random.key(seed))["params"]))


def _tokens(seed: int = 1, batch: int = 2) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (batch, T), 1, V)


def _perturbed_adapters(params, seed: int = 2):
  """`params` with every adapter leaf (B too, zero at init) set to small random values."""
  adapters = lora.trainable(params)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = tree.unflatten([0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  return lora.replace(params, jax.device_get(noisy))


def _logits(model, params, tokens):
  return np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x))(params, tokens))


@pytest.mark.parametrize(
  "override, message",
  [
    ("model.lora_targets=[query,proj]", r"model.lora_targets: unknown target 'proj'; use a list among query, key"),
    ("model.lora_rank=-1", r"model.lora_rank must be >= 0 \(0 turns LoRA off\), got -1"),
    ("model.lora_alpha=0", r"model.lora_alpha must be a finite number > 0, got 0.0"),
    ("model.lora_targets=[]", r"must name each target once and at least one"),
    ("model.lora_targets=[query,query]", r"must name each target once"),
    ("model.lora_targets=query", r"model.lora_targets must be a list of str"),
  ],
)
def test_bad_lora_keys_are_one_line_errors(override, message):
  with pytest.raises(ConfigError, match=message) as error:
    _config("model.lora_rank=4", override)
  assert "\n" not in str(error.value)


def test_mlp_targets_on_a_mixture_of_experts_are_refused():
  moe = ["model.ffn=relu", "model.num_experts=4"]
  with pytest.raises(ConfigError, match=r"a mixture of experts \(model.num_experts=4\) has no dense FFN for mlp_in"):
    _config(*moe, "model.lora_rank=4", "model.lora_targets=[query,mlp_in]")
  config = _config(*moe, "model.lora_rank=4", "model.lora_targets=[query,out]")
  assert set(_init(config)[1]["layer_0"]["self_attention"]) >= {"query_lora_a", "out_lora_b"}


def test_encoder_decoder_adapts_self_and_cross_attention_and_merges():
  config = load_config(
    TINY,
    [
      "model.num_encoder_layers=1",
      "model.num_decoder_layers=1",
      "model.dropout_rate=0",
      "model.d_model=32",
      "model.d_ff=48",
      "model.lora_rank=2",
      "model.lora_alpha=2",
      ALL,
    ],
  )
  base_config = dataclasses.replace(config, model=dataclasses.replace(config.model, lora_rank=0))
  model, base_model = get_task(config).make_model(), get_task(base_config).make_model()
  src, tgt = _tokens(1), _tokens(2)
  params = jax.device_get(nn.meta.unbox(jax.jit(lambda k: model.init(k, src, tgt))(jax.random.key(0))["params"]))
  assert {"query_lora_a", "key_lora_b", "out_lora_a"} <= set(params["decoder_0"]["cross_attention"])
  tuned = _perturbed_adapters(params)
  forward = jax.jit(lambda m, p: m.apply({"params": p}, src, tgt), static_argnums=0)
  np.testing.assert_allclose(
    np.asarray(forward(base_model, lora.merge_params(tuned, 1.0))), np.asarray(forward(model, tuned)), atol=1e-5, rtol=0
  )


def test_adapters_shapes_axes_and_init():
  config = _config("model.lora_rank=4", ALL)
  model = get_task(config).make_model()
  boxed = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"]
  expected = {  # path -> (shape, logical axes): A keeps its kernel's input axes, B its output axes
    "self_attention/query_lora_a": ((32, 4), ("embed", "lora")),
    "self_attention/query_lora_b": ((4, 4, 8), ("lora", "heads", "kv")),
    "self_attention/key_lora_b": ((4, 2, 8), ("lora", "heads", "kv")),  # grouped-query: 2 key/value heads
    "self_attention/out_lora_a": ((4, 8, 4), ("heads", "kv", "lora")),
    "self_attention/out_lora_b": ((4, 32), ("lora", "embed")),
    "ffn/wi_lora_a": ((32, 4), ("embed", "lora")),
    "ffn/wi_gate_lora_b": ((4, 48), ("lora", "mlp")),
    "ffn/wo_lora_a": ((48, 4), ("mlp", "lora")),
    "ffn/wo_lora_b": ((4, 32), ("lora", "embed")),
  }
  for path, (shape, axes) in expected.items():
    module, name = path.split("/")
    box = boxed["layer_0"][module][name]
    assert (box.value.shape, box.names) == (shape, axes), path
  params = nn.meta.unbox(boxed)
  for path, leaf in jax.tree_util.tree_flatten_with_path(lora.trainable(params))[0]:
    name = path[-1].key
    if name.endswith("_lora_b"):
      assert not np.any(leaf), name  # B starts at zero
    else:  # A: Kaiming-uniform, U(-1/sqrt(fan_in), 1/sqrt(fan_in))
      bound = 1 / math.sqrt(math.prod(leaf.shape[:-1]))
      assert 0.5 * bound < np.abs(leaf).max() <= bound, name
  assert set(jax.tree.leaves(jax.tree.map(lambda x: x.ndim, lora.trainable(params)))) == {2, 3}
  assert not lora.has_adapters(_init(_config())[1])


@pytest.mark.parametrize("scan", sweep([False, True], {"unrolled"}, ids=["unrolled", "scanned"]))
def test_step_zero_is_the_base_and_merged_params_give_the_lora_logits(scan):
  base_config = _config(f"model.scan_layers={scan}")
  config = _config(f"model.scan_layers={scan}", "model.lora_rank=4", "model.lora_alpha=8", ALL)
  base_model, base = _init(base_config)
  model, fresh = _init(config, seed=5)
  tokens = _tokens()
  # Fresh adapters (B = 0) on the base params: exactly the base model's logits.
  start = lora.replace(fresh, base)
  np.testing.assert_array_equal(_logits(model, start, tokens), _logits(base_model, base, tokens))
  # Trained-like adapters change the function; merging them into the kernels keeps it.
  tuned = _perturbed_adapters(start)
  ours = _logits(model, tuned, tokens)
  assert np.abs(ours - _logits(base_model, base, tokens)).max() > 1e-2
  merged = lora.merge_params(tuned, 8 / 4)
  assert not lora.has_adapters(merged)
  np.testing.assert_allclose(_logits(base_model, merged, tokens), ours, atol=1e-5, rtol=0)


def test_cached_decoding_with_adapters_equals_the_full_forward():
  config = _config("model.lora_rank=4", ALL)
  model, params = _init(config)
  params = _perturbed_adapters(params)
  tokens = _tokens(batch=3)
  full = _logits(model, params, tokens)

  def cached(p, x, first=4):
    empty = kv.contiguous_cache(model, p, x.shape[0], first)
    logits, cache = kv.extend(model, p, empty, x[:, :first])
    steps = [logits]
    for t in range(first, x.shape[1]):
      logits, cache = kv.step(model, p, cache, x[:, t])
      steps.append(logits[:, None])
    return jnp.concatenate(steps, axis=1)

  np.testing.assert_allclose(np.asarray(jax.jit(cached)(params, tokens)), full, atol=1e-5, rtol=0)


def test_params_bfloat16_holds_the_frozen_kernels_in_bfloat16_with_the_same_forward():
  """`precision.policy=params=bfloat16` with LoRA: the frozen projection kernels are bfloat16 in the
  state (adapters, norms, embeddings float32) and, with bfloat16 compute, the logits are the same bits."""
  from jaxformer.train.state import abstract_state

  policy = "precision.policy=params=bfloat16,compute=bfloat16,output=float32"
  with pytest.raises(ConfigError, match=r"params=bfloat16: parameters and optimizer state stay float32 \(only a LoRA"):
    _config(policy)
  config = _config("model.lora_rank=4", policy)
  assert config.model.frozen_dtype == "bfloat16" and _config("model.lora_rank=4").model.frozen_dtype == "float32"
  model, params = _init(config)
  params = _perturbed_adapters(params)
  held = lora.hold_frozen(params, "bfloat16")
  np.testing.assert_array_equal(_logits(model, held, tokens := _tokens()), _logits(model, params, tokens))
  abstract, _ = abstract_state(model, make_optimizer(config.optim, config.model.d_model))
  dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_flatten_with_path(abstract.params)[0]}
  layer = "['layer_0']['self_attention']"
  assert dtypes[layer + "['query']"] == dtypes["['layer_1']['ffn']['wo']"] == jnp.bfloat16
  assert dtypes[layer + "['query_lora_a']"] == dtypes["['embed']['embedding']"] == jnp.float32
  assert lora.hold_frozen(params, "float32") is params
  assert lora.hold_frozen(lora.without_adapters(params), "bfloat16")["layer_0"]["ffn"]["wo"].dtype == np.float32


def _batch(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, V, (8, T + 1)).astype(np.int32)
  return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def _train(config, devices: int = 1, steps: int = 2, known=None):
  """(states after each step, host metrics) of `steps` train steps of `config` from seed 0 (with
  `known` params, e.g. a base model's, under the fresh adapters) on `devices` devices."""
  mesh = sh.make_mesh(config.mesh, jax.devices()[:devices])
  rules = sh.rules_for(config.mesh)
  model = get_task(config).make_model()
  tx = make_optimizer(config.optim, config.model.d_model)
  _, shardings = state_shardings(model, tx, mesh, rules)
  state = create_state(model, tx, mesh, 0, shardings, rules=rules, known=known)
  step = make_train_step(model, tx, config, mesh, shardings)
  states, metrics = [jax.device_get(state)], []
  for i in range(steps):
    state, m = step(state, global_batch(_batch(i), mesh, rules), jax.random.key(0))
    states.append(jax.device_get(state))
    metrics.append(jax.device_get(m))
  return states, metrics


def test_a_train_step_changes_only_the_adapters_which_alone_have_optimizer_state():
  config = _config("model.lora_rank=4", ALL, *TRAIN)
  (s0, s1, s2), metrics = _train(config)
  base0, base2 = lora.without_adapters(s0.params), lora.without_adapters(s2.params)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(base0)[0], jax.tree.leaves(base2), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))  # frozen, bitwise
  adapters = [jax.tree_util.tree_flatten_with_path(lora.trainable(s.params))[0] for s in (s0, s1, s2)]
  for (path, a0), (_, a1), (_, a2) in zip(*adapters):
    name = jax.tree_util.keystr(path)
    if name.endswith("_lora_a']"):
      # With B = 0, A's gradient is zero: step 1 only decays it (AdamW: lr 1e-2 x weight decay 0.1); step 2 trains it.
      np.testing.assert_allclose(a1, a0 * (1 - 1e-3), rtol=1e-6, err_msg=name)
    else:
      assert np.abs(a1 - a0).max() > 1e-3, name
    assert np.abs(a2 - a1).max() > 1e-3, name
  # The optimizer state: Adam's two moments of each adapter and scalars (counts), nothing of the base.
  shapes = sorted(x.shape for _, x in adapters[0])
  opt_leaves = jax.tree_util.tree_flatten_with_path(s2.opt_state)[0]
  assert sorted(x.shape for _, x in opt_leaves if x.ndim) == sorted(shapes * 2)
  assert all(lora.is_adapter(p[-1].key) for p, x in opt_leaves if x.ndim)
  assert all(np.isfinite(m["grad_norm"]) and m["skipped"] == 0 for m in metrics)


LORA_TRAIN = ("model.lora_rank=4", ALL, *TRAIN)


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
  """The losses of two LoRA train steps on one device, layers unrolled."""
  return [float(m["loss"]) for m in _train(_config(*LORA_TRAIN))[1]]


@pytest.mark.parametrize(
  "devices, overrides, mesh",
  [
    (1, ["model.scan_layers=true", "model.remat=full"], MeshConfig(1, 1, 1)),
    pytest.param(2, ["train.grad_accum_steps=2"], MeshConfig(1, 2, 1), marks=pytest.mark.slow),
    pytest.param(2, [], MeshConfig(1, 1, 2), marks=pytest.mark.slow),
    pytest.param(
      2, ["model.scan_layers=true", "train.microbatches=2"], MeshConfig(1, 1, 1, stage=2), marks=pytest.mark.slow
    ),
  ],
  ids=["scanned-remat", "fsdp2-accumulated", "tensor2", "pipeline-stage2"],
)
def test_scan_remat_accumulation_and_meshes_give_the_same_losses(reference_losses, devices, overrides, mesh):
  """Scanned with full remat, on fsdp=2 with two accumulation microbatches, on tensor=2, as a
  two-stage pipeline: the losses of unrolled single-device training (up to float rounding)."""
  config = dataclasses.replace(_config(*LORA_TRAIN, *overrides), mesh=mesh)
  losses = [float(m["loss"]) for m in _train(config, devices)[1]]
  np.testing.assert_allclose(losses, reference_losses, rtol=2e-5)


def _transformers_logits(model, tokens) -> np.ndarray:
  import torch

  with torch.no_grad():
    return model(input_ids=torch.tensor(np.asarray(tokens))).logits.numpy()


@pytest.mark.parametrize("scan", sweep([False, True], {"unrolled"}, ids=["unrolled", "scanned"]))
def test_merged_export_and_peft_adapter_give_our_logits(scan, tmp_path):
  """`hf_model` of a LoRA model is the merged one; the PEFT adapter (`peft_tensors`,
  `adapter_config`) loaded by `peft.PeftModel` on the transformers base gives our logits."""
  peft = pytest.importorskip("peft")
  pytest.importorskip("transformers")
  from safetensors.numpy import save_file

  from jaxformer.interop import hf_peft
  from jaxformer.interop.hf_export import hf_model

  config = _config(f"model.scan_layers={scan}", "model.lora_rank=4", "model.lora_alpha=8", ALL)
  model, params = _init(config)
  params = _perturbed_adapters(params)
  tokens = _tokens()
  ours = _logits(model, params, tokens)
  np.testing.assert_allclose(_transformers_logits(hf_model(config, params), tokens), ours, atol=1e-4, rtol=0)

  tensors, targets = hf_peft.peft_tensors(config, params)
  assert targets == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
  assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"].shape == (4, 32)  # [r, in]
  assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (16, 4)  # [out, r]
  assert tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"].shape == (4, 32)
  save_file(tensors, str(tmp_path / hf_peft.ADAPTER_WEIGHTS), metadata={"format": "pt"})
  settings = hf_peft.adapter_config(config, targets, "", "LlamaForCausalLM")
  (tmp_path / hf_peft.ADAPTER_CONFIG).write_text(json.dumps(settings))
  base_config = dataclasses.replace(config, model=dataclasses.replace(config.model, lora_rank=0))
  base = hf_model(base_config, lora.without_adapters(params))
  np.testing.assert_allclose(
    _transformers_logits(base, tokens),
    _logits(model, lora.replace(params, jax.tree.map(np.zeros_like, lora.trainable(params))), tokens),
    atol=1e-4,
    rtol=0,
  )
  tuned = peft.PeftModel.from_pretrained(base, str(tmp_path)).eval()
  np.testing.assert_allclose(_transformers_logits(tuned, tokens), ours, atol=1e-4, rtol=0)


def test_peft_format_is_for_lora_models_of_the_llama_family():
  from jaxformer.interop import hf_peft

  with pytest.raises(ConfigError, match=r"--lora-format peft writes LoRA adapters, and this workdir has none"):
    hf_peft.check_exportable(_config())
  gpt2 = load_config(
    TINY,
    ["model.kind=decoder_only", "model.pre_norm=true", "model.position=learned", "model.ffn=gelu", "model.lora_rank=4"],
  )
  with pytest.raises(ConfigError, match=r"for the Llama family .* not GPT2LMHeadModel .*--lora-format merged"):
    hf_peft.check_exportable(gpt2)


@pytest.mark.slow
def test_lora_fine_tunes_a_workdir_without_adapters_and_exports_merged_and_peft(multi30k_dir, tmp_path):
  """A workdir written by import (step 0, no adapters) trains with `model.lora_rank=4` from its
  step-0 params, frozen (held in bfloat16 by `params=bfloat16`), resumes from its own LoRA
  checkpoint (back under float32), and `jaxformer export` writes it merged and as a PEFT adapter,
  both giving our logits in transformers / peft."""
  peft = pytest.importorskip("peft")
  transformers = pytest.importorskip("transformers")
  from jaxformer.checkpoint import manager as ckpt
  from jaxformer.checkpoint import run_files as rf
  from jaxformer.cli import main
  from jaxformer.inference import restore as inference_restore
  from jaxformer.interop.hf_import import write_workdir
  from jaxformer.train.loop import train

  vocab, _ = get_task(load_config(TINY, [f"data.data_dir={multi30k_dir}"])).load_data(only=("test",))
  with open(tmp_path / "text.txt", "w") as f:  # a small corpus: the data is not the point here
    f.writelines(f"line {i}: a man rides a bicycle down the {i % 7}th street.\n" for i in range(400))
  data = [
    "data.dataset=files",
    f"data.train_files={tmp_path / 'text.txt'}",
    f"data.data_dir={tmp_path / 'data'}",
    "model.vocab_size=1000",
  ]
  base_config = _config(*data)
  _, base = _init(base_config)
  workdir = tmp_path / "imported"
  write_workdir(base_config, base, vocab.target, workdir, {"from_hf": "test", "architecture": "LlamaForCausalLM"})
  run = [
    "model.lora_rank=4",
    "model.lora_alpha=8",
    ALL,
    *TRAIN,
    "train.batch_size=8",
    "train.checkpoint_every=2",
    "train.eval_every=2",
    "train.eval_batches=2",
    "train.log_every=2",
    "train.async_checkpoint=false",
  ]
  bf16 = "precision.policy=params=bfloat16,compute=bfloat16,output=float32"
  train(load_config(workdir / rf.CONFIG_FILE, [*run, bf16, "train.num_steps=2"]), workdir)
  train(
    load_config(workdir / rf.CONFIG_FILE, [*run, "precision.policy=compute=float32", "train.num_steps=3"]), workdir
  )  # resumes with adapters
  assert ckpt.Checkpointer(workdir, read_only=True).all_steps() == [0, 2, 3]
  config = inference_restore.workdir_config(workdir)
  restored = inference_restore.restore(workdir, config)
  params = jax.device_get(restored.params)
  assert restored.step == 3 and config.model.lora_rank == 4
  for (path, a), b in zip(
    jax.tree_util.tree_flatten_with_path(base)[0], jax.tree.leaves(lora.without_adapters(params)), strict=True
  ):  # the imported params, frozen; the kernels were held in bfloat16
    held = a.astype(jnp.bfloat16).astype(np.float32) if path[-1].key in lora.COMPUTE_KERNELS else a
    np.testing.assert_array_equal(held, b, err_msg=jax.tree_util.keystr(path))
  assert all(
    np.abs(b).max() > 0
    for p, b in jax.tree_util.tree_flatten_with_path(lora.trainable(params))[0]
    if p[-1].key.endswith("_lora_b")
  )
  tokens = _tokens()
  ours = _logits(restored.model, params, tokens)

  assert main(["export", "--workdir", str(workdir), "--format", "hf", "--out", str(tmp_path / "merged")]) == 0
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
  assert json.loads((tmp_path / "merged" / "config.json").read_text())["jaxformer"]["model"]["lora_rank"] == 0
  np.testing.assert_allclose(_transformers_logits(merged, tokens), ours, atol=1e-4, rtol=0)

  out = tmp_path / "peft"
  assert main(["export", "--workdir", str(workdir), "--format", "hf", "--out", str(out), "--lora-format", "peft"]) == 0
  settings = json.loads((out / "adapter_config.json").read_text())
  assert (settings["r"], settings["lora_alpha"], settings["base_model_name_or_path"]) == (4, 8, str(out / "base"))
  base_model = transformers.AutoModelForCausalLM.from_pretrained(str(out / "base")).eval()
  tuned = peft.PeftModel.from_pretrained(base_model, str(out)).eval()
  np.testing.assert_allclose(_transformers_logits(tuned, tokens), ours, atol=1e-4, rtol=0)
  alone = peft.AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()  # finds its base by itself
  np.testing.assert_allclose(_transformers_logits(alone, tokens), ours, atol=1e-4, rtol=0)
