"""Orbax checkpoints: exact round trip, restore onto another mesh, interrupted saves ignored."""

import shutil

import jax
import numpy as np
import pytest

from jaxformer import sharding as sh
from jaxformer.checkpoint import manager as ckpt
from jaxformer.checkpoint import run_files as rf
from jaxformer.config import MeshConfig, config_from_dict
from jaxformer.models.transformer import EncoderDecoder
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_train_step

MODEL = dict(vocab_size=40, d_model=16, num_heads=2, d_ff=24, num_encoder_layers=1, num_decoder_layers=1, max_length=64)


@pytest.fixture(scope="module")
def setup():
  config = config_from_dict({"model": MODEL, "optim": {"warmup_steps": 5}})
  model = EncoderDecoder(config.model)
  tx = make_optimizer(config.optim, config.model.d_model)
  return config, model, tx


def _trained_state(setup, mesh, steps=2):
  config, model, tx = setup
  _, shardings = state_shardings(model, tx, mesh)
  state = create_state(model, tx, mesh, 0, shardings)
  step = make_train_step(model, tx, config, mesh, shardings)
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(4, 40, (8, 11)).astype(np.int32) for k in ("inputs", "targets")}
  for _ in range(steps):
    state, _ = step(state, batch, jax.random.key(0))
  return state


def _assert_trees_equal(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_restore_round_trip_is_exact_and_lands_sharded(setup, tmp_path):
  _, model, tx = setup
  mesh8 = sh.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  state = _trained_state(setup, mesh8)
  saver = ckpt.Checkpointer(tmp_path, async_save=True)
  saver.save(state, force=True)
  saver.close()
  expected = jax.device_get(state)

  for devices, shape in ((8, (2, 2, 2)), (4, (4, 1, 1)), (2, (1, 1, 2)), (1, (1, 1, 1))):
    mesh = sh.make_mesh(MeshConfig(*shape), jax.devices()[:devices])
    abstract, shardings = state_shardings(model, tx, mesh)
    restored = ckpt.Checkpointer(tmp_path).restore(ckpt.sharded_target(abstract, shardings))
    assert int(restored.step) == 2
    _assert_trees_equal(restored, expected)
    wi = restored.params["encoder_0"]["ffn"]["wi"]
    assert wi.sharding.mesh.shape == mesh.shape
    assert wi.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    # What eval does: params only, no optimizer state, onto this mesh.
    step, params = ckpt.Checkpointer(tmp_path).restore_params(ckpt.sharded_target(abstract.params, shardings.params))
    assert step == 2
    _assert_trees_equal(params, expected.params)
    assert params["encoder_0"]["ffn"]["wi"].sharding == wi.sharding

  # Plain host memory: leaves without a sharding come back as numpy arrays.
  step, params = ckpt.Checkpointer(tmp_path).restore_params(abstract.params)
  assert step == 2 and isinstance(params["encoder_0"]["ffn"]["wi"], np.ndarray)
  _assert_trees_equal(params, expected.params)


def test_interrupted_save_is_never_restored(setup, tmp_path):
  _, model, tx = setup
  mesh = sh.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  state = _trained_state(setup, mesh, steps=1)
  saver = ckpt.Checkpointer(tmp_path, async_save=False)
  saver.save(state, force=True)
  saver.close()
  # A save killed mid-way leaves only Orbax's temporary directory behind.
  root = tmp_path / "checkpoints"
  shutil.copytree(root / "1", root / "9.orbax-checkpoint-tmp-1234")
  reader = ckpt.Checkpointer(tmp_path)
  assert reader.latest_step() == 1 and reader.all_steps() == [1]
  abstract, shardings = state_shardings(model, tx, mesh)
  assert int(reader.restore(ckpt.sharded_target(abstract, shardings)).step) == 1


def test_missing_checkpoints_give_clear_errors(setup, tmp_path):
  _, model, tx = setup
  mesh = sh.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  abstract, shardings = state_shardings(model, tx, mesh)
  with pytest.raises(ckpt.CheckpointError, match="no checkpoint in"):
    ckpt.Checkpointer(tmp_path).restore(ckpt.sharded_target(abstract, shardings))
  with pytest.raises(ckpt.CheckpointError, match="not a jaxformer workdir"):
    rf.run_file(tmp_path / "elsewhere", rf.CONFIG_FILE)
