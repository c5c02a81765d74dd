"""Ctrl-C during `jaxformer train`, at three moments from start-up to checkpointing: the process
always exits within a few seconds with status 130 (never killed by a signal), and a later run
resumes from a complete checkpoint. SIGTERM (preemption) to one process of a two-process run
stops both at the same step, checkpoints it and exits with 143; rerunning resumes there, losing
no step."""

import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_cli import ROOT, TINY, cli_env

# The tiny model with one layer per stack, as in test_cli and test_checkpoint_damage: the same
# programs, compiled once per session (the compilation cache).
RUN = [
  "train.batch_size=16",
  "train.log_every=5",
  "train.eval_every=1000",
  "train.eval_batches=2",
  "train.checkpoint_every=5",
  "train.num_steps=100000",
  "data.buckets=[64]",
  "model.num_encoder_layers=1",
  "model.num_decoder_layers=1",
]


# A child of a background job inherits SIGINT ignored, which `jaxformer train` respects; a
# user's terminal does not ignore it, so the child first restores Python's own handler.
LAUNCH = (
  "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
  "sys.argv = ['jaxformer'] + sys.argv[1:]; runpy.run_module('jaxformer', run_name='__main__')"
)


def _checkpoint_steps(workdir):
  folder = workdir / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


@pytest.mark.slow
def test_ctrl_c_exits_promptly_with_130(tmp_path, multi30k_dir):
  env = cli_env()
  data = [f"data.data_dir={multi30k_dir}"]
  workdir = tmp_path / "run"
  # Two moments in start-up (imports, data, compiling) and, last, one in the step loop once a
  # checkpoint exists (however long compiling takes on a loaded machine).
  for delay in (0.5, 4.0, None):
    proc = subprocess.Popen(
      [sys.executable, "-c", LAUNCH, "train", "--config", TINY, "--workdir", str(workdir), *data, *RUN],
      cwd=ROOT,
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
    )
    if delay is None:
      deadline = time.time() + 300
      while not _checkpoint_steps(workdir) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
      time.sleep(0.2)
    else:
      time.sleep(delay)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    try:
      _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired as timeout:
      proc.kill()
      raise AssertionError(f"Ctrl-C after {delay} s: no exit within 60 s") from timeout
    waited = time.perf_counter() - sent
    assert proc.returncode == 130, f"Ctrl-C after {delay} s: status {proc.returncode}\n{err[-2000:]}"
    assert waited < 10, f"Ctrl-C after {delay} s took {waited:.1f} s to exit"
    assert err.rstrip().endswith("interrupted") and "Traceback" not in err
  # The run did get to train and checkpoint along the way, and resumes from a complete checkpoint.
  steps = _checkpoint_steps(workdir)
  assert steps, "no checkpoint was written"
  resumed = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxformer",
      "train",
      "--config",
      TINY,
      "--workdir",
      str(workdir),
      *data,
      *RUN,
      f"train.num_steps={steps[-1] + 5}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f"resuming from the step-{steps[-1]} checkpoint" in resumed.stderr


def _logged_steps(workdir):
  path = workdir / "metrics.jsonl"
  rows = [line for line in path.read_text().splitlines() if '"loss"' in line] if path.is_file() else []
  return [json.loads(line)["step"] for line in rows if line.endswith("}")]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_every_process_at_the_same_step(tmp_path, multi30k_dir):
  from test_multihost import _env

  env = _env(tmp_path)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  workdir = tmp_path / "run"
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "jaxformer",
        "train",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        str(i),
        "--config",
        TINY,
        "--workdir",
        str(workdir),
        f"data.data_dir={multi30k_dir}",
        *RUN,
        "train.log_every=1",
        "train.checkpoint_every=1000",
        "runtime.num_cpu_devices=2",
        "mesh.data=2",
        "mesh.fsdp=2",
      ],
      cwd=ROOT,
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  try:
    deadline = time.time() + 300
    while len(_logged_steps(workdir)) < 3 and all(p.poll() is None for p in procs) and time.time() < deadline:
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # the scheduler preempts one host only
    errs = [p.communicate(timeout=120)[1] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [143, 143], errs[0][-2000:] + errs[1][-2000:]
  logged = _logged_steps(workdir)
  saved = _checkpoint_steps(workdir)
  # The checkpoint is of the last step the run logged (not a multiple of checkpoint_every): no step is lost.
  assert saved == [logged[-1]] and logged == list(range(1, logged[-1] + 1))
  assert all("Traceback" not in err for err in errs) and errs[1].rstrip().endswith("terminated")
  assert "SIGTERM: stopping after the current step" in errs[1]
  # Rerunning (here as one process on the same 4-device mesh) resumes at that step.
  resumed = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxformer",
      "train",
      "--config",
      TINY,
      "--workdir",
      str(workdir),
      f"data.data_dir={multi30k_dir}",
      *RUN,
      "train.log_every=1",
      "train.checkpoint_every=1000",
      "runtime.num_cpu_devices=4",
      "mesh.data=2",
      "mesh.fsdp=2",
      f"train.num_steps={saved[-1] + 2}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f"resuming from the step-{saved[-1]} checkpoint" in resumed.stderr
  assert _logged_steps(workdir) == list(range(1, saved[-1] + 3))
