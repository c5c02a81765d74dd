"""Non-finite values (`train.nan_policy`): the step never applies a non-finite update and flags
it; `abort` stops naming the step and keeps the last good checkpoint; `skip` counts the skips
and stops after `train.max_consecutive_skips` in a row."""

import json
import math
import re

import jax
import numpy as np
import pytest
from conftest import shakespeare_files

from jaxformer import cli
from jaxformer import sharding as sh
from jaxformer.checkpoint import manager as ckpt
from jaxformer.config import Config, ConfigError, MeshConfig, ModelConfig, OptimConfig, TrainConfig, load_config
from jaxformer.data import PAD_ID, global_batch
from jaxformer.errors import NonFiniteError
from jaxformer.models.transformer import EncoderDecoder
from jaxformer.tasks import get_task
from jaxformer.train import loop
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_train_step

VOCAB = 37
POISON = 10**6  # a target id past the vocabulary: its log-probability, hence the loss, is NaN


def _batch(seed: int, poison: bool = False) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  src = rng.integers(4, VOCAB, (4, 9)).astype(np.int32)
  tgt = rng.integers(4, VOCAB, (4, 7)).astype(np.int32)
  tgt[1, 3:] = PAD_ID
  if poison:
    tgt[0, 1] = POISON
  return {"inputs": src, "targets": tgt}


def _step_and_state(learning_rate: float):
  """(train step, initial state, mesh) of a tiny encoder-decoder on one device."""
  model_cfg = ModelConfig(
    vocab_size=VOCAB,
    d_model=16,
    num_heads=2,
    d_ff=24,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_length=16,
  )
  config = Config(model=model_cfg, optim=OptimConfig(schedule="constant", learning_rate=learning_rate))
  mesh = sh.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  model = EncoderDecoder(config.model)
  tx = make_optimizer(config.optim, config.model.d_model)
  _, shardings = state_shardings(model, tx, mesh)
  state = create_state(model, tx, mesh, 0, shardings)
  return make_train_step(model, tx, config, mesh, shardings), state, mesh


def _steps(learning_rate: float, batches):
  """Host (state, metrics) after each single-step call of a tiny encoder-decoder on `batches`."""
  step, state, mesh = _step_and_state(learning_rate)
  out = [(jax.device_get(state), None)]
  for batch in batches:
    state, metrics = step(state, global_batch(batch, mesh), jax.random.key(0))
    out.append(jax.device_get((state, metrics)))
  return out


def _assert_trees_identical(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_non_finite_loss_is_flagged_and_its_update_not_applied():
  (_, _), (s1, m1), (s2, m2), (s3, m3) = _steps(1e-2, [_batch(0), _batch(1, poison=True), _batch(2)])
  assert math.isnan(float(m2["loss"]))
  assert [float(m["nonfinite"]) for m in (m1, m2, m3)] == [0.0, 1.0, 0.0]
  assert [float(m["skipped"]) for m in (m1, m2, m3)] == [0.0, 1.0, 0.0]
  assert int(s2.step) == 2  # the step still counts, so the next batch and dropout key follow
  _assert_trees_identical((s2.params, s2.opt_state), (s1.params, s1.opt_state))
  moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(s3.params), jax.tree.leaves(s2.params)))
  assert moved > 1e-3 and all(np.isfinite(x).all() for x in jax.tree.leaves(s3.params))


def test_an_update_that_overflows_the_params_is_not_applied():
  """Finite loss and gradients, but an infinite learning rate: the new params are not finite."""
  (s0, _), (s1, m1) = _steps(math.inf, [_batch(0)])
  assert math.isfinite(float(m1["loss"])) and math.isfinite(float(m1["grad_norm"]))
  assert float(m1["nonfinite"]) == float(m1["skipped"]) == 1.0
  _assert_trees_identical(s1.params, s0.params)


def test_an_update_whose_squared_norm_overflows_float32_is_not_applied():
  """Every element finite (about 1e30) but the squared update norm overflows: counted as non-finite."""
  (s0, _), (s1, m1) = _steps(1e30, [_batch(0)])
  assert math.isfinite(float(m1["loss"])) and math.isfinite(float(m1["grad_norm"]))
  assert float(m1["nonfinite"]) == float(m1["skipped"]) == 1.0
  _assert_trees_identical(s1.params, s0.params)


def test_the_finiteness_checks_are_scalar_not_one_per_leaf():
  """An is-finite check of every leaf of the gradients, params and both moments compiled to an
  is-finite and a reduction per leaf (124 array is-finites here; 40% of a tiny step's compile);
  the loss, gradient-norm and update-norm checks are scalar (fusion may copy each a few times)."""
  step, state, mesh = _step_and_state(1e-2)
  with sh.bind(mesh, sh.LOGICAL_RULES):
    lowered = step.jitted.lower(state, global_batch(_batch(0), mesh), jax.random.key(0))
  text = lowered.compile().as_text()
  shapes = re.findall(r"= pred\[([\d,]*)\]\S* is-finite\(", text)
  assert shapes and not any(shapes), shapes


def test_summary_leaves_non_finite_steps_out_of_the_averages():
  good = {
    "loss": 6.0,
    "nll": 5.0,
    "correct": 1.0,
    "num_tokens": 3.0,
    "grad_norm": 2.0,
    "skipped": 0.0,
    "nonfinite": 0.0,
    "learning_rate": 0.1,
    "loss_scale": 1.0,
  }
  bad = dict(good, loss=math.nan, nll=math.nan, grad_norm=math.nan, skipped=1.0, nonfinite=1.0)
  record = loop._summarise([good, bad, good], 3, 1.0, [0.0])
  assert (record["loss"], record["nll"], record["accuracy"]) == (2.0, 10 / 6, 1 / 3)
  assert (record["skipped"], record["nonfinite_skips"], record["grad_norm"]) == (1, 1, 2.0)
  assert record["tokens_per_sec"] == 9.0
  empty = loop._summarise([bad], 1, 1.0, [0.0])
  assert empty["loss"] is None and empty["grad_norm"] is None and empty["nonfinite_skips"] == 1
  json.dumps(empty, allow_nan=False)  # valid JSON: no NaN


def test_config_keys_and_their_checks():
  config = load_config(
    "configs/tiny.yaml", ["train.nan_policy=skip", "train.max_consecutive_skips=3", "train.grad_accum_steps=4"]
  )
  assert (config.train.nan_policy, config.train.max_consecutive_skips, config.train.grad_accum_steps) == ("skip", 3, 4)
  assert (TrainConfig().nan_policy, TrainConfig().max_consecutive_skips) == ("abort", 10)
  with pytest.raises(ConfigError, match="train.nan_policy='warn' is unknown; use abort or skip"):
    load_config("configs/tiny.yaml", ["train.nan_policy=warn"])
  with pytest.raises(ConfigError, match="train.max_consecutive_skips must be >= 1, got 0"):
    load_config("configs/tiny.yaml", ["train.max_consecutive_skips=0"])


def test_cli_prints_the_error_as_one_line(monkeypatch, tmp_path, capsys):
  def diverge(args):
    raise NonFiniteError("step 3 has a non-finite loss, gradient or update (train.nan_policy=abort)")

  monkeypatch.setitem(cli.train.COMMANDS, "train", diverge)
  assert cli.main(["train", "--config", "configs/tiny.yaml", "--workdir", str(tmp_path)]) == 2
  assert capsys.readouterr().err == "error: step 3 has a non-finite loss, gradient or update (train.nan_policy=abort)\n"


# --- the training loop ----------------------------------------------------------------------------


def _poisoning(monkeypatch, bad_steps: set[int]):
  """Makes the loop's steps numbered `bad_steps` (1-based, as logged) see out-of-vocabulary targets."""
  real = loop.make_train_call

  def factory(*args):
    call = real(*args)

    def poisoned(state, batch, rng):
      first = int(state.step)
      targets = np.array(jax.device_get(batch["targets"]))
      rows = targets if targets.ndim == 3 else targets[None]  # [n, batch, length]
      for i in range(rows.shape[0]):
        if first + i + 1 in bad_steps:
          rows[i] = POISON
      batch = dict(batch, targets=jax.device_put(targets, batch["targets"].sharding))
      return call(state, batch, rng)

    return poisoned

  monkeypatch.setattr(loop, "make_train_call", factory)


def _lm_config(directory, num_steps: int, *overrides: str):
  # The text files and their prepared cache go in `directory`, beside the workdirs, not in one.
  # The vocabulary size is given (Tiny Shakespeare's 66 character ids), so `_params` builds the saved shapes.
  return load_config(
    "configs/shakespeare_char.yaml",
    [
      *shakespeare_files(directory),
      "model.vocab_size=66",
      "model.d_model=16",
      "model.num_heads=2",
      "model.d_ff=32",
      "model.num_decoder_layers=1",
      "model.max_length=16",
      "data.max_length=16",
      "train.batch_size=8",
      f"train.num_steps={num_steps}",
      "train.eval_every=1000",
      "train.keep_checkpoints=10",
      "optim.warmup_steps=2",
      "optim.decay_steps=20",
      "train.async_checkpoint=false",
      "train.log_every=1000",
      "train.steps_per_call=1",
      *overrides,
    ],
  )


def _params(workdir, config, step: int):
  """Host params of the step-`step` checkpoint in `workdir`."""
  model = get_task(config).make_model()
  mesh = sh.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  abstract, shardings = state_shardings(model, make_optimizer(config.optim, config.model.d_model), mesh)
  target = ckpt.sharded_target(abstract.params, shardings.params)
  return jax.device_get(ckpt.Checkpointer(workdir).restore_params(target, step)[1])


@pytest.mark.slow
def test_abort_names_the_step_keeps_the_last_good_checkpoint_and_resumes(monkeypatch, tmp_path):
  config = _lm_config(tmp_path / "text", 6, "train.checkpoint_every=2")
  loop.train(config, tmp_path / "clean")
  with monkeypatch.context() as patch:
    _poisoning(patch, {3})
    with pytest.raises(NonFiniteError, match=r"^step 3 has a non-finite loss.*train.nan_policy=abort"):
      loop.train(config, tmp_path / "run")
  # Step 4's checkpoint (after the bad step) was never written; step 2's is the clean run's.
  assert ckpt.Checkpointer(tmp_path / "run").all_steps() == [2]
  kept = _params(tmp_path / "run", config, 2)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(kept))
  _assert_trees_identical(kept, _params(tmp_path / "clean", config, 2))
  # Rerun (the cause gone): it resumes from step 2 and ends where the clean run did.
  loop.train(config, tmp_path / "run")
  _assert_trees_identical(_params(tmp_path / "run", config, 6), _params(tmp_path / "clean", config, 6))


@pytest.mark.slow
def test_skip_drops_the_bad_update_and_counts_it(monkeypatch, tmp_path):
  config = _lm_config(tmp_path / "text", 5, "train.checkpoint_every=1", "train.nan_policy=skip", "train.eval_batches=3")
  _poisoning(monkeypatch, {3})
  record = loop.train(config, tmp_path)
  assert record["step"] == 5 and record["nonfinite_skips"] == 1 and record["skipped"] == 1
  # The closing evaluation read the first 3 validation batches: 8 full 16-token windows each.
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [row["val_num_tokens"] for row in rows if "val_loss" in row] == [3 * 8 * 16]
  assert math.isfinite(record["loss"])
  _assert_trees_identical(_params(tmp_path, config, 3), _params(tmp_path, config, 2))
  after, skipped = jax.tree.leaves(_params(tmp_path, config, 4)), jax.tree.leaves(_params(tmp_path, config, 3))
  assert any(not np.array_equal(a, b) for a, b in zip(after, skipped))  # step 4 applied


def test_skip_stops_after_max_consecutive_skips_counted_across_calls(monkeypatch, tmp_path):
  """Two steps per call; steps 2 and 4 are isolated skips, 4 and 5 (two calls) make two in a row."""
  config = _lm_config(
    tmp_path / "text",
    8,
    "train.checkpoint_every=4",
    "train.nan_policy=skip",
    "train.max_consecutive_skips=2",
    "train.steps_per_call=2",
  )
  _poisoning(monkeypatch, {2, 4, 5})
  with pytest.raises(NonFiniteError, match=r"^steps 4 to 5 all had a non-finite .*train.max_consecutive_skips=2"):
    loop.train(config, tmp_path)
  assert ckpt.Checkpointer(tmp_path).all_steps() == [4]
