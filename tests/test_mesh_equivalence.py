"""Sharding changes nothing but placement: the same training on every mesh, golden specs,
and shards that really are 1/N of each array."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import sweep, tiny_config

from jaxformer import sharding as sh
from jaxformer.config import MeshConfig, load_config
from jaxformer.models.transformer import EncoderDecoder
from jaxformer.runtime.startup import check_model_fits_mesh
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import abstract_state, create_state
from jaxformer.train.step import make_train_step
from jaxformer.train.summary import per_device_bytes, total_bytes

ROOT = Path(__file__).parent.parent
MESHES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (4, 1, 2)]
STEPS = 5


def _config(dropout: float, *overrides: str):
  # Adam's paper epsilon (1e-9) turns float rounding noise in gradients that are
  # mathematically zero (e.g. the key projection's softmax shift-invariant direction)
  # into full-size updates whose sign depends on reduction order; eps=1e-4 keeps the
  # comparison well-conditioned while every sharded collective is still exercised.
  return tiny_config(None, f"model.dropout_rate={dropout}", "optim.warmup_steps=10", "optim.eps=1e-4", *overrides)


def _batches():
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    lengths = rng.integers(3, 13, size=(2, 16))
    ids = rng.integers(4, 1000, size=(2, 16, 13)).astype(np.int32)
    mask = np.arange(13)[None, None, :] < lengths[..., None]
    ids = np.where(mask, ids, 0)
    out.append({"inputs": ids[0], "targets": ids[1]})
  return out


def _run(mesh_shape, dropout, rules="", overrides=(), length=13, steps=STEPS):
  # One layer per stack: every sharded weight and collective of a layer, at half the compile time.
  config = _config(dropout, "model.num_encoder_layers=1", "model.num_decoder_layers=1", *overrides)
  devices = jax.devices()[: int(np.prod(mesh_shape))]
  config = dataclasses.replace(config, mesh=MeshConfig(*mesh_shape, rules=rules))
  mesh = sh.make_mesh(config.mesh, devices)
  model = EncoderDecoder(config.model)
  tx = make_optimizer(config.optim, config.model.d_model)
  abstract, logical = abstract_state(model, tx)
  shardings = sh.logical_to_sharding(logical, mesh, sh.rules_for(config.mesh))
  state = create_state(model, tx, mesh, 0, shardings, rules=sh.rules_for(config.mesh))
  step = make_train_step(model, tx, config, mesh, shardings)
  losses = []
  for batch in _batches()[:steps]:
    state, metrics = step(state, {k: v[:, :length] for k, v in batch.items()}, jax.random.key(7))
    losses.append(float(metrics["loss"] / metrics["num_tokens"]))
  return losses, state


@pytest.fixture(scope="module")
def references():
  return {dropout: _run((1, 1, 1), dropout) for dropout in (0.0, 0.1)}


# One-axis meshes without dropout; the multi-axis meshes with it (which runs the same sharded
# computations as without, plus the masks, which must not depend on the sharding either).
CASES = [(shape, 0.0) for shape in MESHES[1:4]] + [(shape, 0.1) for shape in MESHES[4:]]
CASE_IDS = [f"{'x'.join(map(str, s))}-dropout{d}" for s, d in CASES]


@pytest.mark.parametrize("mesh_shape, dropout", sweep(CASES, {"1x8x1-dropout0.0"}, ids=CASE_IDS))
def test_same_losses_and_params_on_every_mesh(references, mesh_shape, dropout):
  ref_losses, ref_state = references[dropout]
  losses, state = _run(mesh_shape, dropout)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(ref_state.params))):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  assert all(np.isfinite(ref_losses)) and int(state.step) == STEPS


def test_rules_overridden_from_config_change_placement_not_values(references):
  """mesh.rules "embed=none,act_batch=data": no ZeRO sharding, batch over data only."""
  ref_losses, ref_state = references[0.1]
  losses, state = _run((2, 2, 2), 0.1, "embed=none,act_batch=data")
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  wi = state.params["encoder_0"]["ffn"]["wi"]
  assert wi.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
  np.testing.assert_allclose(
    jax.device_get(wi), jax.device_get(ref_state.params["encoder_0"]["ffn"]["wi"]), atol=1e-5, rtol=1e-5
  )


@pytest.mark.slow
def test_context_axis_changes_placement_not_values():
  """mesh.context=2 splits the length of the batch and of every activation (12 tokens: 6 per
  device); attention gathers keys/values across it. Two steps, as on one device."""
  ref_losses, ref_state = _run((1, 1, 1), 0.0, length=12, steps=2)
  losses, state = _run((2, 1, 2, 1, 2), 0.0, length=12, steps=2)  # data=2, tensor=2, context=2
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(ref_state.params))):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_dropout_changes_the_loss(references):
  assert not np.allclose(references[0.0][0], references[0.1][0])


def _specs(mesh_shape, *overrides):
  config = _config(0.0, *overrides)
  mesh = sh.make_mesh(MeshConfig(*mesh_shape), jax.devices()[: int(np.prod(mesh_shape))])
  model = EncoderDecoder(config.model)
  abstract, logical = abstract_state(model, make_optimizer(config.optim, config.model.d_model))
  return abstract, sh.logical_to_sharding(logical, mesh)


# (data, fsdp, tensor, stage, context, expert): the new axes split no parameter of the unrolled
# model (stage splits scanned layers, below), so the specs of a mesh with any of them are the 2x2x2 golden ones.
@pytest.mark.parametrize(
  "mesh_shape",
  [(2, 2, 2), (1, 2, 2, 2), (1, 2, 2, 1, 2), (1, 2, 2, 1, 1, 2)],
  ids=["2x2x2", "stage2", "context2", "expert2"],
)
def test_golden_partition_specs_for_tiny(mesh_shape):
  _, shardings = _specs(mesh_shape)
  flat = jax.tree_util.tree_flatten_with_path(shardings.params)[0]
  got = {"/".join(k.key for k in path): [list(a) if isinstance(a, tuple) else a for a in s.spec] for path, s in flat}
  golden = json.loads((ROOT / "tests/golden/tiny_specs_2x2x2.json").read_text())
  assert got == golden


def test_golden_partition_specs_for_a_mixture_of_experts():
  """A one-layer decoder-only MoE on data=1, fsdp=2, tensor=2, expert=2: each expert's weights
  `[experts, ...]` split over expert (and like the dense FFN's over fsdp and tensor); the
  batch splits over data, fsdp and expert."""
  from jaxformer.tasks import get_task

  config = _config(0.0, "model.kind=decoder_only", "model.num_experts=4", "model.num_decoder_layers=1")
  mesh = sh.make_mesh(MeshConfig(1, 2, 2, expert=2), jax.devices()[:8])
  model = get_task(config).make_model()
  _, logical = abstract_state(model, make_optimizer(config.optim, config.model.d_model))
  flat = jax.tree_util.tree_flatten_with_path(sh.logical_to_sharding(logical, mesh).params)[0]
  got = {"/".join(k.key for k in path): [list(a) if isinstance(a, tuple) else a for a in s.spec] for path, s in flat}
  assert got == json.loads((ROOT / "tests/golden/tiny_moe_specs_e2f2t2.json").read_text())
  assert sh.batch_sharding(mesh).spec[0] == ("data", "fsdp", "expert")


def test_golden_partition_specs_for_scanned_tiny_on_stages():
  """Scanned layers (`[num_layers, ...]`, logical axis `layers`) split over stage in contiguous
  blocks, each layer's dimensions as unscanned; embeddings and logits replicated over stage."""
  _, shardings = _specs((1, 2, 2, 2), "model.scan_layers=true")
  flat = jax.tree_util.tree_flatten_with_path(shardings.params)[0]
  got = {"/".join(k.key for k in path): [list(a) if isinstance(a, tuple) else a for a in s.spec] for path, s in flat}
  golden = json.loads((ROOT / "tests/golden/tiny_scanned_specs_stage2x2x2.json").read_text())
  assert got == golden


@pytest.mark.parametrize("mesh_shape", sweep([((1, 8, 1),), ((1, 1, 8),)], {"tensor8"}, ids=["fsdp8", "tensor8"]))
def test_sharded_arrays_hold_one_eighth_per_device(mesh_shape):
  config = _config(0.0)
  mesh = sh.make_mesh(MeshConfig(*mesh_shape))
  model = EncoderDecoder(config.model)
  tx = make_optimizer(config.optim, config.model.d_model)
  abstract, logical = abstract_state(model, tx)
  shardings = sh.logical_to_sharding(logical, mesh)
  state = create_state(model, tx, mesh, 0, shardings)
  adam = state.opt_state[0]
  checked = 0
  for tree in (state.params, adam.mu, adam.nu):
    for leaf in jax.tree.leaves(tree):
      if leaf.sharding.is_fully_replicated:
        continue  # replicated by the rules (e.g. d_ff biases when only fsdp is > 1)
      for shard in leaf.addressable_shards:
        assert shard.data.size * 8 == leaf.size
      checked += 1
  assert checked >= 3 * 20, checked


def test_base_per_device_bytes_shrink_at_least_six_fold():
  config = load_config(ROOT / "configs/multi30k_base.yaml")
  mesh = sh.make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
  model = EncoderDecoder(config.model)
  abstract, logical = abstract_state(model, make_optimizer(config.optim, config.model.d_model))
  shardings = sh.logical_to_sharding(logical, mesh)
  for part in ("params", "opt_state"):
    sharded = per_device_bytes(getattr(abstract, part), getattr(shardings, part))
    assert sharded * 6 <= total_bytes(getattr(abstract, part))


@pytest.mark.parametrize(
  "fsdp, tensor, message",
  [
    (1, 3, "mesh.tensor=3 does not divide model.num_heads=8; use mesh.tensor in [1, 2, 4, 8]"),
    (3, 1, "mesh.fsdp=3 does not divide model.d_model=64"),
  ],
)
def test_indivisible_mesh_fails_before_compiling(fsdp, tensor, message):
  from jaxformer.config import ConfigError

  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
    check_model_fits_mesh(_config(0.0), fsdp, tensor)
