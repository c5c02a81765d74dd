"""The `jaxformer` command end to end: train on 4 simulated devices, resume, eval, errors."""

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import COMPILE_FLAGS

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def cli_env() -> dict:
  """The environment of a CLI run: the CLI sets its own device count from runtime.num_cpu_devices;
  XLA compiles with the suite's fast-compile flags (conftest.COMPILE_FLAGS)."""
  return dict(os.environ, XLA_FLAGS=COMPILE_FLAGS)


def run_cli(*args, check=True):
  env = cli_env()
  proc = subprocess.run(
    [sys.executable, "-m", "jaxformer", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
  )
  if check and proc.returncode != 0:
    raise AssertionError(f"jaxformer {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
  return proc


def _common(data_dir):
  return [
    f"data.data_dir={data_dir}",
    "data.buckets=[64]",
    "model.num_encoder_layers=1",
    "model.num_decoder_layers=1",
    "train.log_every=1",
    "train.eval_every=100",
    "train.eval_batches=2",
    "train.checkpoint_every=4",
    "train.batch_size=16",
  ]


def _metrics(workdir):
  return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _train_losses(workdir):
  return {m["step"]: m["loss"] for m in _metrics(workdir) if "loss" in m}


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, multi30k_dir):
  workdir = tmp_path_factory.mktemp("run4")
  eight = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "runtime.num_cpu_devices=8"]
  run_cli("train", "--config", TINY, "--workdir", str(workdir), *_common(multi30k_dir), *eight, "train.num_steps=8")
  first = _metrics(workdir)
  resumed = run_cli(
    "train", "--config", TINY, "--workdir", str(workdir), *_common(multi30k_dir), *eight, "train.num_steps=12"
  )
  assert f"resuming from the step-8 checkpoint in {workdir}" in resumed.stderr
  return workdir, first


@pytest.mark.slow
def test_train_on_eight_devices_then_resume(resumed_run, tmp_path, multi30k_dir):
  workdir, first = resumed_run
  losses = _train_losses(workdir)
  assert sorted(losses) == list(range(1, 13))  # the resumed run continued at step 9
  assert [m["step"] for m in first if "loss" in m] == list(range(1, 9))
  record = [m for m in _metrics(workdir) if "loss" in m][-1]
  for key in ("step", "loss", "learning_rate", "grad_norm", "tokens_per_sec"):
    assert key in record
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [4, 8, 12]
  assert (workdir / "config.yaml").is_file() and (workdir / "tokenizer.model").is_file()
  assert list((workdir / "tensorboard").iterdir())
  # An uninterrupted single-device run gives the same per-step loss curve (dropout on): the
  # data x fsdp x tensor sharding changed nothing, and the resumed run picked up step, optimizer
  # state, schedule, data order and dropout keys exactly.
  straight = tmp_path / "straight"
  run_cli("train", "--config", TINY, "--workdir", str(straight), *_common(multi30k_dir), "train.num_steps=12")
  straight_losses = _train_losses(straight)
  assert sorted(straight_losses) == list(range(1, 13))
  for step, loss in straight_losses.items():
    assert losses[step] == pytest.approx(loss, rel=1e-5), step


def _first_lines(name, count):
  with gzip.open(ROOT / "jaxformer" / "data" / "raw" / "multi30k" / name, "rt", encoding="utf-8") as f:
    return "".join(next(f) for _ in range(count))


@pytest.mark.slow
def test_eval_is_identical_on_every_mesh_and_prints_json(resumed_run, tmp_path):
  """The (2,2,2) checkpoint evaluated on 4 devices (4,1,1), 2 devices (1,1,2) and 1 device
  (naming the step): the same hypotheses, BLEU and reference loss."""
  workdir, _ = resumed_run
  src, ref = tmp_path / "src.en", tmp_path / "ref.de"
  src.write_text(_first_lines("val.en.gz", 40))
  ref.write_text(_first_lines("val.de.gz", 40))
  results, hypotheses = [], []
  for mesh in (
    ["runtime.num_cpu_devices=4", "mesh.data=4"],
    ["runtime.num_cpu_devices=2", "mesh.data=1", "mesh.tensor=2"],
    ["--step", "12"],
  ):
    out = tmp_path / f"hyps{len(results)}.txt"
    proc = run_cli("eval", "--workdir", str(workdir), "--src", str(src), "--ref", str(ref), "--output", str(out), *mesh)
    results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    hypotheses.append(out.read_text())
  result = results[0]
  assert [r["step"] for r in results] == [12, 12, 12] and result["num_sentences"] == 40
  assert 0.0 <= result["bleu"] <= 100.0 and 0.0 <= result["chrf"] <= 100.0
  assert result["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
  assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-3)
  assert 0.0 < result["loss"] < 8.0 and result["num_tokens"] > 40
  assert len(hypotheses[0].splitlines()) == 40
  for other, hyps in zip(results[1:], hypotheses[1:]):
    assert hyps == hypotheses[0]
    assert (other["bleu"], other["chrf"], other["num_tokens"]) == (result["bleu"], result["chrf"], result["num_tokens"])
    assert other["loss"] == pytest.approx(result["loss"], rel=1e-6)
  translated = subprocess.run(
    [sys.executable, "-m", "jaxformer", "translate", "--workdir", str(workdir)],
    input="A man is riding a bike.\n",
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  assert translated.returncode == 0 and len(translated.stdout.splitlines()) == 1


def _error_line(proc):
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  return lines[0]


def test_bad_inputs_give_one_line_errors(tmp_path):
  workdir = str(tmp_path / "w")
  line = _error_line(run_cli("train", "--config", TINY, "--workdir", workdir, "train.num_step=3", check=False))
  assert "did you mean train.num_steps?" in line
  line = _error_line(run_cli("train", "--config", TINY, "--workdir", workdir, "train.batch_size=x", check=False))
  assert "train.batch_size must be int" in line
  line = _error_line(run_cli("train", "--config", TINY, "--workdir", workdir, "mesh.data=3", check=False))
  assert "but there are 1 devices" in line
  line = _error_line(
    run_cli(
      "train",
      "--config",
      TINY,
      "--workdir",
      workdir,
      "runtime.num_cpu_devices=4",
      "mesh.data=4",
      "train.batch_size=6",
      check=False,
    )
  )
  assert "train.batch_size=6 is not divisible by the data-parallel size 4" in line
  line = _error_line(run_cli("eval", "--workdir", str(tmp_path / "empty"), check=False))
  assert "not a jaxformer workdir" in line
  assert not (tmp_path / "w").exists() or not list((tmp_path / "w").glob("checkpoints/*"))


def test_eval_errors_on_workdir_without_checkpoints_and_mismatched_files(tmp_path):
  from jaxformer.checkpoint.run_files import save_run_files
  from jaxformer.config import dump_config, load_config

  workdir = tmp_path / "w"
  save_run_files(workdir, dump_config(load_config(TINY)), b"not used before the checks")
  src, ref = tmp_path / "src", tmp_path / "ref"
  src.write_text("a\nb\n")
  ref.write_text("a\n")
  line = _error_line(run_cli("eval", "--workdir", str(workdir), "--src", str(src), "--ref", str(ref), check=False))
  assert "--src has 2 lines but --ref has 1" in line
  ref.write_text("a\nb\n")
  line = _error_line(run_cli("eval", "--workdir", str(workdir), "--src", str(src), "--ref", str(ref), check=False))
  assert "no checkpoint in" in line


def test_config_command_lists_and_shows_every_key(tmp_path):
  listed = run_cli("config", "--list").stdout.strip().splitlines()
  configs = json.loads(listed[-1])["configs"]
  assert {c["name"] for c in configs} >= {"tiny", "multi30k_small", "shakespeare_char"} and len(listed) == len(
    configs
  ) + 1
  assert all(c["description"] for c in configs)
  shown = run_cli("config", "--show", "tiny", "train.num_steps=5").stdout.strip().splitlines()
  rows = {line.split(" = ")[0].strip(): line for line in shown[:-1]}
  assert rows["train.num_steps"].split(" = ")[1].startswith("5  (int, default 10000)  optimizer steps")
  assert "data.packing" in rows and all("(" in line for line in rows.values())
  from jaxformer.config import load_config, to_dict

  assert json.loads(shown[-1]) == to_dict(load_config(TINY, ["train.num_steps=5"]))
  assert "did you mean train.num_steps?" in _error_line(
    run_cli("config", "--show", TINY, "train.num_step=5", check=False)
  )
  assert "jaxformer config --list" in run_cli("train", "--help").stdout


def test_scoring_mismatched_counts_and_zero_batch_sizes_are_refused(tmp_path):
  from jaxformer.tasks import evaluate

  with pytest.raises(ValueError, match="3 hypotheses but 2 references"):
    evaluate.score(["a", "b", "c"], ["a", "b"])
  assert evaluate.score(["a b c d"], ["a b c d"])["bleu"] == 100.0
  for command in (["eval", "--workdir", str(tmp_path)], ["bench", "--config", TINY]):
    proc = run_cli(*command, "--batch-size", "0", check=False)
    assert proc.returncode == 2 and "--batch-size: 0 must be >= 1" in proc.stderr


@pytest.mark.slow
def test_averaged_checkpoints_evaluate_on_the_fly_and_as_a_workdir(resumed_run, tmp_path):
  """Paper section 6.1: `eval --average-last N` and `jaxformer average` give the same params."""
  workdir, _ = resumed_run
  src, ref = tmp_path / "src.en", tmp_path / "ref.de"
  src.write_text(_first_lines("val.en.gz", 20))
  ref.write_text(_first_lines("val.de.gz", 20))
  texts = ["--src", str(src), "--ref", str(ref)]
  fly = json.loads(
    run_cli(
      "eval", "--workdir", str(workdir), *texts, "--average-last", "3", "--output", str(tmp_path / "fly.txt")
    ).stdout.splitlines()[-1]
  )
  assert fly["averaged_steps"] == [4, 8, 12] and fly["step"] == 12
  out = tmp_path / "avg3"
  made = json.loads(run_cli("average", "--workdir", str(workdir), "--last", "3", "--output", str(out)).stdout)
  assert made == {"workdir": str(out), "averaged_steps": [4, 8, 12]}
  written = json.loads(
    run_cli("eval", "--workdir", str(out), *texts, "--output", str(tmp_path / "written.txt")).stdout.splitlines()[-1]
  )
  assert (written["bleu"], written["loss"], written["step"]) == (fly["bleu"], fly["loss"], 12)
  assert (tmp_path / "written.txt").read_text() == (tmp_path / "fly.txt").read_text()
  _error_line(
    run_cli("average", "--workdir", str(workdir), "--last", "4", "--output", str(tmp_path / "a4"), check=False)
  )
  assert not (tmp_path / "a4").exists()
  both = run_cli("eval", "--workdir", str(workdir), "--step", "4", "--average-last", "2", check=False)
  assert both.returncode == 2 and "not allowed with argument" in both.stderr
  _error_line(run_cli("train", "--config", TINY, "--workdir", str(out), check=False))
