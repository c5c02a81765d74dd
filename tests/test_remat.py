"""Remat policies and scanned layer stacks change memory and compile time, never values:
equal losses and gradients (dropout on and off), equal decoding, exact checkpoints."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep
from jax.sharding import PartitionSpec

from jaxformer import sharding as sh
from jaxformer.checkpoint import manager as ckpt
from jaxformer.config import ConfigError, MeshConfig, ModelConfig, config_from_dict
from jaxformer.inference.cache import contiguous_cache
from jaxformer.inference.decode import beam_search, greedy_decode
from jaxformer.layers.remat import POLICY_NAMES
from jaxformer.models.layout import layer_stacks, stack_layers
from jaxformer.models.transformer import PAD_ID, EncoderDecoder
from jaxformer.tasks.losses import cross_entropy_sums
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_train_step

VOCAB = 37
SRC_LEN, TGT_LEN = 11, 9
TOL = 1e-6
BASE = dict(
  vocab_size=VOCAB,
  d_model=16,
  num_heads=2,
  d_ff=24,
  num_encoder_layers=1,
  num_decoder_layers=2,
  dropout_rate=0.0,
  max_length=32,
)
DROPOUT = dict(dropout_rate=0.2, attention_dropout_rate=0.3)


def _config(**kw):
  return ModelConfig(**{**BASE, **kw})


def _batch(src_len=SRC_LEN, tgt_len=TGT_LEN, seed=0):
  """Three rows with padding at the end of rows 1 and 2."""
  rng = np.random.default_rng(seed)
  src = rng.integers(4, VOCAB, (3, src_len)).astype(np.int32)
  tgt = rng.integers(4, VOCAB, (3, tgt_len)).astype(np.int32)
  src[1, src_len // 2 :] = PAD_ID
  tgt[2, tgt_len // 3 :] = PAD_ID
  return jnp.asarray(src), jnp.asarray(tgt)


def _loss_fn(model):
  """(params, src, tgt, dropout key or None) -> mean cross-entropy per target token."""

  def loss(params, src, tgt, rng):
    rngs = None if rng is None else {"dropout": rng}
    logits = model.apply({"params": params}, src, tgt, deterministic=rng is None, rngs=rngs)
    sums = cross_entropy_sums(logits, tgt, (tgt != PAD_ID).astype(jnp.float32))
    return sums["loss"] / sums["num_tokens"]

  return loss


def _loss_and_grads(config, params, rng):
  src, tgt = _batch()
  return jax.jit(jax.value_and_grad(_loss_fn(EncoderDecoder(config))))(params, src, tgt, rng)


def _stacked(tree):
  """An unrolled params-shaped tree in the scanned layout of the BASE model."""
  return stack_layers(tree, layer_stacks(EncoderDecoder(_config())))


def _assert_close(a, b, tol=TOL):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def params():
  """Unrolled-layout params of the BASE shape (all configs here share it)."""
  src, tgt = _batch()
  return nn.meta.unbox(jax.jit(EncoderDecoder(_config()).init)(jax.random.key(0), src, tgt))["params"]


@pytest.fixture(scope="module")
def reference(params):
  """Loss and grads without remat, unrolled: {False: deterministic, True: with dropout}."""
  return {
    False: _loss_and_grads(_config(), params, None),
    True: _loss_and_grads(_config(**DROPOUT), params, jax.random.key(3)),
  }


def test_dropout_reference_really_drops(reference):
  # Otherwise the tests below would not show that recomputation reuses the dropout masks.
  assert float(reference[False][0]) > 1.0
  assert abs(float(reference[True][0]) - float(reference[False][0])) > 1e-3


# One policy in the fast suite, the others with the slow tests.
@pytest.mark.parametrize(
  "policy", [p if p == "full" else pytest.param(p, marks=pytest.mark.slow) for p in POLICY_NAMES if p != "none"]
)
def test_policy_matches_no_remat_with_dropout(params, reference, policy):
  loss, grads = _loss_and_grads(_config(remat=policy, **DROPOUT), params, jax.random.key(3))
  ref_loss, ref_grads = reference[True]
  np.testing.assert_allclose(float(loss), float(ref_loss), atol=TOL, rtol=TOL)
  _assert_close(grads, ref_grads)


def test_scan_with_remat_matches_unrolled(params, reference):
  config = _config(scan_layers=True, remat="minimal")
  loss, grads = _loss_and_grads(config, _stacked(params), None)
  ref_loss, ref_grads = reference[False]
  np.testing.assert_allclose(float(loss), float(ref_loss), atol=TOL, rtol=TOL)
  _assert_close(grads, _stacked(ref_grads))


@pytest.mark.parametrize("policy", sweep(["none", "full"], {"full"}))
def test_scan_with_dropout_matches_unrolled(params, reference, policy):
  """The scanned layers draw the unrolled layers' dropout masks, and remat inside the scan
  recomputes with the forward pass's masks."""
  loss, grads = _loss_and_grads(_config(scan_layers=True, remat=policy, **DROPOUT), _stacked(params), jax.random.key(3))
  ref_loss, ref_grads = reference[True]
  np.testing.assert_allclose(float(loss), float(ref_loss), atol=TOL, rtol=TOL)
  _assert_close(grads, _stacked(ref_grads))


def _temp_bytes(config):
  src, tgt = _batch(src_len=256, tgt_len=256)
  model = EncoderDecoder(config)
  shapes = jax.eval_shape(lambda k: nn.meta.unbox(model.init(k, src[:, :8], tgt[:, :8]))["params"], jax.random.key(0))
  compiled = jax.jit(jax.grad(_loss_fn(model))).lower(shapes, src, tgt, None).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_full_remat_needs_less_temporary_memory():
  """Length 256: without remat the `[batch, heads, 256, 256]` attention weights of every
  layer stay live until the backward pass; `full` keeps only each block's input.

  Measured on the scanned stack: in an unrolled stack XLA's CPU compiler merges the
  recomputation back into the forward pass (common-subexpression elimination after it
  drops the optimization barriers), so CPU shows no saving there."""
  long = dict(max_length=256, scan_layers=True)
  none, full = _temp_bytes(_config(**long)), _temp_bytes(_config(remat="full", **long))
  assert full < 0.5 * none, (full, none)


def test_unknown_policy_is_a_one_line_config_error():
  with pytest.raises(ConfigError, match=r"model.remat='fast' is unknown; use one of none, full, save_dots, minimal"):
    config_from_dict({}, ["model.remat=fast"])
  config = config_from_dict({}, ["model.remat=minimal", "model.scan_layers=true"])
  assert (config.model.remat, config.model.scan_layers) == ("minimal", True)


@pytest.mark.slow
def test_scan_checkpoint_round_trip(tmp_path):
  config = config_from_dict(
    {"model": {**BASE, "dropout_rate": 0.1}, "optim": {"warmup_steps": 5}},
    ["model.scan_layers=true", "model.remat=full", "model.vocab_size=40", "model.max_length=64"],
  )
  model = EncoderDecoder(config.model)
  tx = make_optimizer(config.optim, config.model.d_model)
  mesh = sh.make_mesh(MeshConfig(2, 2, 2))
  _, shardings = state_shardings(model, tx, mesh)
  state = create_state(model, tx, mesh, 0, shardings)
  src, tgt = _batch()
  batch = {"inputs": np.tile(np.asarray(src), (4, 1))[:8], "targets": np.tile(np.asarray(tgt), (4, 1))[:8]}
  state, metrics = make_train_step(model, tx, config, mesh, shardings)(state, batch, jax.random.key(0))
  assert np.isfinite(float(metrics["loss"]))
  saver = ckpt.Checkpointer(tmp_path, async_save=False)
  saver.save(state, force=True)
  saver.close()

  other = sh.make_mesh(MeshConfig(4, 1, 2), jax.devices()[:8])
  abstract, other_shardings = state_shardings(model, tx, other)
  restored = ckpt.Checkpointer(tmp_path).restore(ckpt.sharded_target(abstract, other_shardings))
  assert int(restored.step) == 1
  _assert_close(jax.device_get(restored), jax.device_get(state), tol=0.0)
  wi = restored.params["encoder"]["ffn"]["wi"]
  assert wi.shape == (BASE["num_encoder_layers"], BASE["d_model"], BASE["d_ff"])
  assert wi.sharding.spec == PartitionSpec("stage", "fsdp", "tensor")  # layers over stage (size 1 here)


DECODE = dict(max_length=16, tie_embeddings=False)


@pytest.fixture(scope="module")
def decode_params():
  """Unrolled params with large embeddings and output projection, so that the token and
  position drive greedy search to varied outputs (a random init emits one token forever)."""
  src, _ = _batch()
  model = EncoderDecoder(_config(**DECODE))
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: model.init(k, src, src), jax.random.key(0)))["params"]
  rng = np.random.default_rng(1)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    std = 1.0 if "embed" in name or "output_proj" in name else 0.3 if "cross_attention" in name else 0.1
    return jnp.asarray(std * rng.standard_normal(s.shape) + name.endswith("['scale']"), jnp.float32)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def test_scan_decoding_matches_unrolled(decode_params):
  unrolled, scanned = _config(**DECODE), _config(**DECODE, scan_layers=True, remat="full")
  stacked = _stacked(decode_params)
  src, _ = _batch()
  cache = contiguous_cache(EncoderDecoder(scanned), stacked, 3, SRC_LEN)
  self_key = cache.layers["decoder"]["self_attention"]["key"]  # segments of positions 0-7 and 8-15
  assert [x.shape for x in self_key] == [(BASE["num_decoder_layers"], 3, 2, 8, 8)] * 2
  assert [x.shape for x in cache.layers["decoder"]["cross_attention"]["key"]] == [
    (BASE["num_decoder_layers"], 3, 2, SRC_LEN, 8)
  ]
  np.testing.assert_array_equal(cache.state.lengths, [0, 0, 0])
  runs = ((unrolled, decode_params), (scanned, stacked))

  greedy = [
    np.asarray(jax.jit(lambda p, s, c=c: greedy_decode(EncoderDecoder(c), p, s, 12, eos_id=-1))(p, src))
    for c, p in runs
  ]
  assert len(np.unique(greedy[0])) > 3
  np.testing.assert_array_equal(greedy[0], greedy[1])

  beams = [
    jax.jit(lambda p, s, c=c: beam_search(EncoderDecoder(c), p, s, beam_size=3, max_decode_len=10))(p, src)
    for c, p in runs
  ]
  np.testing.assert_array_equal(np.asarray(beams[0][0]), np.asarray(beams[1][0]))
  np.testing.assert_allclose(np.asarray(beams[0][1]), np.asarray(beams[1][1]), atol=1e-5, rtol=1e-5)
