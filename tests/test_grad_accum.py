"""Gradient accumulation (`train.grad_accum_steps`): token-weighted microbatches equal the big
batch on every mesh, the split keeps each device's rows, dropout keys per microbatch, float16
loss scaling, remat and several steps per call, and the config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep

from jaxformer import sharding as sh
from jaxformer.config import Config, ConfigError, MeshConfig, ModelConfig, OptimConfig, PrecisionConfig, TrainConfig
from jaxformer.data import PAD_ID, global_batch, stack_batches
from jaxformer.models.transformer import EncoderDecoder
from jaxformer.tasks import get_task
from jaxformer.tasks.objective import loss_fn
from jaxformer.train.loss_scale import LossScale
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import _microbatches, make_multi_step, make_train_step

VOCAB, SRC_LEN, TGT_LEN = 38, 9, 11  # vocab splits over tensor=2
# Real target tokens per row: microbatches of rows j, j + k, ... hold 5 and 43 tokens (k = 2) or
# 3, 21, 2 and 22 (k = 4), so weighting microbatches equally would be far from the big batch.
TARGET_LENGTHS = [1, 11, 1, 11, 2, 10, 1, 11]


def _config(k: int, dropout: float = 0.0, compute: str = "float32", remat: str = "none", **optim) -> Config:
  model = ModelConfig(
    vocab_size=VOCAB,
    d_model=16,
    num_heads=2,
    d_ff=24,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=dropout,
    max_length=16,
    remat=remat,
  )
  # eps = 1 and rate 1: the first Adam update is g / (|g| + 1), about g itself, so the params
  # after one step show any gradient difference (with the paper's eps it would be sign(g)).
  optim = OptimConfig(**{"schedule": "constant", "learning_rate": 1.0, "eps": 1.0, **optim})
  precision = PrecisionConfig(policy=f"params=float32,compute={compute},output=float32", initial_scale=8.0)
  return Config(
    model=model, optim=optim, precision=precision, train=TrainConfig(batch_size=len(TARGET_LENGTHS), grad_accum_steps=k)
  )


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  src = rng.integers(4, VOCAB, (len(TARGET_LENGTHS), SRC_LEN)).astype(np.int32)
  tgt = rng.integers(4, VOCAB, (len(TARGET_LENGTHS), TGT_LEN)).astype(np.int32)
  src[np.arange(SRC_LEN) >= rng.integers(2, SRC_LEN + 1, (len(TARGET_LENGTHS), 1))] = PAD_ID
  tgt[np.arange(TGT_LEN) >= np.array(TARGET_LENGTHS)[:, None]] = PAD_ID
  return {"inputs": src, "targets": tgt}


def _setup(config: Config, mesh_shape=(1, 1, 1)):
  mesh = sh.make_mesh(MeshConfig(*mesh_shape), jax.devices()[: int(np.prod(mesh_shape))])
  model = EncoderDecoder(config.model)
  tx = make_optimizer(config.optim, config.model.d_model)
  _, shardings = state_shardings(model, tx, mesh)
  state = create_state(model, tx, mesh, 0, shardings, config.precision.start_scale)
  return mesh, model, tx, shardings, state


def _one_step(config: Config, mesh_shape=(1, 1, 1), batch=None, key: int = 7):
  """(host params before, host state and metrics after one step) of `config` on `mesh_shape`."""
  mesh, model, tx, shardings, state = _setup(config, mesh_shape)
  before = jax.device_get(state.params)
  step = make_train_step(model, tx, config, mesh, shardings)
  state, metrics = step(state, global_batch(_batch() if batch is None else batch, mesh), jax.random.key(key))
  return before, jax.device_get(state), jax.device_get(metrics)


@pytest.fixture(scope="module")
def big_batch():
  return _one_step(_config(1))


# (k, mesh, remat): remat only recomputes the same values.
CASES = [(4, (2, 1, 1), "none"), (2, (2, 2, 2), "full")]


@pytest.mark.parametrize("k, mesh_shape, remat", sweep(CASES, {"k4-data2"}, ids=["k4-data2", "k2-2x2x2-remat"]))
def test_accumulated_step_equals_the_big_batch_step(big_batch, k, mesh_shape, remat):
  before, ref_state, ref = big_batch
  _, state, metrics = _one_step(_config(k, remat=remat), mesh_shape)
  tokens = [sum(TARGET_LENGTHS[j::k]) for j in range(k)]
  assert max(tokens) >= 7 * min(tokens)  # very different microbatches
  # The metric sums are those of the whole batch: the logged loss is the token-weighted mean.
  assert float(metrics["num_tokens"]) == float(ref["num_tokens"]) == sum(TARGET_LENGTHS)
  for name in ("loss", "nll", "correct"):
    assert float(metrics[name]) == pytest.approx(float(ref[name]), rel=1e-6)
  assert float(metrics["grad_norm"]) == pytest.approx(float(ref["grad_norm"]), rel=1e-5)
  assert float(metrics["skipped"]) == float(metrics["nonfinite"]) == 0.0
  moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(before)))
  assert moved > 1e-2
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(ref_state.opt_state), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_microbatches_are_strided_rows_that_stay_on_their_devices():
  mesh = sh.make_mesh(MeshConfig(data=2, fsdp=2), jax.devices()[:4])
  rows = np.arange(16 * 3, dtype=np.int32).reshape(16, 3)  # row r holds 3r, 3r + 1, 3r + 2
  batch = global_batch({"inputs": rows, "targets": rows}, mesh)
  with sh.bind(mesh, sh.LOGICAL_RULES):
    split = jax.jit(lambda b: _microbatches(b, 4, mesh, sh.LOGICAL_RULES))(batch)["targets"]  # [4, 4, 3]
  np.testing.assert_array_equal(jax.device_get(split), np.stack([rows[j::4] for j in range(4)]))
  assert split.sharding.is_equivalent_to(sh.batch_sharding(mesh, stacked=True), 3)
  held = {shard.device: set(np.asarray(shard.data)[:, 0] // 3) for shard in batch["targets"].addressable_shards}
  for shard in split.addressable_shards:
    assert set(np.asarray(shard.data)[..., 0].ravel() // 3) <= held[shard.device]


def test_microbatches_that_do_not_divide_over_the_data_axes_are_refused():
  mesh = sh.make_mesh(MeshConfig(data=2), jax.devices()[:2])
  batch = {"targets": jnp.zeros((6, 3), jnp.int32)}
  with pytest.raises(ConfigError, match=r"microbatches .* 2 data-parallel devices .* multiple of 4"):
    _microbatches(batch, 2, mesh, sh.LOGICAL_RULES)
  with pytest.raises(ConfigError, match="train.batch_size=30 does not split into train.grad_accum_steps=4"):
    TrainConfig(batch_size=30, grad_accum_steps=4).validate()
  with pytest.raises(ConfigError, match="train.grad_accum_steps must be >= 1"):
    TrainConfig(grad_accum_steps=0).validate()


def test_each_microbatch_draws_its_own_dropout_key():
  """The accumulated loss sum is the sum of each microbatch's loss under fold_in(step key, j)."""
  config = _config(2, dropout=0.3)
  before, _, metrics = _one_step(config, key=3)
  step_key = jax.random.fold_in(jax.random.key(3), 0)
  model, task, batch = EncoderDecoder(config.model), get_task(config), _batch()
  loss = jax.jit(lambda p, b, r: loss_fn(task, model, p, b, r, config.optim.label_smoothing)[1]["loss"])
  parts = [
    float(loss(before, {k: v[j::2] for k, v in batch.items()}, jax.random.fold_in(step_key, j))) for j in range(2)
  ]
  assert float(metrics["loss"]) == pytest.approx(sum(parts), rel=1e-5)
  same_key = sum(float(loss(before, {k: v[j::2] for k, v in batch.items()}, step_key)) for j in range(2))
  assert abs(same_key - sum(parts)) > 1e-3


@pytest.mark.slow
def test_float16_scaling_and_steps_per_call_work_with_accumulation():
  """Two steps in one call, float16 compute with dynamic loss scaling: k = 2 follows
  k = 1 up to float16 rounding; a forced overflow is still a skip, not a non-finite fault."""
  batches = stack_batches([_batch(0), _batch(1)])
  runs = []
  for k in (1, 2):
    config = _config(k, compute="float16", learning_rate=1e-2)
    mesh, model, tx, shardings, state = _setup(config, (2, 1, 1))
    multi = make_multi_step(model, tx, config, mesh, shardings)
    state, metrics = multi(state, global_batch(batches, mesh), jax.random.key(0))
    runs.append((jax.device_get(state), jax.device_get(metrics)))
    # Overflow: 2**100 times the loss overflows float16 in the backward pass. (States go back on
    # the mesh as the step's own outputs are: host arrays would compile the step once more.)
    host = jax.device_get(state)
    overflowing = host.replace(loss_scale=LossScale(np.float32(2.0**100), np.int32(0)))
    after, m = jax.device_get(
      multi(jax.device_put(overflowing, shardings), global_batch(batches, mesh), jax.random.key(0))
    )
    np.testing.assert_array_equal(m["skipped"], [1.0, 1.0])
    np.testing.assert_array_equal(m["nonfinite"], [0.0, 0.0])
    assert float(after.loss_scale.scale) == 2.0**98
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(host.params)):
      np.testing.assert_array_equal(a, b)
    # A NaN loss (a target id past the vocabulary in step 1) is a non-finite fault, scaling or not.
    poisoned = dict(batches, targets=batches["targets"].copy())
    poisoned["targets"][0, 0, 0] = 10**6
    _, m = jax.device_get(multi(jax.device_put(host, shardings), global_batch(poisoned, mesh), jax.random.key(0)))
    np.testing.assert_array_equal(m["nonfinite"], [1.0, 0.0])
  (ref_state, ref), (state, metrics) = runs
  np.testing.assert_array_equal(metrics["num_tokens"], ref["num_tokens"])
  np.testing.assert_allclose(metrics["loss"], ref["loss"], rtol=2e-3)
  np.testing.assert_array_equal(metrics["skipped"], [0.0, 0.0])
  assert float(state.loss_scale.scale) == float(ref_state.loss_scale.scale) == 8.0
  assert int(state.loss_scale.good_steps) == int(ref_state.loss_scale.good_steps) == 2
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
