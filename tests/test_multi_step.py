"""Several optimizer steps per jitted call (`train.steps_per_call`): call boundaries, stacked
batches, equality with single-step calls, and the resume check."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import shakespeare_files

from jaxformer import sharding as sh
from jaxformer.config import (
  Config,
  ConfigError,
  MeshConfig,
  ModelConfig,
  OptimConfig,
  TrainConfig,
  dump_config,
  load_config,
)
from jaxformer.data import PAD_ID, global_batch, stack_batches
from jaxformer.models.transformer import EncoderDecoder
from jaxformer.train.loop import call_length, train
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_multi_step, make_train_step


def test_call_length_ends_calls_at_every_boundary():
  t = TrainConfig(num_steps=23, steps_per_call=4, log_every=6, eval_every=10, checkpoint_every=20)
  starts, step = [], 0
  while step < t.num_steps:
    starts.append(step)
    step += call_length(step, t)
  assert step == 23
  # Ends at multiples of 4, 6, 10, 20 and at 23.
  assert starts == [0, 4, 6, 8, 10, 12, 16, 18, 20]
  ends = starts[1:] + [23]
  assert all(e - s <= 4 for s, e in zip(starts, ends))
  # After a resume at a step that is not a multiple of k, the next call realigns.
  assert call_length(13, t) == 3 and call_length(0, dataclasses.replace(t, steps_per_call=1)) == 1


def test_stack_batches_stacks_equal_shapes_and_refuses_others():
  a = {"inputs": np.array([[5, 6, 0]], np.int32), "targets": np.array([[7, 0, 0]], np.int32)}
  b = {"inputs": np.array([[1, 2, 3]], np.int32), "targets": np.array([[8, 8, 2]], np.int32)}
  out = stack_batches([a, b])
  assert out["inputs"].shape == out["targets"].shape == (2, 1, 3) and out["inputs"].dtype == np.int32
  np.testing.assert_array_equal(out["inputs"], [[[5, 6, 0]], [[1, 2, 3]]])
  np.testing.assert_array_equal(out["targets"], [[[7, 0, 0]], [[8, 8, 2]]])
  longer = {"inputs": np.zeros((1, 5), np.int32), "targets": np.zeros((1, 5), np.int32)}
  with pytest.raises(ValueError, match="cannot stack batches"):
    stack_batches([a, longer])


VOCAB = 40


@pytest.fixture(scope="module")
def steps_on_two_devices():
  """A tiny encoder-decoder with dropout on a 2-device data mesh: the same 3 steps run as
  three single-step calls and as one 3-step call."""
  model_cfg = ModelConfig(
    vocab_size=VOCAB,
    d_model=16,
    num_heads=2,
    d_ff=24,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.1,
    attention_dropout_rate=0.1,
    max_length=16,
  )
  cfg = Config(model=model_cfg, optim=OptimConfig(schedule="constant", learning_rate=1e-2))
  mesh = sh.make_mesh(MeshConfig(data=2), jax.devices()[:2])
  model = EncoderDecoder(cfg.model)
  tx = make_optimizer(cfg.optim, 16)
  _, shardings = state_shardings(model, tx, mesh)
  rng = np.random.default_rng(0)
  batches = []
  for i in range(3):
    src = rng.integers(3, VOCAB, (4, 9)).astype(np.int32)
    tgt = rng.integers(3, VOCAB, (4, 9)).astype(np.int32)
    src[0, 3 + i :] = PAD_ID
    tgt[1, 2 + i :] = PAD_ID
    batches.append({"inputs": src, "targets": tgt})
  key = jax.random.key(7)

  single = make_train_step(model, tx, cfg, mesh, shardings)
  state = create_state(model, tx, mesh, 0, shardings)
  single_metrics = []
  for batch in batches:
    state, m = single(state, global_batch(batch, mesh), key)
    single_metrics.append(jax.device_get(m))
  single_state = jax.device_get(state)

  multi = make_multi_step(model, tx, cfg, mesh, shardings)
  state = create_state(model, tx, mesh, 0, shardings)
  state, multi_metrics = multi(state, global_batch(stack_batches(batches), mesh), key)
  return single_state, single_metrics, jax.device_get(state), jax.device_get(multi_metrics)


@pytest.mark.slow
def test_multi_step_call_equals_single_steps(steps_on_two_devices):
  single_state, single_metrics, multi_state, multi_metrics = steps_on_two_devices
  assert int(multi_state.step) == int(single_state.step) == 3
  assert multi_metrics["loss"].shape == (3,)
  for i, m in enumerate(single_metrics):
    n = float(m["num_tokens"])
    assert float(multi_metrics["num_tokens"][i]) == n
    assert abs(float(multi_metrics["loss"][i]) - float(m["loss"])) / n < 1e-6
    assert float(multi_metrics["grad_norm"][i]) == pytest.approx(float(m["grad_norm"]), rel=1e-5)
  # Each step drew its own dropout masks and saw its own batch: the losses differ.
  assert len({round(float(x), 5) for x in multi_metrics["loss"] / multi_metrics["num_tokens"]}) == 3
  for a, b in zip(jax.tree.leaves(multi_state.params), jax.tree.leaves(single_state.params)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(multi_state.opt_state), jax.tree.leaves(single_state.opt_state)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _lm_run(workdir, steps_per_call: int, num_steps: int = 7):
  """A tiny character LM trained in-process (data parallel over the 8 test devices); returns
  its logged metrics."""
  config = load_config(
    "configs/shakespeare_char.yaml",
    [
      *shakespeare_files(workdir.parent),
      "model.d_model=16",
      "model.num_heads=2",
      "model.d_ff=32",
      "model.num_decoder_layers=1",
      "model.max_length=16",
      "data.max_length=16",
      "train.batch_size=8",
      f"train.num_steps={num_steps}",
      "train.log_every=2",
      "train.eval_every=5",
      "train.checkpoint_every=5",
      "model.dropout_rate=0.1",
      "optim.warmup_steps=2",
      "optim.decay_steps=7",
      f"train.steps_per_call={steps_per_call}",
      "train.async_checkpoint=false",
    ],
  )
  train(config, workdir)
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_with_three_steps_per_call_logs_the_same_losses(tmp_path):
  one = _lm_run(tmp_path / "one", 1)
  three = _lm_run(tmp_path / "three", 3)
  assert [m["step"] for m in three] == [m["step"] for m in one] == [2, 4, 5, 6, 7, 7]
  for a, b in zip(one, three):
    for key in ("loss", "grad_norm", "val_loss"):
      if key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
  # Resuming with another steps_per_call is fine for the LM (windows do not depend on it).
  resumed = _lm_run(tmp_path / "three", 2, num_steps=9)
  assert resumed[-1]["step"] == 9


def _pairs_run(workdir, data_dir, num_steps: int):
  """A tiny encoder-decoder with dropout on Multi30k, 3 steps per call, trained in-process;
  returns its validation loss at the last step. Three buckets: batches 6, 7 and 8 (at most 12,
  13 and 14 tokens) get buckets 12, 14 and 14 of their own, the rest 64 (fewer shapes to compile)."""
  config = load_config(
    "configs/tiny.yaml",
    [
      f"data.data_dir={data_dir}",
      "data.buckets=[12,14,64]",
      "model.d_model=16",
      "model.num_heads=2",
      "model.d_ff=32",
      "model.num_encoder_layers=1",
      "model.num_decoder_layers=1",
      "train.batch_size=8",
      "train.log_every=6",
      "train.eval_every=1000",
      "train.eval_batches=2",
      "train.checkpoint_every=1000",
      f"train.num_steps={num_steps}",
      "optim.warmup_steps=2",
      "train.steps_per_call=3",
      "train.async_checkpoint=false",
    ],
  )
  train(config, workdir)
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line) for line in lines if "val_loss" in line][-1]["val_loss"]


@pytest.mark.slow
def test_sentence_pair_run_resumed_off_the_call_grid_equals_an_uninterrupted_one(tmp_path, multi30k_dir):
  """Stopping at step 7 cuts the last call (batches 6 and 7 of the run of batches 6..8) into
  two calls; each batch still has its run's length, so the dropout masks (which depend on the
  shape) and the result are the same. (Batches 6, 7, 8 fall in buckets 12, 14, 14: padding
  each call to its own longest batch gives batch 6 length 12 in the resumed run, 14 in the
  whole one; with 10 steps and nine buckets that gave 6.0445 against 6.0501.)"""
  whole = _pairs_run(tmp_path / "whole", multi30k_dir, 8)
  _pairs_run(tmp_path / "resumed", multi30k_dir, 7)
  assert _pairs_run(tmp_path / "resumed", multi30k_dir, 8) == pytest.approx(whole, rel=1e-6)


def test_resume_with_other_steps_per_call_is_refused_for_sentence_pairs(tmp_path):
  (tmp_path / "config.yaml").write_text(dump_config(load_config("configs/tiny.yaml", ["train.steps_per_call=4"])))
  config = load_config("configs/tiny.yaml", ["train.steps_per_call=2"])
  with pytest.raises(ConfigError, match=r"train.steps_per_call=4"):
    train(config, tmp_path)
