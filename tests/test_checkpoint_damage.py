"""Damaged checkpoints: each kind of damage is reported in one line and the newest intact step
is used (eval, translate, resume); an explicit damaged step is an error; the writer sets damaged
steps aside and never deletes an intact one while a newer step is unproven; a failed save (a
file too large, a path that is not a folder) stops training with one line before any further
save and leaves nothing that restores as complete."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from test_cli import cli_env

from jaxformer import sharding as sh
from jaxformer.checkpoint import manager as ckpt
from jaxformer.checkpoint import run_files as rf
from jaxformer.config import MeshConfig, load_config
from jaxformer.inference import restore as inference_restore
from jaxformer.tasks import get_task
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import state_shardings

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


# `python -m jaxformer` where a write past 256 KiB fails with EFBIG, as one on a full disk fails
# with ENOSPC (Python ignores SIGXFSZ).
SMALL_FILES = (
  "import resource, runpy; "
  "resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY)); "
  "runpy.run_module('jaxformer', run_name='__main__')"
)


def run_cli(*args, stdin=None, launch=("-m", "jaxformer")):
  return subprocess.run(
    [sys.executable, *launch, *args], capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=600, input=stdin
  )


def _train_args(workdir, data_dir, num_steps, *extra):
  return [
    "train",
    "--config",
    TINY,
    "--workdir",
    str(workdir),
    f"data.data_dir={data_dir}",
    "data.buckets=[64]",
    "model.num_encoder_layers=1",
    "model.num_decoder_layers=1",
    "train.batch_size=16",
    "train.log_every=1",
    "train.eval_every=100",
    "train.eval_batches=2",
    "train.checkpoint_every=2",
    f"train.num_steps={num_steps}",
    *extra,
  ]


def _losses(workdir):
  rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def run(tmp_path_factory, multi30k_dir):
  """A 4-step tiny run with checkpoints at steps 2 and 4, trained once for the module."""
  workdir, data_dir = tmp_path_factory.mktemp("run"), multi30k_dir
  proc = run_cli(*_train_args(workdir, data_dir, 4))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ckpt.Checkpointer(workdir, read_only=True).all_steps() == [2, 4]
  return workdir, data_dir


@pytest.fixture(scope="module")
def targets(run):
  """(train-state target, params target, step-2 params) on one device."""
  config = load_config(run[0] / rf.CONFIG_FILE)
  model = get_task(config).make_model()
  mesh = sh.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  abstract, shardings = state_shardings(model, make_optimizer(config.optim, config.model.d_model), mesh)
  params_target = ckpt.sharded_target(abstract.params, shardings.params)
  _, params2 = ckpt.Checkpointer(run[0], read_only=True).restore_params(params_target, 2)
  return ckpt.sharded_target(abstract, shardings), params_target, jax.device_get(params2)


def _array_files(step_dir):
  # Every data file: which one holds which arrays is Orbax's business, and eval reads only the params.
  return list((step_dir / "default").glob("ocdbt.process_*/d/*"))


def _truncate(step_dir):
  for path in _array_files(step_dir):
    path.write_bytes(path.read_bytes()[:100])


def _garbage(name):
  return lambda step_dir: (step_dir / "default" / name).write_bytes(b"\xb3garbage{\x00" * 7)


def _empty(step_dir):
  for child in step_dir.iterdir():
    shutil.rmtree(child) if child.is_dir() else child.unlink()


# Each kind of damage and the words of its one-line report.
DAMAGE = {
  "truncated_array": (_truncate, "OUT_OF_RANGE: Error reading"),
  "deleted_array": (lambda d: [p.unlink() for p in _array_files(d)], "Error reading"),
  "garbage_metadata": (_garbage("_METADATA"), "default/_METADATA is not valid JSON"),
  "garbage_manifest": (_garbage("manifest.ocdbt"), 'manifest.ocdbt": Error decoding manifest'),
  "missing_default_dir": (lambda d: shutil.rmtree(d / "default"), "its default/ folder is missing"),
  "empty_step_dir": (_empty, "no commit marker commit_success.txt"),
  "no_commit_marker": (lambda d: (d / ckpt.COMMIT_MARKER).unlink(), "no commit marker commit_success.txt"),
}


def _damaged_copy(run, tmp_path, kind, steps=(4,)):
  workdir = tmp_path / "w"
  shutil.copytree(run[0], workdir)
  for step in steps:
    DAMAGE[kind][0](workdir / "checkpoints" / str(step))
  return workdir


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_step_falls_back_in_eval_and_resume(run, targets, tmp_path, capfd, kind):
  state_target, params_target, params2 = targets
  workdir = _damaged_copy(run, tmp_path, kind)
  words = DAMAGE[kind][1]
  capfd.readouterr()

  # eval/translate/generate: the step-2 params, one line naming step 4 and the damage; nothing moved.
  restored = inference_restore.restore(workdir, inference_restore.workdir_config(workdir))
  assert restored.step == 2
  _assert_trees_equal(restored.params, params2)
  lines = capfd.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"checkpoint step 4 in {workdir / 'checkpoints'} is damaged (")
  assert words in lines[0] and lines[0].endswith("skipping it")
  assert (workdir / "checkpoints" / "4").is_dir()

  # An explicit damaged step is a one-line error, with no fallback.
  with pytest.raises(ckpt.CheckpointError, match=r"checkpoint step 4 in .* is damaged \(") as error:
    inference_restore.restore(workdir, inference_restore.workdir_config(workdir), step=4)
  assert words in str(error.value) and "\n" not in str(error.value)

  # Resume (the writer): step 2, and step 4 moved aside intact for inspection, never deleted.
  files = sorted(p.relative_to(workdir / "checkpoints" / "4") for p in (workdir / "checkpoints" / "4").rglob("*"))
  capfd.readouterr()
  checkpointer = ckpt.Checkpointer(workdir)
  state = checkpointer.restore(state_target)
  checkpointer.close()
  assert int(state.step) == 2
  _assert_trees_equal(state.params, params2)
  moved = workdir / ckpt.DAMAGED_DIR / "4"
  lines = capfd.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"checkpoint step 4 in {workdir / 'checkpoints'} is damaged (")
  assert words in lines[0] and lines[0].endswith(f"moved it to {moved}")
  assert sorted(p.relative_to(moved) for p in moved.rglob("*")) == files
  assert ckpt.Checkpointer(workdir, read_only=True).all_steps() == [2]


def test_no_intact_step_refuses_to_start_over(run, targets, tmp_path, capfd):
  workdir = _damaged_copy(run, tmp_path, "truncated_array", steps=(2, 4))
  with pytest.raises(ckpt.CheckpointError, match=r"no intact checkpoint in .*steps \[2, 4\] are damaged"):
    ckpt.Checkpointer(workdir).restore(targets[0])
  assert len(capfd.readouterr().err.splitlines()) == 2  # one line per damaged step
  assert sorted(p.name for p in (workdir / ckpt.DAMAGED_DIR).iterdir()) == ["2", "4"]
  # A later run does not silently start over while damaged steps are set aside ...
  with pytest.raises(ckpt.CheckpointError, match="remove that folder to train from scratch"):
    ckpt.Checkpointer(workdir).latest_step()
  assert ckpt.Checkpointer(workdir, read_only=True).latest_step() is None  # (readers just see no step)
  # ... until the user removes them.
  shutil.rmtree(workdir / ckpt.DAMAGED_DIR)
  assert ckpt.Checkpointer(workdir).latest_step() is None


def test_a_target_that_does_not_fit_is_an_error_not_damage(run, targets, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(run[0], workdir)
  wrong = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct((a.shape[0] + 1, *a.shape[1:]), a.dtype, sharding=a.sharding), targets[1]
  )
  with pytest.raises(ckpt.CheckpointError, match="cannot restore checkpoint step 4 in .*: Requested shape"):
    ckpt.Checkpointer(workdir).restore_params(wrong)
  assert ckpt.Checkpointer(workdir, read_only=True).all_steps() == [2, 4] and not (workdir / ckpt.DAMAGED_DIR).exists()


def test_translate_reports_damage_in_one_line_and_nothing_else(run, tmp_path):
  workdir = _damaged_copy(run, tmp_path, "truncated_array")
  proc = run_cli("translate", "--workdir", str(workdir), stdin="A man is riding a bike.\n")
  assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1
  lines = proc.stderr.splitlines()  # nothing from Orbax or TensorStore, even at exit
  assert len(lines) == 1 and lines[0].startswith(f"checkpoint step 4 in {workdir / 'checkpoints'} is damaged (")
  assert "OUT_OF_RANGE" in lines[0]


def test_resume_falls_back_and_keeps_steps_only_behind_intact_ones(run, tmp_path):
  workdir = _damaged_copy(run, tmp_path, "truncated_array")
  first = _losses(workdir)
  proc = run_cli(*_train_args(workdir, run[1], 8, "train.keep_checkpoints=2"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr and "Event loop" not in proc.stderr
  assert f"moved it to {workdir / ckpt.DAMAGED_DIR / '4'}" in proc.stderr
  assert f"resuming from the step-2 checkpoint in {workdir}" in proc.stderr
  # The replayed steps 3-4 retrace the original run (exact resume from the intact step 2) ...
  losses = _losses(workdir)
  assert sorted(losses) == list(range(1, 9))
  for step in (3, 4):
    assert losses[step] == pytest.approx(first[step], rel=1e-5)
  # ... keep_checkpoints=2 dropped step 2 only once newer intact steps were written; the damaged step is kept aside.
  assert ckpt.Checkpointer(workdir, read_only=True).all_steps() == [6, 8]
  assert (workdir / ckpt.DAMAGED_DIR / "4" / ckpt.COMMIT_MARKER).is_file()


def test_failed_save_stops_training_with_one_line_and_leaves_no_checkpoint(run, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(run[0], workdir)
  proc = run_cli(*_train_args(workdir, run[1], 12), launch=("-c", SMALL_FILES))
  assert proc.returncode == 2, proc.stderr[-3000:]
  error = proc.stderr.splitlines()[-1]
  assert error.startswith(f"error: saving the step-6 checkpoint in {workdir / 'checkpoints'} failed (")
  assert "File too large" in error and "Traceback" not in proc.stderr
  # Stopped at the first failed save: no later save was attempted, nothing half-written is left.
  assert max(_losses(workdir)) <= 8
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]
  assert ckpt.Checkpointer(workdir, read_only=True).latest_step() == 4


def test_a_save_that_cannot_make_its_folder_names_the_step_and_the_cause(run, targets, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(run[0], workdir)
  checkpointer = ckpt.Checkpointer(workdir)
  state = checkpointer.restore(targets[0])
  shutil.rmtree(workdir / "checkpoints")
  (workdir / "checkpoints").write_text("")  # its folder is gone, a file in its place: a real OSError
  with pytest.raises(ckpt.CheckpointError, match=r"saving the step-5 checkpoint in .* failed \(Not a directory: "):
    # At once: the step's folders are made before `save` returns (made in the background, a
    # failure there would leave Orbax's writer threads waiting, and the process could not exit).
    checkpointer.save(state.replace(step=jax.numpy.asarray(5, jax.numpy.int32)), force=True)
  checkpointer.close()  # reported once: closing raises nothing


def test_an_unfinished_save_is_ignored_then_replaced(run, targets, tmp_path, capfd):
  workdir = tmp_path / "w"
  shutil.copytree(run[0], workdir)
  tmp = workdir / "checkpoints" / "4.orbax-checkpoint-tmp"  # what a save killed mid-way leaves
  (workdir / "checkpoints" / "4").rename(tmp)
  capfd.readouterr()
  assert inference_restore.restore(workdir, inference_restore.workdir_config(workdir)).step == 2
  checkpointer = ckpt.Checkpointer(workdir)
  state = checkpointer.restore(targets[0])
  assert int(state.step) == 2 and capfd.readouterr().err == ""  # not damage: nothing to report
  checkpointer.save(state.replace(step=jax.numpy.asarray(4, jax.numpy.int32)), force=True)
  checkpointer.close()
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]
