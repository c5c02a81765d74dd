"""Mixture of experts (`layers/moe.py`): the layer against a per-token reference (capacity
drops included), the router losses against hand-computed values, the auxiliary-loss channel
(scanned = unrolled, the router learns from the aux loss), one-line config errors, and the
same training on every expert mesh."""

import dataclasses
import json
import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import sharding as sh
from jaxformer.config import ConfigError, MeshConfig, load_config
from jaxformer.layers.moe import AUX, MixtureOfExperts, expert_capacity, route
from jaxformer.runtime.startup import build_mesh
from jaxformer.tasks import get_task
from jaxformer.tasks.objective import loss_fn
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import abstract_state, create_state
from jaxformer.train.step import make_train_step

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
MOE = [
  "model.kind=decoder_only",
  "model.num_experts=4",
  "model.experts_per_token=2",
  "model.expert_capacity_factor=1.0",
  "model.dropout_rate=0.0",
]


def _reference(params, x, valid, k, capacity):
  """The layer token by token in float64 numpy: each row fills the experts' buffers in token
  order, a token's choices in rank order; a choice past an expert's capacity adds nothing."""
  p = {name: np.asarray(v, np.float64) for name, v in params.items()}
  batch, length, _ = x.shape
  num_experts = p["router"].shape[1]
  y = np.zeros_like(x)
  load, dropped, balance, z = np.zeros(num_experts), 0, 0.0, 0.0
  for b in range(batch):
    filled, chosen_row, prob_row = np.zeros(num_experts), np.zeros(num_experts), np.zeros(num_experts)
    for t in range(length):
      if not valid[b, t]:
        continue
      logits = x[b, t] @ p["router"]
      probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
      z += np.log(np.exp(logits).sum()) ** 2
      prob_row += probs
      top = np.argsort(-probs)[:k]
      gates = probs[top] / probs[top].sum() if k > 1 else probs[top]
      for e, gate in zip(top, gates):
        load[e] += 1
        chosen_row[e] += 1
        if filled[e] < capacity:
          hidden = np.maximum(x[b, t] @ p["wi"][e] + p["bi"][e], 0.0)
          y[b, t] += gate * (hidden @ p["wo"][e] + p["bo"][e])
        else:
          dropped += 1
        filled[e] += 1
    tokens = valid[b].sum()
    balance += num_experts * np.sum(chosen_row / k * prob_row / max(tokens, 1))
  return y, {"router_load": load, "router_dropped": dropped, "router_balance": balance, "router_z": z}


@pytest.mark.parametrize("factor, k", [(0.6, 2), (0.0, 2), (0.5, 1)], ids=["drops-top2", "no-limit", "drops-top1"])
def test_layer_equals_per_token_reference(factor, k):
  batch, length, d_model, experts = 2, 7, 6, 4
  layer = MixtureOfExperts(experts, k, d_ff=5, capacity_factor=factor)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch, length, d_model)).astype(np.float32)
  valid = np.ones((batch, length), bool)
  valid[1, 5:] = False
  params = nn.meta.unbox(jax.jit(layer.init)(jax.random.key(0), x, valid)["params"])
  params = {
    name: v + 0.3 * rng.normal(size=v.shape).astype(np.float32) if name.startswith("b") else v
    for name, v in params.items()
  }  # nonzero biases
  y, state = jax.jit(lambda p: layer.apply({"params": p}, x, valid, mutable=[AUX]))(params)
  capacity = expert_capacity(length, experts, k, factor)
  ref, stats = _reference(params, x.astype(np.float64), valid, k, capacity)
  np.testing.assert_allclose(y, ref, atol=1e-5)
  for name, value in stats.items():
    np.testing.assert_allclose(state[AUX][name], value, rtol=1e-5, err_msg=name)
  assert (stats["router_dropped"] > 0) == (factor > 0)  # the cases do exercise the capacity
  assert capacity == {0.6: 3, 0.0: 7, 0.5: 1}[factor]


def test_router_losses_and_drops_by_hand():
  """One row, 2 experts, top-1, capacity 1: tokens 0 and 1 both pick expert 1 with p = 3/4
  (logits 0, ln 3); token 1 comes second and is dropped; token 2 is padding."""
  logits = jnp.array([[[0.0, math.log(3.0)], [0.0, math.log(3.0)], [50.0, 0.0]]])
  route_jit = jax.jit(route, static_argnames=("k", "capacity"))
  routing = route_jit(logits, jnp.array([[True, True, False]]), k=1, capacity=1)
  stats = {k: float(v) for k, v in routing.stats.items() if k != "router_load"}
  # f = (0, 1), P = (1/4, 3/4): E * sum f P = 2 * 3/4 = 1.5 per token, times 2 real tokens.
  assert stats["router_balance"] == pytest.approx(3.0)
  assert stats["router_z"] == pytest.approx(2 * math.log(4.0) ** 2)  # logsumexp = ln(1 + 3)
  assert stats["router_dropped"] == 1.0
  np.testing.assert_array_equal(routing.stats["router_load"], [0.0, 2.0])
  np.testing.assert_allclose(routing.combine[0, :, :, 0], [[0.0, 0.75], [0.0, 0.0], [0.0, 0.0]])  # raw top-1 gate
  top2 = route_jit(jnp.log(jnp.array([[[0.5, 0.3, 0.2]]])), None, k=2, capacity=1)
  np.testing.assert_allclose(top2.combine[0, 0, :, 0], [0.625, 0.375, 0.0], rtol=1e-6)  # renormalised over 2


def test_capacity_drops_keep_a_decoder_causal():
  """Expert buffers fill in token order, so with tokens dropped the logits of positions < 6 do
  not depend on the tokens from 6 on (which change the drops after them)."""
  _, model, params = _lm("model.expert_capacity_factor=0.5")
  tokens = jnp.asarray(_lm_batch()["inputs"])
  changed = tokens.at[:, 6:].set((tokens[:, 6:] + 7) % 990 + 3)
  forward = jax.jit(lambda x: model.apply({"params": params}, x, mutable=[AUX]))
  (full, aux), (other, _) = forward(tokens), forward(changed)
  np.testing.assert_allclose(other[:, :6], full[:, :6], atol=1e-6)
  assert float(aux[AUX]["layer_1"]["ffn"]["router_dropped"]) > 0 and np.abs(other[:, 6:] - full[:, 6:]).max() > 1e-3


def _lm(*overrides):
  """(task, model, params) of the tiny decoder-only MoE with `overrides`."""
  config = load_config(TINY, [*MOE, *overrides])
  task = get_task(config)
  model = task.make_model()
  ids = jnp.ones((1, 8), jnp.int32)
  return task, model, nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), ids, ids)["params"])


def _loss_and_grads(overrides, batch):
  task, model, params = _lm(*overrides)
  grad_fn = jax.value_and_grad(lambda p: loss_fn(task, model, p, batch, None, 0.0), has_aux=True)
  (loss, sums), grads = jax.jit(grad_fn)(params)
  return loss, sums, grads


def _lm_batch(rows=4, length=11, seed=0):
  ids = np.random.default_rng(seed).integers(3, 1000, size=(rows, length + 1)).astype(np.int32)
  ids[1, 8:] = 0
  return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


@pytest.mark.slow
def test_scan_layers_and_remat_change_nothing():
  batch = _lm_batch()
  loss, sums, grads = _loss_and_grads([], batch)
  scan_loss, scan_sums, scan_grads = _loss_and_grads(["model.scan_layers=true", "model.remat=minimal"], batch)
  assert float(loss) == pytest.approx(float(scan_loss), rel=1e-6)
  for name in ("router_balance", "router_z", "router_dropped", "router_load"):
    np.testing.assert_allclose(sums[name], scan_sums[name], rtol=1e-6)
  assert sums["router_load"].shape == (2, 4) and float(sums["router_dropped"]) > 0
  np.testing.assert_allclose(scan_grads["layer"]["ffn"]["router"][1], grads["layer_1"]["ffn"]["router"], atol=1e-6)


def test_auxiliary_losses_enter_loss_and_gradient():
  """The loss is the NLL plus (w_aux * balance + w_z * z) / target tokens, and the router learns
  from the router terms alone."""
  task, model, params = _lm("model.router_aux_loss=0.5", "model.router_z_loss=0.25")
  batch = _lm_batch()

  def parts(p):  # (the loss, its NLL part, its router part), label smoothing and logit z-loss off
    loss, s = loss_fn(task, model, p, batch, None, 0.0)
    return loss, s["nll"] / s["num_tokens"], (0.5 * s["router_balance"] + 0.25 * s["router_z"]) / s["num_tokens"]

  values, grads = jax.jit(lambda p: (parts(p), [jax.grad(lambda q, i=i: parts(q)[i])(p) for i in range(3)]))(params)
  loss, nll, router_terms = map(float, values)
  assert loss == pytest.approx(nll + router_terms, rel=1e-6) and router_terms > 0.1
  total, from_nll, from_router = (g["layer_0"]["ffn"]["router"] for g in grads)
  np.testing.assert_allclose(total, from_nll + from_router, atol=1e-6)
  assert float(jnp.abs(from_router).max()) > 1e-3


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["model.experts_per_token=5"], r"model.experts_per_token=5 must be in \[1, model.num_experts=4\]"),
    (["model.expert_capacity_factor=-1"], "model.expert_capacity_factor must be a finite number >= 0"),
    (["model.expert_capacity_factor=nan"], "model.expert_capacity_factor must be a finite number >= 0"),
    (["model.router_aux_loss=-0.1"], "model.router_aux_loss must be a finite number >= 0"),
    (
      ["model.num_experts=6", "mesh.expert=4", "mesh.data=2"],
      r"mesh.expert=4 does not divide model.num_experts=6; use mesh.expert in \[1, 2, 3, 6\]",
    ),
  ],
)
def test_config_errors_are_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message) as error:
    build_mesh(load_config(TINY, [*MOE, *overrides]))
  assert "\n" not in str(error.value)


def _train(mesh: MeshConfig, steps: int = 2, accum: int = 1):
  config = load_config(
    TINY,
    [*MOE, "model.num_decoder_layers=1", "optim.warmup_steps=10", "optim.eps=1e-4", f"train.grad_accum_steps={accum}"],
  )
  config = dataclasses.replace(config, mesh=mesh)
  devices = jax.devices()[: math.prod(v for v in mesh.sizes.values())]
  mesh_ = sh.make_mesh(config.mesh, devices)
  rules = sh.rules_for(config.mesh)
  model = get_task(config).make_model()
  tx = make_optimizer(config.optim, config.model.d_model)
  _, logical = abstract_state(model, tx)
  shardings = sh.logical_to_sharding(logical, mesh_, rules)
  state = create_state(model, tx, mesh_, 0, shardings, rules=rules)
  step = make_train_step(model, tx, config, mesh_, shardings)
  losses = []
  for i in range(steps):
    state, metrics = step(state, _lm_batch(rows=8, length=12, seed=i), jax.random.key(1))
    losses.append([float(metrics[k]) for k in ("loss", "router_balance", "router_z", "router_dropped")])
  return np.array(losses), jax.device_get(state.params)


@pytest.fixture(scope="module")
def one_device():
  return _train(MeshConfig(data=1))


@pytest.mark.parametrize(
  "mesh",
  [
    pytest.param(MeshConfig(data=4, expert=2), marks=pytest.mark.slow),
    pytest.param(MeshConfig(data=2, expert=4), marks=pytest.mark.slow),
    pytest.param(MeshConfig(data=2, context=2, expert=2), marks=pytest.mark.slow),
    MeshConfig(data=1, fsdp=2, tensor=2, expert=2),
  ],
  ids=["e2d4", "e4d2", "e2c2d2", "e2f2t2"],
)
def test_same_losses_and_params_on_expert_meshes(one_device, mesh):
  ref_losses, ref_params = one_device
  losses, params = _train(mesh)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert ref_losses[:, 3].min() > 0  # tokens were dropped for capacity
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_equals_the_big_batch(one_device):
  """Routing groups are rows and the router losses are sums, so microbatches add up exactly."""
  ref_losses, ref_params = one_device
  losses, params = _train(MeshConfig(data=1), accum=2)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_router_fields_in_the_log(tmp_path):
  """Per-step router sums -> the log's fields (per target token, fractions per layer), written to
  metrics.jsonl and to TensorBoard as one curve per layer and expert."""
  from tensorboardX.proto import event_pb2

  from jaxformer.tasks.router import summarise_router
  from jaxformer.train.metrics_log import MetricsLog

  history = [
    {"router_load": np.array([[3.0, 1.0], [2.0, 2.0]]), "router_balance": 5.0, "router_z": 6.0, "router_dropped": 1.0},
    {"router_load": np.array([[3.0, 1.0], [1.0, 0.0]]), "router_balance": 3.0, "router_z": 2.0, "router_dropped": 2.0},
  ]
  out = summarise_router(history, num_tokens=4.0)
  assert out == {
    "router_balance_loss": 2.0,
    "router_z_loss": 2.0,
    "router_dropped": 3.0 / 13.0,
    "router_load": [[0.75, 0.25], [0.6, 0.4]],
    "router_max_load": [1.5, 1.2],
  }
  logger = MetricsLog(tmp_path, 0)
  logger.write({"step": 3, **out})
  logger.close()
  assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, **out}
  data, tags = next((tmp_path / "tensorboard").iterdir()).read_bytes(), set()
  while data:  # TFRecord framing: length (8 bytes), its CRC (4), the event, its CRC (4)
    size = int.from_bytes(data[:8], "little")
    tags |= {v.tag for v in event_pb2.Event.FromString(data[12 : 12 + size]).summary.value}
    data = data[16 + size :]
  assert {"train/router_load/1/0", "train/router_max_load/1", "train/router_dropped"} <= tags


@pytest.mark.parametrize("scan", [False, True])
def test_int8_quantization_scales_each_expert(scan):
  """Expert kernels `[(layers,) experts, in, out]` get one scale per expert and output column; the
  router stays float; the attention kernels beside them keep their usual scales."""
  from jaxformer.inference.quantize import QuantizedArray, quantize_params

  _, model, params = _lm(f"model.scan_layers={scan}", "model.d_model=64", "model.d_ff=64")
  quantized = quantize_params(params, min_size=1024)
  ffn, attention = (
    (quantized["layer"] if scan else quantized["layer_0"])["ffn"],
    (quantized["layer"] if scan else quantized["layer_0"])["self_attention"],
  )
  lead = (2,) if scan else ()
  assert isinstance(ffn["wi"], QuantizedArray) and ffn["wi"].scale.shape == (*lead, 4, 1, 64)
  assert ffn["wo"].scale.shape == (*lead, 4, 1, 64) and not isinstance(ffn["router"], QuantizedArray)
  assert attention["query"].scale.shape == (*lead, 1, 8, 8)


def test_model_flops_count_the_routed_experts_and_the_router():
  from jaxformer.bench.flops import forward_flops_per_pair

  dense, moe = (load_config(TINY, ["model.kind=decoder_only", f"model.num_experts={e}"]).model for e in (0, 4))
  # Per token and layer: one more FFN (2 of 4 experts, 2 * 2 * d_model * d_ff) and the router (2 * d_model * 4).
  extra = 10 * 2 * (2 * 2 * 64 * 128 + 2 * 64 * 4)
  assert forward_flops_per_pair(moe, 0, 10) - forward_flops_per_pair(dense, 0, 10) == extra
