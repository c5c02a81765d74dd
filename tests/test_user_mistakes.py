"""User mistakes found by trying the CLI as a user would (issue 16): each gives one `error:` line
(exit 2) or, where the command can still do its job, a correct result; none is silently wrong."""

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from test_cli import TINY, _error_line, _first_lines, run_cli

from jaxformer import sharding as sh
from jaxformer.checkpoint import manager as ckpt
from jaxformer.checkpoint import run_files as rf
from jaxformer.config import MeshConfig, dump_config, load_config
from jaxformer.data.tokenizer import train_tokenizer
from jaxformer.tasks import evaluate, get_task
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings

SMALL = [
  "model.vocab_size=64",
  "model.d_model=16",
  "model.num_heads=2",
  "model.d_ff=24",
  "model.num_encoder_layers=1",
  "model.num_decoder_layers=1",
  "data.buckets=[32,64]",
]
STEP = 5  # the fabricated run's checkpoint


def _make_run(workdir: Path, data_dir: Path, scale: float = 1.0) -> list[str]:
  """A workdir as `train` leaves it (config.yaml, a 64-piece tokenizer, a step-STEP checkpoint of
  a freshly initialised small model, its params times `scale`), without training. Returns the
  train overrides that resume it."""
  overrides = SMALL + [f"data.data_dir={data_dir}", f"train.num_steps={STEP}"]
  config = load_config(TINY, overrides)
  tokenizer = train_tokenizer(_first_lines("train.en.gz", 400).splitlines(), 64)
  rf.save_run_files(workdir, dump_config(config), tokenizer.serialized)
  model = get_task(config).make_model()
  tx = make_optimizer(config.optim, config.model.d_model)
  mesh = sh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
  _, shardings = state_shardings(model, tx, mesh)
  state = create_state(model, tx, mesh, 0, shardings)
  state = state.replace(step=jnp.asarray(STEP, jnp.int32), params=jax.tree.map(lambda p: p * scale, state.params))
  saver = ckpt.Checkpointer(workdir, async_save=False)
  saver.save(state, force=True)
  saver.close()
  return overrides


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("mistakes")
  return root / "run", _make_run(root / "run", root / "data")


@contextlib.contextmanager
def read_only(folder: Path):
  """Makes `folder` read-only: by its mode, or (root ignores modes) as a read-only bind mount;
  skips the test where neither works."""
  folder.chmod(0o555)
  mounted = False
  try:
    if os.access(folder, os.W_OK):
      mounted = subprocess.run(["mount", "--bind", folder, folder], capture_output=True).returncode == 0
      if not mounted or subprocess.run(["mount", "-o", "remount,bind,ro", folder], capture_output=True).returncode:
        pytest.skip("cannot make a read-only folder here (root without mount rights)")
    yield folder
  finally:
    if mounted:
      subprocess.run(["umount", folder], check=True)
    folder.chmod(0o755)


def _files(folder: Path) -> dict[str, bytes]:
  return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _run_files(workdir: Path) -> dict[str, bytes]:
  """The checkpoints and the config and tokenizer files (with any temporary ones) of a workdir."""
  return {
    name: data
    for name, data in _files(workdir).items()
    if name.startswith(("checkpoints/", rf.CONFIG_FILE, rf.TOKENIZER_FILE))
  }


def test_an_unknown_platform_or_one_this_machine_lacks_is_one_line(tmp_path):
  line = _error_line(
    run_cli("train", "--config", TINY, "--workdir", str(tmp_path), "runtime.platform=foo", check=False)
  )
  assert "runtime.platform='foo' is unknown; use cpu | gpu | tpu" in line
  for platform in ("gpu", "tpu"):  # the first one this machine lacks
    proc = run_cli(
      "train", "--config", TINY, "--workdir", str(tmp_path), f"runtime.platform={platform}", "--dry-run", check=False
    )
    if proc.returncode:
      assert f"runtime.platform={platform}: this machine has no {platform} devices, only cpu" in _error_line(proc)
      return
  pytest.skip("this machine has gpu and tpu devices")


def test_workdir_and_data_dir_that_are_files_or_read_only(tmp_path, run):
  file = tmp_path / "file"
  file.write_text("mine")
  line = _error_line(run_cli("train", "--config", TINY, "--workdir", str(file), check=False))
  assert f"--workdir={file}: {file} is a file, not a directory" in line
  line = _error_line(
    run_cli("train", "--config", TINY, "--workdir", str(tmp_path / "w"), f"data.data_dir={file}", check=False)
  )
  assert f"data.data_dir={file}: {file} is a file, not a directory" in line
  assert file.read_text() == "mine" and not (tmp_path / "w").exists()

  workdir, overrides = run
  before = _files(workdir)
  (tmp_path / "ro").mkdir()
  with read_only(tmp_path / "ro"):
    line = _error_line(run_cli("train", "--config", TINY, "--workdir", str(tmp_path / "ro" / "new"), check=False))
    assert f"{tmp_path / 'ro'} is not writable (read-only file system or no permission)" in line
  with read_only(workdir):  # resuming a run in a read-only workdir
    line = _error_line(
      run_cli(
        "train", "--config", TINY, "--workdir", str(workdir), *overrides, f"train.num_steps={STEP + 5}", check=False
      )
    )
    assert f"--workdir={workdir}: {workdir} is not writable" in line
  assert _files(workdir) == before  # nothing written, no config.yaml.tmp


def test_save_run_files_failure_is_one_line_and_leaves_no_temp_file(tmp_path):
  (tmp_path / rf.CONFIG_FILE).mkdir()  # os.replace cannot put a file over a folder
  with pytest.raises(ckpt.CheckpointError, match=f"cannot write the run files in --workdir {tmp_path}: Is a dir"):
    rf.save_run_files(tmp_path, "name: x\n", b"tokenizer")
  assert sorted(p.name for p in tmp_path.iterdir()) == [rf.CONFIG_FILE]


def test_resume_below_or_at_the_latest_step_and_with_another_tokenizer(run):
  """Nothing is trained and nothing rewritten: config.yaml, tokenizer.model and the checkpoints stay the run's."""
  workdir, overrides = run
  before = _run_files(workdir)
  line = _error_line(
    run_cli(
      "train", "--config", TINY, "--workdir", str(workdir), *overrides, f"train.num_steps={STEP - 2}", check=False
    )
  )
  assert (
    f"already holds the step-{STEP} checkpoint, past train.num_steps={STEP - 2}; raise train.num_steps above {STEP}"
  ) in line
  done = run_cli("train", "--config", TINY, "--workdir", str(workdir), *overrides, "train.log_every=7")
  assert f"nothing to train: {workdir} already holds the step-{STEP} checkpoint" in done.stderr and not done.stdout
  line = _error_line(
    run_cli(
      "train",
      "--config",
      TINY,
      "--workdir",
      str(workdir),
      *overrides,
      f"train.num_steps={STEP + 5}",
      "data.tokenizer=bpe",
      check=False,
    )
  )
  assert (
    f"{workdir} was trained with data.tokenizer='unigram' (not data.tokenizer='bpe') and its checkpoints only "
    "fit that tokenizer"
  ) in line
  assert _run_files(workdir) == before


def test_eval_output_that_is_a_directory_fails_before_decoding(tmp_path, run):
  workdir, _ = run
  src = tmp_path / "src.en"
  src.write_text("A man is riding a bike.\n")
  out = tmp_path / "out"
  out.mkdir()
  line = _error_line(
    run_cli("eval", "--workdir", str(workdir), "--src", str(src), "--ref", str(src), "--output", str(out), check=False)
  )
  assert f"--output {out} is a directory; give a file path" in line
  assert not list(out.iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["out", "src.en"]
  with pytest.raises(ValueError, match=f"its folder {tmp_path / 'missing'} is missing"):
    evaluate.hypotheses_destination(str(tmp_path / "missing" / "h.txt"), workdir)
  assert evaluate.hypotheses_destination(None, workdir) == str(workdir)


def test_eval_on_a_read_only_workdir_prints_its_scores(tmp_path, run):
  workdir, _ = run
  src, ref = tmp_path / "src.en", tmp_path / "ref.de"
  src.write_text(_first_lines("val.en.gz", 3))
  ref.write_text(_first_lines("val.de.gz", 3))
  with read_only(workdir):
    proc = run_cli("eval", "--workdir", str(workdir), "--src", str(src), "--ref", str(ref))
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  hypotheses = Path(result["hypotheses"])
  try:
    assert result["step"] == STEP and result["num_sentences"] == 3 and 0.0 <= result["bleu"] <= 100.0
    assert f"note: {workdir} is not writable, so the hypotheses go to {hypotheses.parent}" in proc.stderr
    assert len(hypotheses.read_text().splitlines()) == 3 and hypotheses.parent != workdir
  finally:
    shutil.rmtree(hypotheses.parent)


def test_eval_of_a_diverged_model_prints_valid_json(tmp_path):
  """Huge weights give a finite loss whose exp overflows: perplexity Infinity was not JSON."""
  nan, inf = float("nan"), float("inf")
  assert (
    evaluate.result_json({"loss": nan, "perplexity": inf, "search": {"x": [1.5, -inf]}, "step": 3})
    == '{"loss": null, "perplexity": null, "search": {"x": [1.5, null]}, "step": 3}'
  )
  workdir = tmp_path / "run"
  _make_run(workdir, tmp_path / "data", scale=1e3)
  src, ref = tmp_path / "src.en", tmp_path / "ref.de"
  src.write_text(_first_lines("val.en.gz", 2))
  ref.write_text(_first_lines("val.de.gz", 2))
  proc = run_cli("eval", "--workdir", str(workdir), "--src", str(src), "--ref", str(ref))
  line = proc.stdout.strip().splitlines()[-1]
  result = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not JSON: {line}"))
  assert result["perplexity"] is None and result["loss"] > 709  # exp(loss) overflows a float64
