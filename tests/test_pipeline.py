"""Pipeline parallelism over `mesh.stage` (jaxformer/models/pipeline.py): the schedule and its
bubble, the pipelined step equal to the unpipelined one on several meshes, one-line errors,
and checkpoints that restore across pipelined and unpipelined runs."""

import dataclasses
import functools
import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_config

from jaxformer import sharding as sh
from jaxformer.checkpoint.manager import Checkpointer, sharded_target
from jaxformer.config import ConfigError, MeshConfig
from jaxformer.models.layout import layer_stacks, restore_state, unstack_layers
from jaxformer.models.pipeline import Pipeline, pipeline_for
from jaxformer.runtime.startup import build_mesh
from jaxformer.tasks import get_task
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import abstract_state, create_state
from jaxformer.train.step import make_train_step

ROOT = Path(__file__).parent.parent
ROWS, LENGTH = 16, 12  # the length splits over mesh.context=2


def test_schedule_and_bubble_fraction():
  # GPipe, 2 stages x 3 microbatches: stage s works on microbatch t - s at iteration t.
  assert Pipeline(2, 3).schedule().tolist() == [[0, -1], [1, 0], [2, 1], [-1, 2]]
  assert Pipeline(2, 3).bubble_fraction == 2 / 8
  assert Pipeline(4, 4).bubble_fraction == pytest.approx(3 / 7)
  assert Pipeline(4, 12).bubble_fraction == pytest.approx(3 / 15)


def _config(kind, mesh, *overrides):
  config = tiny_config(
    kind,
    "model.dropout_rate=0.0",
    "model.scan_layers=true",
    "optim.warmup_steps=10",
    "optim.eps=1e-4",
    f"train.batch_size={ROWS}",
    *overrides,
  )
  return dataclasses.replace(config, mesh=MeshConfig(**dict(mesh)))


def _batches(kind, steps=2):
  rng = np.random.default_rng(0)
  for _ in range(steps):
    ids = rng.integers(4, 1000, size=(2, ROWS, LENGTH)).astype(np.int32)
    ids = np.where(np.arange(LENGTH) < rng.integers(3, LENGTH, size=(2, ROWS, 1)), ids, 0)  # padded rows
    yield {"inputs": ids[0], "targets": ids[1] if kind == "encoder_decoder" else np.roll(ids[0], -1, axis=1)}


def _state(config, model):
  mesh = sh.make_mesh(config.mesh, jax.devices()[: int(np.prod(list(config.mesh.sizes.values())))])
  tx = make_optimizer(config.optim, config.model.d_model)
  rules = sh.rules_for(config.mesh)
  shardings = sh.logical_to_sharding(abstract_state(model, tx)[1], mesh, rules)
  return mesh, tx, shardings, create_state(model, tx, mesh, 0, shardings, rules=rules)


@functools.cache
def _train(kind, mesh, *overrides):
  """(per-token losses, final state) of two steps of `kind` on `mesh`."""
  config = _config(kind, mesh, *overrides)
  model = get_task(config).make_model()
  mesh, tx, shardings, state = _state(config, model)
  step = make_train_step(model, tx, config, mesh, shardings)
  losses = []
  for batch in _batches(kind):
    state, metrics = step(state, batch, jax.random.key(7))
    losses.append(float(metrics["loss"] / metrics["num_tokens"]))
  return losses, state


def _reference(kind, *overrides):
  return _train(kind, (("data", 1),), *overrides)


# Meshes as tuples of (axis, size) pairs (hashable, for the cache). The fast case has every
# axis a stage composes with (fsdp, tensor) and remat; the slow ones the rest.
STAGE2 = (("stage", 2), ("fsdp", 2), ("tensor", 2), ("data", 1))
CASES = [
  pytest.param(
    "decoder_only", STAGE2, ("train.microbatches=4",), ("model.remat=full",), id="dec-stage2-fsdp2-tensor2-remat"
  ),
  pytest.param(
    "decoder_only",
    (("data", 4), ("stage", 2)),
    ("train.microbatches=2",),
    (),
    id="dec-stage2-data4",
    marks=pytest.mark.slow,
  ),
  pytest.param(
    "decoder_only",
    (("stage", 4), ("data", 2)),
    ("train.microbatches=2", "train.grad_accum_steps=2"),
    ("model.num_decoder_layers=4",),
    id="dec-stage4-data2-accum",
    marks=pytest.mark.slow,
  ),
  pytest.param(
    "encoder_decoder",
    (("stage", 2), ("data", 4)),
    ("train.microbatches=2",),
    (),
    id="encdec-stage2-data4",
    marks=pytest.mark.slow,
  ),
  pytest.param(
    "encoder_only",
    (("stage", 2), ("data", 4)),
    ("train.microbatches=2",),
    ("data.dataset=tinyshakespeare",),
    id="enc-stage2-data4",
    marks=pytest.mark.slow,
  ),
  # Context-parallel attention inside the stages (a map manual over context and stage).
  pytest.param(
    "decoder_only",
    (("stage", 2), ("context", 2), ("data", 2)),
    ("train.microbatches=2",),
    ("model.position=rope", "model.attention=blockwise", "model.attention_block_size=4"),
    id="dec-stage2-context2-data2-blockwise",
    marks=pytest.mark.slow,
  ),
  # The router's losses (summed over the microbatches) are part of the loss compared.
  pytest.param(
    "decoder_only",
    (("stage", 2), ("expert", 2), ("data", 2)),
    ("train.microbatches=2",),
    ("model.num_experts=4",),
    id="moe-stage2-expert2-data2",
    marks=pytest.mark.slow,
  ),
]


@pytest.mark.parametrize("kind, mesh, pipeline, model", CASES)
def test_pipelined_step_equals_unpipelined(kind, mesh, pipeline, model):
  ref_losses, ref_state = _reference(kind, *model)
  losses, state = _train(kind, mesh, *pipeline, *model)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  leaves = jax.tree.leaves(jax.device_get(state.params))
  assert len(leaves) == len(jax.tree.leaves(ref_state.params))
  for a, b in zip(leaves, jax.tree.leaves(jax.device_get(ref_state.params))):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # The scanned params are split over the stage axis: each stage device holds its block of layers.
  wi = state.params["decoder" if kind == "encoder_decoder" else "layer"]["ffn"]["wi"]
  stages = dict(mesh)["stage"]
  assert wi.sharding.spec[0] == "stage" and wi.addressable_shards[0].data.shape[0] * stages == wi.shape[0]


@pytest.mark.slow
def test_pipeline_draws_dropout_per_microbatch():
  """With dropout the pipelined step is an equally valid sample: finite, learning, and not the
  unpipelined bits (layer l of microbatch m draws from fold_in(rngs[l], m))."""
  mesh, overrides = (("data", 4), ("stage", 2)), ("model.dropout_rate=0.1",)
  losses, _ = _train("decoder_only", mesh, "train.microbatches=2", *overrides)
  ref_losses, _ = _reference("decoder_only", *overrides)
  assert np.all(np.isfinite(losses)) and not np.allclose(losses, ref_losses, rtol=1e-6)
  assert losses == pytest.approx(ref_losses, rel=0.05)


@pytest.mark.slow
def test_bench_reports_the_bubble_of_the_schedule_it_runs():
  from jaxformer.bench import step as bench

  config = _config("decoder_only", (("data", 4), ("stage", 2)), "train.microbatches=2", "train.batch_size=8")
  result = bench.run_bench(config, bench.BenchOptions(batch_size=8, tgt_length=7, steps=1, warmup=0, peer=False))
  assert result["bubble_fraction"] == Pipeline(2, 2).bubble_fraction == pytest.approx(1 / 3)
  assert result["mesh"]["stage"] == 2 and all(np.isfinite(result["losses"]))


@pytest.mark.parametrize(
  "overrides, message",
  [
    (("model.scan_layers=false",), "mesh.stage=2 pipelines the layer stack, which needs model.scan_layers=true"),
    (("model.num_decoder_layers=3",), "model.num_decoder_layers=3 does not split into mesh.stage=2 pipeline stages"),
    (("train.microbatches=3",), "train.batch_size=16 does not split into train.microbatches=3"),
    (("train.microbatches=4", "train.grad_accum_steps=2"), "use a train.batch_size that is a multiple of 32"),
  ],
)
def test_pipeline_mistakes_fail_in_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message) as error:
    build_mesh(_config("decoder_only", {"data": 4, "stage": 2}, *overrides))
  assert "\n" not in str(error.value)


def test_microbatches_without_stages_run_unpipelined():
  """So a pipelined run's config (checkpoint) evaluates on a mesh without stages."""
  config = _config("decoder_only", {"data": 8}, "train.microbatches=2")
  assert pipeline_for(config, build_mesh(config)) is None


def _save(workdir, state):
  checkpointer = Checkpointer(workdir, async_save=False)
  try:
    checkpointer.save(state, force=True)
  finally:
    checkpointer.close()


def _restore(workdir, config):
  model = get_task(config).make_model()
  mesh = sh.make_mesh(config.mesh)
  abstract, logical = abstract_state(model, make_optimizer(config.optim, config.model.d_model))
  target = sharded_target(abstract, sh.logical_to_sharding(logical, mesh, sh.rules_for(config.mesh)))
  checkpointer = Checkpointer(workdir, read_only=True)
  try:
    return model, restore_state(checkpointer, target, model)
  finally:
    checkpointer.close()


def test_checkpoint_restores_across_pipelined_and_unpipelined_runs(tmp_path):
  """The layout is the scanned one either way: a pipelined run's checkpoint restores on a
  data-parallel mesh in the unrolled layout, and that one back onto the stage mesh."""
  _, state = _train("decoder_only", STAGE2, "train.microbatches=4", "model.remat=full")
  _save(tmp_path / "pipelined", state)
  model, restored = _restore(tmp_path / "pipelined", _config("decoder_only", {"data": 8}, "model.scan_layers=false"))
  saved = jax.device_get(state.params)
  for a, b in zip(
    jax.tree.leaves(jax.device_get(restored.params)), jax.tree.leaves(unstack_layers(saved, layer_stacks(model)))
  ):
    np.testing.assert_array_equal(a, b)
  _save(tmp_path / "unrolled", restored)
  staged = _config("decoder_only", (("data", 4), ("stage", 2)), "train.microbatches=2")
  _, back = _restore(tmp_path / "unrolled", staged)
  assert back.params["layer"]["ffn"]["wi"].sharding.spec[0] == "stage"
  for a, b in zip(jax.tree.leaves(jax.device_get(back.params)), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_two_processes_pipelined_match_one_process_unpipelined(tmp_path):
  """2 processes x 4 CPU devices on a stage=2 x data=2 x fsdp=2 mesh train the character LM
  pipelined; one process on 8 devices trains it data-parallel, unpipelined: the same losses.
  The pipelined checkpoint then evaluates in one process on one device."""
  from conftest import shakespeare_files
  from test_multihost import LAUNCH, _check, _env, _losses, _run

  env = _env(tmp_path)
  common = [
    "--config",
    "configs/shakespeare_char.yaml",
    *shakespeare_files(tmp_path),
    "model.d_model=32",
    "model.num_heads=2",
    "model.d_ff=48",
    "model.num_decoder_layers=2",
    "model.scan_layers=true",
    "model.max_length=16",
    "data.max_length=16",
    "train.batch_size=8",
    "train.num_steps=4",
    "train.steps_per_call=2",
    "train.log_every=2",
    "train.eval_every=100",
    "train.eval_batches=2",
    "train.checkpoint_every=4",
    "optim.warmup_steps=2",
  ]
  multi, _ = _run(
    [
      "bash",
      LAUNCH,
      "2",
      "--",
      "train",
      "--workdir",
      str(tmp_path / "multi"),
      *common,
      "runtime.num_cpu_devices=4",
      "mesh.stage=2",
      "mesh.data=2",
      "mesh.fsdp=2",
      "train.microbatches=2",
    ],
    env,
  )
  _check(multi)
  single, _ = _run(
    [
      sys.executable,
      "-m",
      "jaxformer",
      "train",
      "--workdir",
      str(tmp_path / "single"),
      *common,
      "runtime.num_cpu_devices=8",
      "mesh.data=8",
    ],
    env,
  )
  _check(single)
  multi_losses, single_losses = _losses(tmp_path / "multi"), _losses(tmp_path / "single")
  assert sorted(multi_losses) == sorted(single_losses) == [2, 4]
  for step, values in single_losses.items():
    assert multi_losses[step] == pytest.approx(values, rel=1e-5), step
  result, _ = _run(
    [
      sys.executable,
      "-m",
      "jaxformer",
      "eval",
      "--workdir",
      str(tmp_path / "multi"),
      "runtime.num_cpu_devices=1",
      "mesh.stage=1",
      "mesh.data=1",
      "mesh.fsdp=1",
    ],
    env,
  )
  out = json.loads(_check(result).stdout.strip().splitlines()[-1])
  assert out["step"] == 4 and math.isfinite(out["loss"]) and out["loss"] < math.log(66) + 1.0
