"""Ctrl-C during `jaxformer train`, at ten moments from start-up to checkpointing: the process
always exits within a few seconds with status 130 (never killed by a signal), and a later run
resumes from a complete checkpoint."""

import os
import signal
import subprocess
import sys
import time

import pytest

from test_cli import ROOT, TINY

RUN = ["train.batch_size=8", "train.log_every=5", "train.eval_every=1000", "train.checkpoint_every=5",
       "train.num_steps=100000", "data.buckets=[32,64]", "model.d_model=32", "model.num_heads=2", "model.d_ff=48",
       "model.num_encoder_layers=1", "model.num_decoder_layers=1"]


# A child of a background job inherits SIGINT ignored, which `jaxformer train` respects; a
# user's terminal does not ignore it, so the child first restores Python's own handler.
LAUNCH = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "sys.argv = ['jaxformer'] + sys.argv[1:]; runpy.run_module('jaxformer', run_name='__main__')")


@pytest.mark.slow
def test_ctrl_c_exits_promptly_with_130(tmp_path):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  data = [f"data.data_dir={tmp_path / 'data'}"]
  workdir = tmp_path / "run"
  for delay in (0.5, 1.5, 3.0, 4.5, 6.0, 7.5, 9.0, 11.0, 13.0, 16.0):
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "train", "--config", TINY, "--workdir", str(workdir),
                             *data, *RUN], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(delay)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    try:
      _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()
      raise AssertionError(f"Ctrl-C after {delay} s: no exit within 60 s")
    waited = time.perf_counter() - sent
    assert proc.returncode == 130, f"Ctrl-C after {delay} s: status {proc.returncode}\n{err[-2000:]}"
    assert waited < 10, f"Ctrl-C after {delay} s took {waited:.1f} s to exit"
    assert err.rstrip().endswith("interrupted") and "Traceback" not in err
  # The run did get to train and checkpoint along the way, and resumes from a complete checkpoint.
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps, "no checkpoint was written in ten tries"
  resumed = subprocess.run([sys.executable, "-m", "jaxformer", "train", "--config", TINY, "--workdir", str(workdir),
                            *data, *RUN[:-6], f"train.num_steps={steps[-1] + 5}", *RUN[-5:]], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f"resuming from the step-{steps[-1]} checkpoint" in resumed.stderr
