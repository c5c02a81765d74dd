"""Mixed precision: the policy parser, float16 dynamic loss scaling in the train step,
bfloat16 training against float32, and padding safety under every compute dtype."""

import dataclasses
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import sharding as sh
from jaxformer.config import (
  Config,
  ConfigError,
  MeshConfig,
  ModelConfig,
  OptimConfig,
  PrecisionConfig,
  config_from_dict,
  dump_config,
  load_config,
)
from jaxformer.config.policy import Policy, parse_policy
from jaxformer.models.transformer import PAD_ID, EncoderDecoder
from jaxformer.tasks import get_task
from jaxformer.tasks.objective import loss_fn
from jaxformer.train.loss_scale import MIN_LOSS_SCALE, LossScale, next_loss_scale
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_train_step

ROOT = Path(__file__).parent.parent
VOCAB, SRC_LEN, TGT_LEN = 37, 11, 9


def _policy(compute: str) -> str:
  return f"params=float32,compute={compute},output=float32"


# --- the policy and its config ---------------------------------------------------------------


def test_parse_policy_values():
  assert parse_policy(_policy("bfloat16")) == Policy(compute_dtype="bfloat16")
  # Any order, spaces allowed, missing keys are float32.
  f16 = parse_policy(" compute = float16 , params=float32")
  assert (f16.param_dtype, f16.compute_dtype, f16.output_dtype) == ("float32", "float16", "float32")
  assert parse_policy("compute=float32") == Policy()
  assert str(f16) == _policy("float16") and parse_policy(str(f16)) == f16


@pytest.mark.parametrize(
  "policy, message",
  [
    ("compute=fp16", "unknown dtype 'fp16' for compute; use float32, bfloat16, float16"),
    ("compute=bfloat16,activations=float32", "unknown key 'activations'; use params, compute, output"),
    ("params=bfloat16,compute=bfloat16", "params=bfloat16: parameters and optimizer state stay float32"),
    ("compute=bfloat16,output=bfloat16", "output=bfloat16: logits and the loss are always float32"),
    ("compute=float16,compute=float32", "compute is given twice"),
    ("bfloat16", "'bfloat16' is not key=dtype; write e.g. params=float32,compute=bfloat16"),
  ],
)
def test_bad_policies_give_one_line_config_errors(policy, message):
  with pytest.raises(ConfigError) as info:
    config_from_dict({}, [f"precision.policy={policy}"])
  assert str(info.value).startswith(f"precision.policy={policy!r}: ")
  assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
  "override, message",
  [
    ("model.dtype=bfloat16", "model.dtype is not a config key: precision.policy sets it"),
    ("precision.loss_scale=static", "precision.loss_scale='static' is unknown; use auto, dynamic or none"),
    ("precision.initial_scale=0.5", "precision.initial_scale must be in [1, 2**127)"),
    ("precision.growth_interval=0", "precision.growth_interval must be >= 1"),
    ("precision.growth_factor=1", "precision.growth_factor must be a finite number > 1"),
    ("precision.backoff_factor=1", "precision.backoff_factor must be in (0, 1)"),
  ],
)
def test_bad_precision_keys_give_one_line_errors(override, message):
  with pytest.raises(ConfigError) as info:
    config_from_dict({}, [override])
  assert message in str(info.value) and "\n" not in str(info.value)


def test_policy_is_the_only_source_of_the_compute_dtype(tmp_path):
  config = config_from_dict({}, [f"precision.policy={_policy('bfloat16')}"])
  assert config.model.dtype == "bfloat16"
  assert "dtype" not in dump_config(config).split("precision:")[0]  # model.dtype is not written
  path = tmp_path / "config.yaml"
  path.write_text(dump_config(config))
  assert load_config(path) == config
  # Programmatic construction and dataclasses.replace follow the policy too.
  assert Config(precision=PrecisionConfig(policy="compute=float16")).model.dtype == "float16"
  assert dataclasses.replace(config, precision=PrecisionConfig()).model.dtype == "float32"


@pytest.mark.parametrize(
  "compute, loss_scale, dynamic",
  [
    ("float16", "auto", True),
    ("bfloat16", "auto", False),
    ("float32", "auto", False),
    ("bfloat16", "dynamic", True),
    ("float16", "none", False),
  ],
)
def test_loss_scaling_is_dynamic_for_float16_by_default(compute, loss_scale, dynamic):
  precision = PrecisionConfig(policy=_policy(compute), loss_scale=loss_scale, initial_scale=64.0)
  assert precision.dynamic_loss_scale is dynamic
  assert precision.start_scale == (64.0 if dynamic else 1.0)


def test_next_loss_scale_by_hand():
  def update(s, finite):
    return next_loss_scale(s, jnp.asarray(finite), 3, 2.0, 0.5)

  state = LossScale(jnp.float32(8.0), jnp.int32(0))
  seen = []
  for finite in (True, True, True, True, False, True):
    state = update(state, finite)
    seen.append((float(state.scale), int(state.good_steps)))
  assert seen == [(8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1), (8.0, 0), (8.0, 1)]
  # Backoff stops at MIN_LOSS_SCALE; growth that would overflow float32 keeps the scale.
  assert float(update(LossScale(jnp.float32(1.5), jnp.int32(2)), False).scale) == MIN_LOSS_SCALE
  top = jnp.float32(2.0**127)
  assert float(update(LossScale(top, jnp.int32(2)), True).scale) == 2.0**127


# --- float16 dynamic loss scaling in the train step ----------------------------------------


def _small_config(compute: str, **precision) -> Config:
  model = ModelConfig(
    vocab_size=VOCAB,
    d_model=16,
    num_heads=2,
    d_ff=24,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_length=16,
  )
  optim = OptimConfig(schedule="constant", learning_rate=1e-3)
  return Config(model=model, optim=optim, precision=PrecisionConfig(policy=_policy(compute), **precision))


def _batch(seed: int, batch: int, vocab: int = VOCAB) -> dict[str, np.ndarray]:
  """int32 `inputs` [batch, SRC_LEN] and `targets` [batch, TGT_LEN] with ragged padding."""
  rng = np.random.default_rng(seed)
  src = rng.integers(4, vocab, (batch, SRC_LEN)).astype(np.int32)
  tgt = rng.integers(4, vocab, (batch, TGT_LEN)).astype(np.int32)
  src[np.arange(SRC_LEN) >= rng.integers(3, SRC_LEN + 1, (batch, 1))] = PAD_ID
  tgt[np.arange(TGT_LEN) >= rng.integers(2, TGT_LEN + 1, (batch, 1))] = PAD_ID
  return {"inputs": src, "targets": tgt}


def _setup(config: Config, state=None):
  """(host initial state, jitted train step) on one device, as the training loop builds them.
  A given host `state` is reused (the state's layout does not depend on the policy)."""
  mesh = sh.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  model = EncoderDecoder(config.model)
  tx = make_optimizer(config.optim, config.model.d_model)
  _, shardings = state_shardings(model, tx, mesh)
  if state is None:
    state = jax.device_get(create_state(model, tx, mesh, 0, shardings, config.precision.start_scale))
  return state, make_train_step(model, tx, config, mesh, shardings)


GROWTH_INTERVAL = 3


@pytest.fixture(scope="module")
def f16_step():
  config = _small_config("float16", initial_scale=8.0, growth_interval=GROWTH_INTERVAL)
  state, step = _setup(config)
  return state, step, _batch(0, 8)


def _with_scale(state, scale: float, good_steps: int = 0):
  return state.replace(loss_scale=LossScale(np.float32(scale), np.int32(good_steps)))


def _run(step, state, batch):
  """One step from a host state (the step donates its input); returns host (state, metrics)."""
  return jax.device_get(step(state, batch, jax.random.key(0)))


def _assert_trees_identical(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_grads_are_unscaled(f16_step):
  """The same float16 step at loss scales 8 and 1024 gives the same (unscaled) gradient
  norm and update, up to float16 rounding of the backward pass."""
  state0, step, batch = f16_step
  (s8, m8), (s1k, m1k) = (_run(step, _with_scale(state0, scale), batch) for scale in (8.0, 1024.0))
  assert float(m8["loss_scale"]) == 8.0 and float(m1k["loss_scale"]) == 1024.0
  assert float(m8["skipped"]) == float(m1k["skipped"]) == 0.0
  assert 0.1 < float(m8["grad_norm"]) < 100.0
  assert float(m1k["grad_norm"]) == pytest.approx(float(m8["grad_norm"]), rel=2e-3)
  for a, b in zip(jax.tree.leaves(s8.params), jax.tree.leaves(s1k.params)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_scale_grows_after_n_finite_steps(f16_step):
  state, step, batch = f16_step
  # (scale used, scale and good steps after) for steps 1..4 with GROWTH_INTERVAL = 3.
  expected = [(8.0, 8.0, 1), (8.0, 8.0, 2), (8.0, 16.0, 0), (16.0, 16.0, 1)]
  for i, (used, scale, good) in enumerate(expected, start=1):
    before = state
    state, metrics = _run(step, state, batch)
    assert int(state.step) == i and float(metrics["skipped"]) == 0.0
    assert float(metrics["loss_scale"]) == used
    assert (float(state.loss_scale.scale), int(state.loss_scale.good_steps)) == (scale, good)
    moved = max(
      float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before.params))
    )
    assert moved > 1e-5  # finite steps are applied


def test_forced_overflow_skips_the_step_and_halves_the_scale(f16_step):
  state0, step, batch = f16_step
  state, _ = _run(step, state0, batch)
  state, _ = _run(step, state, batch)
  assert int(state.loss_scale.good_steps) == 2
  # 2**100 times the loss overflows float16 (max 65504) in the backward pass.
  before = state.replace(loss_scale=state.loss_scale.replace(scale=np.float32(2.0**100)))
  after, metrics = _run(step, before, batch)
  assert float(metrics["skipped"]) == 1.0 and float(metrics["loss_scale"]) == 2.0**100
  assert not np.isfinite(float(metrics["grad_norm"]))
  assert np.isfinite(float(metrics["loss"]))  # the forward pass is unaffected
  assert int(after.step) == int(before.step) + 1 == 3
  assert float(after.loss_scale.scale) == 2.0**99 and int(after.loss_scale.good_steps) == 0
  _assert_trees_identical(after.params, before.params)
  _assert_trees_identical(after.opt_state, before.opt_state)


# --- padding safety and output dtypes under each compute dtype --------------------------------


def _padded_batch() -> dict[str, np.ndarray]:
  """Rows: real; fully padded; source fully padded (targets real); targets fully padded."""
  batch = _batch(1, 4)
  batch["inputs"][1:3] = PAD_ID
  batch["targets"][1] = batch["targets"][3] = PAD_ID
  return batch


@pytest.fixture(scope="module")
def padded_results(f16_step):
  """{compute dtype: (loss, sums, grads)} of the small model on `_padded_batch`, no scaling."""
  batch = {k: jnp.asarray(v) for k, v in _padded_batch().items()}
  params = f16_step[0].params  # float32 whatever the policy
  results = {}
  for compute in ("float32", "bfloat16", "float16"):
    config = _small_config(compute)
    task, model = get_task(config), EncoderDecoder(config.model)
    grad_fn = jax.jit(jax.value_and_grad(partial(loss_fn, task, model, rng=None, label_smoothing=0.1), has_aux=True))
    (loss, sums), grads = jax.device_get(grad_fn(params, batch))
    results[compute] = (loss, sums, grads)
  return results


@pytest.mark.parametrize("compute", ["float32", "bfloat16", "float16"])
def test_fully_padded_rows_give_finite_loss_and_grads(padded_results, compute):
  loss, sums, grads = padded_results[compute]
  assert float(sums["num_tokens"]) == (_padded_batch()["targets"] != PAD_ID).sum()
  assert np.isfinite(float(loss)) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))
  # Low precision changes the values only by rounding: loss within 1%, gradients within 5%
  # of the float32 global norm.
  ref_loss, _, ref_grads = padded_results["float32"]
  assert float(loss) == pytest.approx(float(ref_loss), rel=1e-2)
  diff = np.sqrt(sum(np.sum((g - r) ** 2) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))))
  norm = np.sqrt(sum(np.sum(r**2) for r in jax.tree.leaves(ref_grads)))
  assert diff <= 5e-2 * norm


def test_bfloat16_computes_in_bfloat16_with_float32_logits():
  config = _small_config("bfloat16")
  model = EncoderDecoder(config.model)
  batch = _batch(0, 2)
  src, tgt = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
  params = jax.eval_shape(model.init, jax.random.key(0), src, tgt)["params"]
  encoded = jax.eval_shape(lambda p: model.apply({"params": p}, src, method=model.encode), params)
  logits = jax.eval_shape(lambda p: model.apply({"params": p}, src, tgt), params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  assert encoded.dtype == jnp.bfloat16
  assert logits.dtype == jnp.float32 and logits.shape == (2, TGT_LEN, VOCAB)


# --- bfloat16 training tracks float32 ---------------------------------------------------------


TRACK_STEPS = 30


def _tiny_losses(compute: str, batches, state=None) -> tuple[np.ndarray, object]:
  """(per-token training loss of each of TRACK_STEPS steps of configs/tiny.yaml with dropout
  off and learning-rate scale 1, cycling through `batches`; the host initial state) from
  `state` or a fresh one."""
  config = load_config(
    ROOT / "configs/tiny.yaml",
    ["model.dropout_rate=0.0", "optim.learning_rate=1.0", f"precision.policy={_policy(compute)}"],
  )
  initial, step = _setup(config, state)
  state, losses = initial, []
  for i in range(TRACK_STEPS):
    state, metrics = step(state, batches[i % len(batches)], jax.random.key(0))
    metrics = jax.device_get(metrics)
    losses.append(float(metrics["loss"]) / float(metrics["num_tokens"]))
  return np.array(losses), initial


@pytest.mark.slow
def test_bfloat16_training_tracks_float32():
  """30 steps of `tiny` from the same initial state over four fixed batches: the float32
  loss falls by > 3 nats per token (7.35 -> 3.84), and at every step the bfloat16 loss is
  within 0.1 nats of it. Measured: 1e-3 at step 1 (bfloat16's 2^-9 relative rounding of a
  7.3 nat loss) and at most 0.03 later. Parameters and Adam moments stay float32, so the gap
  is rounding in the forward/backward pass, which Adam's normalised updates turn into
  slightly different trajectories; 0.1 nats (3% of the decrease) bounds that with a 3x
  margin. (Overfitting one batch at the default rate instead gives loss spikes whose timing
  shifts between dtypes, which a per-step tolerance cannot bound.)
  """
  batches = [_batch(100 + i, 16, vocab=1000) for i in range(4)]
  f32, state = _tiny_losses("float32", batches)
  bf16, _ = _tiny_losses("bfloat16", batches, state)
  assert f32[-1] < f32[0] - 3.0  # the comparison is over a real decrease, not a flat line
  np.testing.assert_allclose(bf16, f32, rtol=0, atol=0.1)
