"""Checkpoint averaging (paper section 6.1): the exact mean of the last N checkpoints' params."""

import jax
import numpy as np
import pytest

from jaxformer import sharding as sh
from jaxformer.checkpoint import average
from jaxformer.checkpoint import manager as ckpt
from jaxformer.checkpoint import run_files as rf
from jaxformer.config import MeshConfig, config_from_dict
from jaxformer.errors import CheckpointError
from jaxformer.models.transformer import EncoderDecoder
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_train_step

MODEL = dict(vocab_size=40, d_model=16, num_heads=2, d_ff=24, num_encoder_layers=1, num_decoder_layers=1, max_length=64)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A workdir with checkpoints at steps 1..4 (Adam moves the params every step) and the host params of each."""
  workdir = tmp_path_factory.mktemp("avg")
  config = config_from_dict({"model": MODEL, "optim": {"warmup_steps": 2}})
  model = EncoderDecoder(config.model)
  tx = make_optimizer(config.optim, config.model.d_model)
  mesh = sh.make_mesh(MeshConfig(1, 2, 1), jax.devices()[:2])  # params sharded over fsdp
  abstract, shardings = state_shardings(model, tx, mesh)
  state = create_state(model, tx, mesh, 0, shardings)
  step = make_train_step(model, tx, config, mesh, shardings)
  rng = np.random.default_rng(0)
  saver = ckpt.Checkpointer(workdir, keep=10, async_save=False)
  history = {}
  for k in range(1, 5):
    batch = {name: rng.integers(4, 40, (8, 11)).astype(np.int32) for name in ("inputs", "targets")}
    state, _ = step(state, batch, jax.random.key(0))
    saver.save(state, force=True)
    history[k] = jax.device_get(state.params)
  saver.close()
  return workdir, ckpt.sharded_target(abstract.params, shardings.params), history


def test_average_is_the_exact_mean_of_the_last_n(run):
  workdir, target, history = run
  checkpointer = ckpt.Checkpointer(workdir, async_save=False)
  steps = average.last_steps(checkpointer, 3)
  assert steps == [2, 3, 4]
  mean = average.average_params(lambda s: checkpointer.restore_params(target, s)[1], steps)
  for got, *xs in zip(jax.tree.leaves(mean), *[jax.tree.leaves(history[s]) for s in steps]):
    stack = np.stack(xs).astype(np.float64)
    # Float32 summation error bound: N unit roundoffs (2^-24) of the mean of |x|, elementwise.
    bound = len(steps) * 2.0**-24 * np.abs(stack).mean(axis=0)
    assert np.all(np.abs(np.asarray(got, np.float64) - stack.mean(axis=0)) <= bound)
  # The checkpoints differ, so the mean is not any one of them.
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(history[2]), jax.tree.leaves(history[4])))
  # Leaves keep their shardings: the mean lands where the checkpoint would.
  for got, abstract in zip(jax.tree.leaves(mean), jax.tree.leaves(target)):
    assert got.sharding.is_equivalent_to(abstract.sharding, got.ndim) and got.dtype == abstract.dtype
  # Averaging one checkpoint is that checkpoint, bit for bit.
  one = average.average_params(lambda s: checkpointer.restore_params(target, s)[1], [4])
  for got, want in zip(jax.tree.leaves(one), jax.tree.leaves(history[4])):
    np.testing.assert_array_equal(np.asarray(got), want)
  checkpointer.close()


def test_too_few_checkpoints_is_one_line(run):
  workdir, _, _ = run
  checkpointer = ckpt.Checkpointer(workdir, async_save=False)
  with pytest.raises(CheckpointError, match=r"holds 4 \(\[1, 2, 3, 4\]\); train with train.keep_checkpoints >= 5"):
    average.last_steps(checkpointer, 5)
  with pytest.raises(CheckpointError, match="must be >= 1"):
    average.last_steps(checkpointer, 0)
  checkpointer.close()


def test_written_average_restores_as_a_params_checkpoint(run, tmp_path):
  workdir, target, history = run
  (workdir / rf.CONFIG_FILE).write_text("name: avg\n")
  checkpointer = ckpt.Checkpointer(workdir, async_save=False)
  steps = average.last_steps(checkpointer, 2)
  mean = average.average_params(lambda s: checkpointer.restore_params(target, s)[1], steps)
  checkpointer.close()
  out = average.write_averaged(workdir, tmp_path / "avg2", steps, mean)
  assert (out / rf.CONFIG_FILE).read_text() == "name: avg\n"
  assert not (tmp_path / "avg2.incomplete").exists()
  step, params = ckpt.Checkpointer(out, async_save=False).restore_params(target)
  assert step == 4
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(mean)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(CheckpointError, match="already exists"):
    average.write_averaged(workdir, out, steps, mean)
