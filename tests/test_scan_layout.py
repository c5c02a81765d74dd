"""`model.scan_layers` is a pure re-layout of the unrolled stacks: bitwise the same init, the
same dropout masks (so equal logits and train steps up to float rounding), conversion both
ways, and a run that switches layout on resume. (Loss and gradients with dropout and remat:
tests/test_remat.py.)"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import shakespeare_files, sweep

from jaxformer import sharding as sh
from jaxformer.config import ModelConfig, load_config
from jaxformer.inference import restore as inference_restore
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.models.encoder_only import EncoderOnly
from jaxformer.models.layout import is_scanned, layer_stacks, saved_layout_is_scanned, stack_layers, unstack_layers
from jaxformer.models.transformer import PAD_ID, EncoderDecoder
from jaxformer.train.loop import train

VOCAB = 37
BASE = dict(
  vocab_size=VOCAB,
  d_model=16,
  num_heads=2,
  d_ff=24,
  num_encoder_layers=2,
  num_decoder_layers=3,
  max_length=16,
  dropout_rate=0.2,
  attention_dropout_rate=0.3,
)
KINDS = {"encoder_decoder": EncoderDecoder, "decoder_only": DecoderOnly, "encoder_only": EncoderOnly}


def _tokens(seed, shape):
  ids = np.random.default_rng(seed).integers(4, VOCAB, shape).astype(np.int32)
  ids[1, shape[1] // 2 :] = PAD_ID
  return jnp.asarray(ids)


def _models(kind, **kw):
  cls = KINDS[kind]
  return cls(ModelConfig(**BASE, kind=kind, **kw)), cls(ModelConfig(**BASE, kind=kind, scan_layers=True, **kw))


def _args(kind):
  return (_tokens(0, (3, 11)), _tokens(1, (3, 9))) if kind == "encoder_decoder" else (_tokens(0, (3, 11)),)


@pytest.mark.parametrize("kind", sweep(KINDS, {"encoder_only"}))
def test_scanned_init_is_the_stacked_unrolled_init(kind):
  unrolled, scanned = _models(kind)
  boxed = jax.jit(scanned.init)(jax.random.key(4), *_args(kind))["params"]  # jitted: one compile, not one per op
  u = nn.meta.unbox(jax.jit(unrolled.init)(jax.random.key(4), *_args(kind))["params"])
  s = nn.meta.unbox(boxed)
  stacks = layer_stacks(unrolled)
  assert not is_scanned(u, stacks) and is_scanned(s, stacks)
  expected = stack_layers(u, stacks)
  assert jax.tree.structure(expected) == jax.tree.structure(s)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(s)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The stacked leaves carry the logical `layers` axis first, so they shard like nn.scan's.
  name = next(iter(stacks))
  assert nn.get_partition_spec(boxed)[name]["ffn"]["wi"] == jax.sharding.PartitionSpec(sh.LAYERS, "embed", "mlp")
  back = unstack_layers(s, stacks)
  assert jax.tree.structure(back) == jax.tree.structure(u)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(u)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_scanned_logits_with_dropout_equal_unrolled(kind):
  unrolled, scanned = _models(kind, remat="full")
  params = nn.meta.unbox(jax.jit(unrolled.init)(jax.random.key(4), *_args(kind))["params"])
  stacked = stack_layers(params, layer_stacks(unrolled))

  def logits(model, p, key):
    return np.asarray(
      jax.jit(lambda p, k: model.apply({"params": p}, *_args(kind), deterministic=False, rngs={"dropout": k}))(p, key)
    )

  key = jax.random.key(9)
  ref, ours = logits(unrolled, params, key), logits(scanned, stacked, key)
  # Dropout acts (another key moves the logits by far more than rounding), and with the
  # same masks in every layer the layouts agree to float32 rounding of the logits (|logits| ~ 4).
  assert np.abs(ref - logits(unrolled, params, jax.random.key(10))).max() > 0.1
  np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=0)


def _lm_run(workdir, num_steps, *overrides):
  """A tiny character LM with dropout trained in-process; returns its logged train losses by step."""
  config = load_config(
    "configs/shakespeare_char.yaml",
    [
      *shakespeare_files(workdir.parent),
      "model.d_model=16",
      "model.num_heads=2",
      "model.d_ff=32",
      "model.num_decoder_layers=2",
      "model.max_length=16",
      "data.max_length=16",
      "train.batch_size=8",
      f"train.num_steps={num_steps}",
      "train.log_every=1",
      "train.eval_every=1000",
      "train.checkpoint_every=2",
      "model.dropout_rate=0.1",
      "optim.warmup_steps=2",
      "optim.decay_steps=6",
      "train.async_checkpoint=false",
      "train.steps_per_call=1",
      *overrides,
    ],
  )
  train(config, workdir)
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return config, {r["step"]: r["loss"] for r in rows if "loss" in r}


def _restored(workdir, step):
  return inference_restore.restore(workdir, inference_restore.workdir_config(workdir), step).params


@pytest.mark.slow
def test_resume_switches_layout(tmp_path):
  _, straight = _lm_run(tmp_path / "straight", 4)
  _lm_run(tmp_path / "switched", 2)
  config, resumed = _lm_run(tmp_path / "switched", 4, "model.scan_layers=true", "model.remat=full")
  for step in (3, 4):  # train steps of the scanned model, from the unrolled step-2 checkpoint
    assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step
  stacks = layer_stacks(DecoderOnly(config.model))
  ref = jax.device_get(_restored(tmp_path / "straight", 4))
  # The switched run's config is scanned now: its step-4 checkpoint is scanned, and `eval`
  # reads its unrolled step-2 checkpoint into the scanned layout too.
  switched_config = inference_restore.workdir_config(tmp_path / "switched")
  assert switched_config.model.scan_layers
  ours = jax.device_get(_restored(tmp_path / "switched", 4))
  assert is_scanned(ours, stacks)
  for a, b in zip(jax.tree.leaves(stack_layers(ref, stacks)), jax.tree.leaves(ours)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  checkpoints = tmp_path / "switched" / "checkpoints"
  assert not saved_layout_is_scanned(checkpoints / "2", stacks) and saved_layout_is_scanned(checkpoints / "4", stacks)
  first = jax.device_get(_restored(tmp_path / "switched", 2))
  before = jax.device_get(_restored(tmp_path / "straight", 2))
  for a, b in zip(jax.tree.leaves(stack_layers(before, stacks)), jax.tree.leaves(first)):
    np.testing.assert_array_equal(a, b)
