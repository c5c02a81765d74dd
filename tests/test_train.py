"""Tests of jaxformer.train: schedule, loss, the sharded train step, and memorisation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import sharding as sh
from jaxformer.config import Config, MeshConfig, ModelConfig, OptimConfig
from jaxformer.inference.decode import SearchOptions, make_decode_fn
from jaxformer.inference.search import EOS_ID
from jaxformer.models.transformer import PAD_ID, EncoderDecoder
from jaxformer.tasks.losses import cross_entropy_sums
from jaxformer.train.optim import make_optimizer, make_schedule, rsqrt_schedule
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_train_step

VOCAB = 40  # divisible by the tensor axis of the (2, 2, 2) mesh
D_MODEL = 16
SEED = 0


# --- learning-rate schedule ----------------------------------------------------------------


def _paper_lr(count, d_model, warmup, scale):
  s = count + 1  # paper steps count from 1, optax counts from 0
  return scale * d_model**-0.5 * min(s**-0.5, s * warmup**-1.5)


@pytest.mark.parametrize("d_model,warmup,scale", [(16, 10, 2.0), (512, 4000, 1.0)])
def test_rsqrt_schedule_matches_paper(d_model, warmup, scale):
  schedule = rsqrt_schedule(d_model, warmup, scale)
  for count in (0, 1, warmup // 2, warmup - 1, warmup, warmup + 1, 4 * warmup):
    value = float(schedule(jnp.asarray(count, jnp.int32)))
    assert math.isfinite(value) and value > 0
    # From the formula in float32: a few ulps from the float64 value, warmup included.
    assert value == pytest.approx(_paper_lr(count, d_model, warmup, scale), rel=1e-6), count
    assert float(jax.jit(schedule)(count)) == value
  # Value at count 0 as documented: scale * d_model^-0.5 * warmup^-1.5 (1.7469e-7 for the base model).
  assert float(schedule(0)) == pytest.approx(scale * d_model**-0.5 * warmup**-1.5, rel=1e-6)
  # Peak at count warmup - 1 (paper step warmup), with value scale * (d_model * warmup)^-0.5.
  counts = np.arange(0, 3 * warmup, max(1, warmup // 200))
  counts = np.union1d(counts, [warmup - 2, warmup - 1, warmup])
  values = np.asarray(jax.vmap(schedule)(jnp.asarray(counts, jnp.int32)))
  assert counts[np.argmax(values)] == warmup - 1
  assert values.max() == pytest.approx(scale * (d_model * warmup) ** -0.5, rel=1e-5)


def test_rsqrt_schedule_warmup_one_and_constant():
  schedule = rsqrt_schedule(64, 1, 0.5)
  for count in (0, 1, 7):
    assert float(schedule(jnp.asarray(count))) == pytest.approx(_paper_lr(count, 64, 1, 0.5), rel=1e-5)
  constant = make_schedule(OptimConfig(schedule="constant", learning_rate=3e-4), 64)
  assert [float(constant(c)) for c in (0, 10, 10000)] == pytest.approx([3e-4] * 3)
  rsqrt = make_schedule(OptimConfig(schedule="rsqrt", learning_rate=2.0, warmup_steps=10), 16)
  assert float(rsqrt(40)) == pytest.approx(_paper_lr(40, 16, 10, 2.0), rel=1e-5)


# --- label-smoothed cross-entropy ----------------------------------------------------------


def test_cross_entropy_sums_hand_computed():
  eps = 0.1
  logits = np.array(
    [
      [
        [1.0, 2.0, 0.5, -1.0],  # target 1 (the argmax)
        [0.3, -1.0, 2.0, 0.0],
      ]
    ],  # padding (weight 0)
    np.float32,
  )
  targets = np.array([[1, 0]])
  weights = np.array([[1.0, 0.0]], np.float32)
  out = {
    k: float(v)
    for k, v in cross_entropy_sums(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), eps).items()
  }

  # By hand, token 0 only: p = softmax(logits), q = (1 - eps) one_hot + eps / V.
  z = math.exp(1.0) + math.exp(2.0) + math.exp(0.5) + math.exp(-1.0)
  log_p = [1.0 - math.log(z), 2.0 - math.log(z), 0.5 - math.log(z), -1.0 - math.log(z)]
  q = [eps / 4, (1 - eps) + eps / 4, eps / 4, eps / 4]
  expected_loss = -(q[0] * log_p[0] + q[1] * log_p[1] + q[2] * log_p[2] + q[3] * log_p[3])
  expected_nll = -log_p[1]
  assert out["loss"] == pytest.approx(expected_loss, rel=1e-6)
  assert out["nll"] == pytest.approx(expected_nll, rel=1e-6)
  assert out["correct"] == 1.0 and out["num_tokens"] == 1.0
  assert expected_loss > expected_nll  # smoothing penalises the confident prediction

  # Both tokens real: the second one (target 0, not the argmax) adds its own terms.
  weights2 = np.array([[1.0, 1.0]], np.float32)
  out2 = {
    k: float(v)
    for k, v in cross_entropy_sums(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights2), eps).items()
  }
  z2 = math.exp(0.3) + math.exp(-1.0) + math.exp(2.0) + math.exp(0.0)
  log_p2 = [0.3 - math.log(z2), -1.0 - math.log(z2), 2.0 - math.log(z2), 0.0 - math.log(z2)]
  q2 = [(1 - eps) + eps / 4, eps / 4, eps / 4, eps / 4]
  loss2 = -sum(qi * li for qi, li in zip(q2, log_p2))
  assert out2["loss"] == pytest.approx(expected_loss + loss2, rel=1e-6)
  assert out2["nll"] == pytest.approx(expected_nll - log_p2[0], rel=1e-6)
  assert out2["correct"] == 1.0 and out2["num_tokens"] == 2.0

  # No smoothing: loss equals nll.
  out0 = cross_entropy_sums(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights2), 0.0)
  assert float(out0["loss"]) == pytest.approx(float(out0["nll"]), rel=1e-7)


@pytest.mark.parametrize("label_smoothing, z_loss", [(0.0, 0.0), (0.1, 1e-2)])
def test_cross_entropy_custom_gradient_equals_autodiff_of_the_formula(label_smoothing, z_loss):
  """`logit_statistics`' hand-written backward pass against autodiff of the textbook form."""
  key = jax.random.key(0)
  logits = 3.0 * jax.random.normal(key, (3, 5, 37))
  targets = jax.random.randint(jax.random.fold_in(key, 1), (3, 5), 0, 37)
  weights = jnp.ones((3, 5)).at[:, 4].set(0.0)

  def textbook(x):
    log_probs = jax.nn.log_softmax(x, axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    smooth = -jnp.mean(log_probs, axis=-1)
    log_z = jax.nn.logsumexp(x, axis=-1)
    return jnp.sum(((1 - label_smoothing) * nll + label_smoothing * smooth + z_loss * log_z**2) * weights)

  ours = lambda x: cross_entropy_sums(x, targets, weights, label_smoothing, z_loss)["loss"]  # noqa: E731
  np.testing.assert_allclose(ours(logits), textbook(logits), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(textbook)(logits), atol=1e-6)


def test_z_loss_adds_squared_log_normaliser():
  logits = np.array([[[1.0, 2.0, 0.5, -1.0], [3.0, -1.0, 2.0, 0.0], [0.3, 0.1, 0.2, 5.0]]], np.float32)
  targets = np.array([[1, 0, 2]])
  weights = np.array([[1.0, 1.0, 0.0]], np.float32)  # the last token is padding
  args = (jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), 0.1)
  plain = {k: float(v) for k, v in cross_entropy_sums(*args).items()}
  with_z = {k: float(v) for k, v in cross_entropy_sums(*args, z_loss=1e-2).items()}
  log_z = [math.log(sum(math.exp(v) for v in row)) for row in logits[0, :2]]
  assert with_z["loss"] == pytest.approx(plain["loss"] + 1e-2 * (log_z[0] ** 2 + log_z[1] ** 2), rel=1e-6)
  assert with_z["nll"] == plain["nll"] and with_z["num_tokens"] == 2.0


# --- the sharded train step ----------------------------------------------------------------


def _config(dropout: float, lr: float = 1e-3, label_smoothing: float = 0.1) -> Config:
  model = ModelConfig(
    vocab_size=VOCAB,
    d_model=D_MODEL,
    num_heads=2,
    d_ff=24,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=dropout,
    attention_dropout_rate=dropout,
    max_length=16,
  )
  optim = OptimConfig(schedule="constant", learning_rate=lr, label_smoothing=label_smoothing)
  return Config(model=model, optim=optim)


def _mesh(data, fsdp, tensor):
  return sh.make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[: data * fsdp * tensor])


def _step_batch(seed=0, batch=8, src_len=11, tgt_len=9):
  """Padded random batch with ragged lengths (some rows much shorter than others)."""
  rng = np.random.default_rng(seed)
  src = rng.integers(4, VOCAB, (batch, src_len)).astype(np.int32)
  tgt = rng.integers(4, VOCAB, (batch, tgt_len)).astype(np.int32)
  for i in range(batch):
    src[i, rng.integers(2, src_len + 1) :] = PAD_ID
    n = rng.integers(1, tgt_len + 1)
    tgt[i, n - 1] = EOS_ID
    tgt[i, n:] = PAD_ID
  return {"inputs": src, "targets": tgt}


@pytest.fixture(scope="module")
def host_state():
  """The initial train state, created once (as the loop does) on a 1-device mesh and fetched
  to the host. Param shapes and the Adam state layout do not depend on dropout or lr."""
  cfg = _config(0.0)
  model = EncoderDecoder(cfg.model)
  tx = make_optimizer(cfg.optim, D_MODEL)
  mesh = _mesh(1, 1, 1)
  _, shardings = state_shardings(model, tx, mesh)
  return jax.device_get(create_state(model, tx, mesh, SEED, shardings))


def _compile_step(cfg: Config, mesh_shape, state0, batch):
  """The train step of `cfg` on a mesh, as the loop builds it, plus its inputs placed on
  the mesh. Returns `run(rng_seed) -> (host new state, host metrics)`, each call starting
  from a fresh copy of `state0` (the step donates its state).

  The step's own jitted function (same shardings, same donation) is compiled with XLA
  backend optimisation off: the computation is the same, but compiling dropout's random-bit
  generation is ~3x faster on CPU. Every mesh is compiled the same way.
  """
  mesh = _mesh(*mesh_shape)
  model = EncoderDecoder(cfg.model)
  tx = make_optimizer(cfg.optim, cfg.model.d_model)
  _, shardings = state_shardings(model, tx, mesh)
  gbatch = {k: jax.device_put(jnp.asarray(v), sh.batch_sharding(mesh)) for k, v in batch.items()}
  train_step = make_train_step(model, tx, cfg, mesh, shardings)
  compiled = None

  def run(rng_seed=1234):
    nonlocal compiled
    state = jax.device_put(state0, shardings)
    rng = jax.device_put(jax.random.key(rng_seed), sh.replicated(mesh))
    with sh.bind(mesh, sh.LOGICAL_RULES):  # what the step's own wrapper does
      if compiled is None:
        compiled = train_step.jitted.lower(state, gbatch, rng).compile({"xla_backend_optimization_level": 0})
      new_state, metrics = compiled(state, gbatch, rng)
    # Params come back laid out as the shardings say.
    for leaf, spec in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(shardings.params)):
      assert leaf.sharding.is_equivalent_to(spec, leaf.ndim)
    return jax.device_get(new_state), jax.device_get(metrics)

  return run


@pytest.fixture(scope="module")
def dropout_reference(host_state):
  cfg = _config(0.1)
  batch = _step_batch()
  run = _compile_step(cfg, (1, 1, 1), host_state, batch)
  return cfg, batch, run(), run(rng_seed=99)


def _assert_same_step(result, reference, host_state):
  (state, metrics), (ref_state, ref_metrics) = result, reference
  assert int(state.step) == int(ref_state.step) == int(host_state.step) + 1
  assert float(metrics["num_tokens"]) == float(ref_metrics["num_tokens"])
  assert float(metrics["correct"]) == float(ref_metrics["correct"])
  n = float(ref_metrics["num_tokens"])
  for key in ("loss", "nll"):
    assert abs(float(metrics[key]) - float(ref_metrics[key])) / n < 1e-5, key
  assert float(metrics["grad_norm"]) == pytest.approx(float(ref_metrics["grad_norm"]), rel=1e-5)
  assert float(metrics["learning_rate"]) == pytest.approx(float(ref_metrics["learning_rate"]))
  paths = jax.tree_util.tree_flatten_with_path(ref_state.params)[0]
  for (path, ref), new in zip(paths, jax.tree.leaves(state.params)):
    np.testing.assert_allclose(new, ref, atol=1e-5, rtol=0, err_msg=jax.tree_util.keystr(path))
  for new, ref in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(ref_state.opt_state)):
    np.testing.assert_allclose(new, ref, atol=1e-5, rtol=1e-5)
  # The step really moved the parameters.
  moved = max(
    float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(host_state.params))
  )
  assert moved > 1e-4


def test_dropout_is_used_by_the_step(dropout_reference):
  """Guard for the equality tests: the reference step really draws dropout bits (another
  base key gives another loss), and the metrics count the real target tokens."""
  _, batch, (_, metrics), (_, metrics_other_key) = dropout_reference
  n = float(metrics["num_tokens"])
  assert n == float(metrics_other_key["num_tokens"]) == (batch["targets"] != PAD_ID).sum()
  assert abs(float(metrics["loss"]) - float(metrics_other_key["loss"])) / n > 1e-3


def test_data_parallel_step_equals_single_device(dropout_reference, host_state):
  cfg, batch, reference, _ = dropout_reference
  _assert_same_step(_compile_step(cfg, (4, 1, 1), host_state, batch)(), reference, host_state)


def test_data_fsdp_tensor_step_equals_single_device(dropout_reference, host_state):
  cfg, batch, reference, _ = dropout_reference
  _assert_same_step(_compile_step(cfg, (2, 2, 2), host_state, batch)(), reference, host_state)


# --- memorisation ----------------------------------------------------------------------------


def _memorisation_data(n=32, max_len=10, seed=3):
  rng = np.random.default_rng(seed)
  src = np.zeros((n, max_len), np.int32)
  tgt = np.zeros((n, max_len), np.int32)
  for i in range(n):
    ls, lt = rng.integers(3, max_len + 1), rng.integers(2, max_len + 1)
    src[i, :ls] = rng.integers(4, VOCAB, ls)
    tgt[i, : lt - 1] = rng.integers(4, VOCAB, lt - 1)
    tgt[i, lt - 1] = EOS_ID
  assert len({tuple(r) for r in src}) == n
  return src, tgt


MEMO_CONFIG = _config(0.0, lr=5e-3, label_smoothing=0.0)
MEMO_STEPS = 400


@pytest.fixture(scope="module")
def memorised(host_state):
  """Trains MEMO_CONFIG on 32 fixed pairs on one device, exactly as the loop does.
  Returns (src, tgt, first step's host metrics, final state, final metrics)."""
  cfg = MEMO_CONFIG
  model = EncoderDecoder(cfg.model)
  tx = make_optimizer(cfg.optim, D_MODEL)
  mesh = _mesh(1, 1, 1)
  _, shardings = state_shardings(model, tx, mesh)
  state = jax.device_put(host_state, shardings)
  train_step = make_train_step(model, tx, cfg, mesh, shardings)
  src, tgt = _memorisation_data()
  batch = {
    "inputs": jax.device_put(jnp.asarray(src), sh.batch_sharding(mesh)),
    "targets": jax.device_put(jnp.asarray(tgt), sh.batch_sharding(mesh)),
  }
  rng = jax.random.key(SEED)
  state, metrics = train_step(state, batch, rng)
  first = jax.device_get(metrics)
  for _ in range(MEMO_STEPS - 1):
    state, metrics = train_step(state, batch, rng)
  return src, tgt, first, state, jax.device_get(metrics)


def test_memorises_small_dataset(memorised):
  src, tgt, first_metrics, state, metrics = memorised
  first = float(first_metrics["loss"]) / float(first_metrics["num_tokens"])
  last = float(metrics["loss"]) / float(metrics["num_tokens"])
  assert int(state.step) == MEMO_STEPS
  assert first > 3.0 and last < 0.02, (first, last)
  assert float(metrics["correct"]) == float(metrics["num_tokens"]) == (tgt != PAD_ID).sum()

  model = EncoderDecoder(MEMO_CONFIG.model)
  # Each sentence may run to its own source length + extra_tokens: room for every target here.
  decode = make_decode_fn(model, _mesh(1, 1, 1), MEMO_CONFIG.model.max_length, SearchOptions(extra_tokens=tgt.shape[1]))
  out = np.asarray(decode(state.params, jnp.asarray(src)))
  assert out.shape[1] >= tgt.shape[1]
  np.testing.assert_array_equal(out[:, : tgt.shape[1]], tgt)  # through EOS, then padding
  assert (out[:, tgt.shape[1] :] == PAD_ID).all()
