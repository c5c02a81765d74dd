"""The benchmark: the FLOPs formula against a hand count and XLA's count, the compute-dtype
probe, the `jaxformer bench` command's JSON, and (with torch installed) the torch peer."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import tiny_config

from jaxformer.bench import flops
from jaxformer.bench import step as bench
from jaxformer.config import ModelConfig, config_from_dict

ROOT = Path(__file__).parent.parent


def _hand_count_forward(d, f, v, s, t, encoder_layers, decoder_layers):
  """Every matmul of one sentence pair's forward pass as (rows, contraction, columns)."""
  encoder_layer = [(s, d, d)] * 4 + [(s, d, s), (s, s, d)] + [(s, d, f), (s, f, d)]
  decoder_layer = (
    [(t, d, d)] * 4
    + [(t, d, t), (t, t, d)]  # masked self-attention
    + [(t, d, d), (s, d, d), (s, d, d), (t, d, d), (t, d, s), (t, s, d)]  # cross-attention
    + [(t, d, f), (t, f, d)]
  )
  matmuls = encoder_layer * encoder_layers + decoder_layer * decoder_layers + [(t, d, v)]
  return sum(2 * m * k * n for m, k, n in matmuls)


def test_train_flops_match_a_hand_count():
  m = ModelConfig(vocab_size=37, d_model=8, num_heads=2, d_ff=12, num_encoder_layers=2, num_decoder_layers=1)
  hand = _hand_count_forward(d=8, f=12, v=37, s=5, t=3, encoder_layers=2, decoder_layers=1)
  assert flops.forward_flops_per_pair(m, 5, 3) == hand == 17_840
  assert flops.train_flops_per_step(m, batch_size=4, src_length=5, tgt_length=3) == 3 * 4 * 17_840


def test_decoder_only_flops_count_gqa_and_gated_ffn():
  """One layer, D 8, 4 heads of 2 with 2 key/value heads (C 4), SwiGLU F 12, V 37, T 3: per token
  Q and output 2·2·64, K and V 2·2·8·4, FFN 3·2·8·12, attention 4·3·8; logits 2·8·37."""
  m = ModelConfig(
    kind="decoder_only",
    vocab_size=37,
    d_model=8,
    num_heads=4,
    num_kv_heads=2,
    d_ff=12,
    num_decoder_layers=1,
    ffn="swiglu",
  )
  per_token = 2 * 2 * 64 + 2 * 2 * 8 * 4 + 3 * 2 * 8 * 12 + 4 * 3 * 8 + 2 * 8 * 37
  assert flops.forward_flops_per_pair(m, 99, 3) == 3 * per_token == 4_944
  assert bench.BenchOptions(4, src_length=5, tgt_length=3).validate(m).src_length == 3


def _config(policy="params=float32,compute=float32,output=float32"):
  tree = {
    "model": {
      "vocab_size": 997,
      "d_model": 256,
      "num_heads": 4,
      "d_ff": 1024,
      "num_encoder_layers": 2,
      "num_decoder_layers": 2,
      "dropout_rate": 0.0,
    },
    "precision": {"policy": policy},
  }
  return config_from_dict(tree)


@pytest.fixture(scope="module")
def lowered_fp32():
  options = bench.BenchOptions(batch_size=8, src_length=13, tgt_length=11, steps=1, warmup=0, peer=False)
  return bench.prepare_step(_config(), options).lowered


def test_train_flops_match_xla_within_5_percent(lowered_fp32):
  # XLA also counts elementwise work (LayerNorm, softmax, Adam: ~1 FLOP per element),
  # which at this shape adds ~2% to the matmuls; the formula must be within 5%.
  m = _config().model
  formula = flops.train_flops_per_step(m, batch_size=8, src_length=13, tgt_length=11)
  xla = lowered_fp32.cost_analysis()["flops"]
  assert formula <= xla <= 1.05 * formula


def test_compute_dtype_is_read_from_the_program(lowered_fp32):
  assert bench.compute_dtype(lowered_fp32) == "f32"
  options = bench.BenchOptions(batch_size=8, src_length=13, tgt_length=11, steps=1, warmup=0, peer=False)
  lowered = bench.prepare_step(_config("params=float32,compute=bfloat16,output=float32"), options).lowered
  counts = flops.dot_dtypes(lowered.as_text())
  assert bench.compute_dtype(lowered) == "bf16" and counts["bf16"] > counts["f32"]


def test_published_peak_lookup():
  assert flops.published_peak("NVIDIA H100 80GB HBM3", low_precision=True) == 989.4e12
  assert flops.published_peak("NVIDIA H100 PCIe", low_precision=False) == 378e12
  assert flops.published_peak("TPU v5 lite", low_precision=True) == 197e12
  assert flops.published_peak("cpu", low_precision=False) is None


def _run_bench(*args):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  return subprocess.run(
    [sys.executable, "-m", "jaxformer", "bench", "--config", str(ROOT / "configs" / "tiny.yaml"), *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=300,
  )


_SMALL = (
  "--batch-size",
  "8",
  "--src-length",
  "11",
  "--tgt-length",
  "7",
  "--steps",
  "3",
  "--warmup",
  "1",
  "--no-torch",
  "model.d_model=32",
  "model.d_ff=48",
  "model.num_heads=4",
  "model.vocab_size=37",
  "model.num_encoder_layers=1",
  "model.num_decoder_layers=1",
)


@pytest.fixture(scope="module")
def bench_runs():
  """(stdout lines, JSON) of `jaxformer bench` with one and with two steps per call."""
  runs = {}
  for k in (1, 2):
    proc = _run_bench(*_SMALL, f"train.steps_per_call={k}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    runs[k] = lines, json.loads(lines[-1])
  return runs


@pytest.mark.slow
def test_bench_command_prints_a_table_and_json(bench_runs):
  lines, r = bench_runs[1]
  assert any(line.startswith("target tokens/s") for line in lines)
  for key in (
    "tokens_per_sec",
    "step_time_s",
    "mfu",
    "peak_flops",
    "compile_time_s",
    "temp_memory_bytes",
    "model_flops_per_token",
    "achieved_flops",
    "xla_flops_per_step",
    "losses",
  ):
    assert key in r, key
  assert r["bubble_fraction"] == 0.0  # no mesh.stage, no pipeline (tests/test_pipeline.py: with one)
  assert "torch_tokens_per_sec" not in r
  assert r["num_devices"] == 8 and r["mesh"] == {
    "data": 8,
    "stage": 1,
    "fsdp": 1,
    "context": 1,
    "expert": 1,
    "tensor": 1,
  }
  assert math.isclose(r["tokens_per_sec"], 8 * 7 / r["step_time_s"])
  m = ModelConfig(vocab_size=37, d_model=32, num_heads=4, d_ff=48, num_encoder_layers=1, num_decoder_layers=1)
  assert r["model_flops_per_step"] == flops.train_flops_per_step(m, 8, 11, 7)
  assert math.isclose(r["mfu"], r["model_flops_per_step"] / r["step_time_s"] / r["peak_flops"])
  assert r["temp_memory_bytes"] > 0 and r["peak_source"] == "measured float32 matmul"
  assert len(r["losses"]) == 4 and r["losses"][-1] < r["losses"][0]  # 1 warm-up + 3 timed steps, learning


@pytest.mark.slow
def test_bench_with_two_steps_per_call_runs_the_same_steps(bench_runs):
  one, two = bench_runs[1][1], bench_runs[2][1]
  # Whole calls: 1 warm-up step -> 1 call (2 steps), 3 timed steps -> 2 calls (4 steps).
  assert (two["steps_per_call"], two["warmup"], two["steps"]) == (2, 2, 4)
  assert len(two["losses"]) == 6 and two["xla_flops_per_step"] is None
  # The same batch and dropout keys step by step: the 1-step run's losses, then more learning.
  assert two["losses"][:4] == pytest.approx(one["losses"], rel=1e-5)
  assert two["losses"][-1] < two["losses"][3]
  assert math.isclose(two["tokens_per_sec"], 8 * 7 / two["step_time_s"])


def test_bench_rejects_a_length_beyond_the_model_and_other_model_kinds():
  proc = _run_bench("--tgt-length", "500", "--no-torch")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
    "error: bench length 500 exceeds model.max_length=128; add model.max_length=500"
  ]
  proc = _run_bench("--no-torch", "model.kind=encoder_only", "data.dataset=tinyshakespeare")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
    "error: jaxformer bench times encoder_decoder and decoder_only train steps, not model.kind=encoder_only; "
    "use e.g. configs/multi30k_small.yaml or configs/decoder_1b.yaml"
  ]


def test_torch_peer_has_our_parameter_count():
  pytest.importorskip("torch")
  from jaxformer.bench.torch_peer import PeerTransformer, count_parameters
  from jaxformer.models.transformer import EncoderDecoder
  from jaxformer.train.optim import make_optimizer
  from jaxformer.train.state import abstract_state

  for overrides in ({}, {"tie_embeddings": False}, {"pre_norm": True}):
    m = dataclasses.replace(_config().model, vocab_size=37, d_model=16, d_ff=24, **overrides)
    abstract, _ = abstract_state(EncoderDecoder(m), make_optimizer(_config().optim, m.d_model))
    ours = sum(x.size for x in jax.tree.leaves(abstract.params))
    assert count_parameters(PeerTransformer(m)) == ours, overrides


@pytest.mark.parametrize("pre_norm", [True, False])
def test_decoder_only_peer_is_our_model_in_torch(pre_norm):
  """Our `DecoderOnly` parameters copied into `PeerDecoderOnly` give our logits, and the two
  count the same parameters (tied and untied)."""
  torch = pytest.importorskip("torch")
  import flax.linen as fnn
  import jax.numpy as jnp
  import numpy as np

  from jaxformer.bench.torch_peer import PeerDecoderOnly, count_parameters
  from jaxformer.models.decoder_only import DecoderOnly

  m = tiny_config("decoder_only", "model.vocab_size=37", "model.num_heads=2", "model.dropout_rate=0.0").model
  m = dataclasses.replace(m, pre_norm=pre_norm)
  tokens = np.random.default_rng(0).integers(3, 37, (3, 11)).astype(np.int32)
  params = fnn.unbox(DecoderOnly(m).init(jax.random.key(0), jnp.asarray(tokens))["params"])
  noise = np.random.default_rng(1)  # so that norm scales and biases differ from their initial 1 and 0
  params = jax.tree.map(lambda x: x + 0.1 * noise.standard_normal(x.shape, np.float32), params)
  peer = PeerDecoderOnly(m).eval()
  t = lambda x: torch.from_numpy(np.array(x, dtype=np.float32))  # noqa: E731
  d = m.d_model
  with torch.no_grad():
    peer.embed.weight.copy_(t(params["embed"]["embedding"]))
    norms = [(peer.stack.norm, params["final_norm"])] if pre_norm else []
    for i, layer in enumerate(peer.stack.layers):
      p = params[f"layer_{i}"]
      qkv = [p["self_attention"][name].reshape(d, d).T for name in ("query", "key", "value")]
      layer.self_attn.in_proj_weight.copy_(t(np.concatenate(qkv)))
      layer.self_attn.out_proj.weight.copy_(t(p["self_attention"]["out"].reshape(d, d).T))
      layer.linear1.weight.copy_(t(p["ffn"]["wi"].T))
      layer.linear1.bias.copy_(t(p["ffn"]["bi"]))
      layer.linear2.weight.copy_(t(p["ffn"]["wo"].T))
      layer.linear2.bias.copy_(t(p["ffn"]["bo"]))
      norms += [(layer.norm1, p["attention_sublayer"]["norm"]), (layer.norm2, p["ffn_sublayer"]["norm"])]
    for norm, ours in norms:
      norm.weight.copy_(t(ours["scale"]))
      norm.bias.copy_(t(ours["bias"]))
    theirs = peer(torch.from_numpy(tokens.astype(np.int64))).numpy()
  np.testing.assert_allclose(theirs, DecoderOnly(m).apply({"params": params}, jnp.asarray(tokens)), atol=2e-5)
  assert count_parameters(peer) == sum(x.size for x in jax.tree.leaves(params))
  untied = dataclasses.replace(m, tie_embeddings=False)
  untied_params = jax.eval_shape(lambda: DecoderOnly(untied).init(jax.random.key(0), jnp.asarray(tokens)))
  assert count_parameters(PeerDecoderOnly(untied)) == sum(x.size for x in jax.tree.leaves(untied_params))


def test_profile_script_groups_instructions_by_opcode_and_scope():
  """benchmarks/profile_train_step.py: a dot is a matmul, a scoped op takes its scope's group, a
  while loop is control flow (None), and busy time is the union of overlapping events."""
  import importlib.util

  import jax.numpy as jnp

  spec = importlib.util.spec_from_file_location("profile_train_step", ROOT / "benchmarks" / "profile_train_step.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)

  def f(x, w):
    with jax.named_scope("optimizer"):
      y = jnp.tanh(x) * 3.0
    return jax.lax.fori_loop(0, 3, lambda i, h: jnp.dot(h, w), y)

  x = jnp.ones((8, 8))
  hlo = jax.jit(f).lower(x, x).compile().as_text()
  groups = script.instruction_groups(hlo)
  ops = {
    line.split(" = ")[0].strip().removeprefix("ROOT ").lstrip("%"): line for line in hlo.splitlines() if " = " in line
  }
  by_opcode = {op: [groups[n] for n, line in ops.items() if f" {op}(" in line] for op in ("dot", "tanh", "while")}
  assert by_opcode == {"dot": ["matmuls"], "tanh": ["optimizer"], "while": [None]}, by_opcode
  assert script.union_ns([(0, 10), (5, 10), (20, 5)]) == 20


def test_torch_trainer_fits_a_decoder_only_batch():
  """The decoder-only peer's trainer (what `jaxformer bench` times) learns a fixed batch of next
  tokens (its targets the inputs shifted by one): 20 Adam steps take its loss under half."""
  pytest.importorskip("torch")
  import numpy as np

  from jaxformer.bench.torch_peer import TorchTrainer

  overrides = ("model.vocab_size=37", "model.dropout_rate=0.0", "optim.schedule=constant", "optim.learning_rate=3e-3")
  config = tiny_config("decoder_only", *overrides)
  tokens = np.random.default_rng(0).integers(3, 37, (4, 17)).astype(np.int32)
  trainer = TorchTrainer(config, tokens[:, :-1], tokens[:, 1:], translates=False)
  losses = [trainer() for _ in range(20)]
  assert losses[-1] < 0.5 * losses[0], losses
