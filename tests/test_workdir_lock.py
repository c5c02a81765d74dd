"""One training run per workdir: a live holder (another process) is refused with its pid and
host, a killed holder's lock is taken over, and `jaxformer train` refuses in one line."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxformer.errors import CheckpointError
from jaxformer.runtime.workdir_lock import LOCK_FILE, hold

ROOT = Path(__file__).parent.parent
HOLDER = (
  "import sys, time; from jaxformer.runtime.workdir_lock import hold\n"
  "with hold(sys.argv[1]):\n  print('held', flush=True); time.sleep(600)"
)


def _start_holder(workdir):
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
  assert proc.stdout.readline() == "held\n"
  return proc


def test_live_holder_is_refused_and_a_killed_one_is_taken_over(tmp_path):
  workdir = tmp_path / "run"
  holder = _start_holder(workdir)
  try:
    with pytest.raises(
      CheckpointError,
      match=rf"{workdir} is in use by another `jaxformer train` "
      rf"\(pid {holder.pid} on host {socket.gethostname()}, since ",
    ):
      with hold(workdir):
        pass
  finally:
    holder.send_signal(signal.SIGKILL)  # a crash: the holder never releases anything itself
    holder.wait()
  with hold(workdir):
    assert json.loads((workdir / LOCK_FILE).read_text())["pid"] == os.getpid()
  with hold(workdir):  # released at the end of the block: taken again
    pass


def test_a_workdir_that_cannot_hold_a_lock_is_left_to_the_workdir_check(tmp_path):
  not_a_dir = tmp_path / "file"
  not_a_dir.write_text("")
  with hold(not_a_dir):  # `train` then refuses it with the workdir check's own one-line error
    assert not_a_dir.is_file()


def test_second_train_is_refused_in_one_line(tmp_path):
  workdir = tmp_path / "run"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  with hold(workdir):
    proc = subprocess.run(
      [
        sys.executable,
        "-m",
        "jaxformer",
        "train",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--workdir",
        str(workdir),
        f"data.data_dir={tmp_path / 'data'}",
      ],
      capture_output=True,
      text=True,
      env=env,
      cwd=ROOT,
      timeout=600,
    )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.splitlines() == [
    f"error: {workdir} is in use by another `jaxformer train` (pid {os.getpid()} on host {socket.gethostname()}, "
    f"since {json.loads((workdir / LOCK_FILE).read_text())['since']}); wait for it to finish or stop it, "
    "or pass another --workdir"
  ]
  assert sorted(p.name for p in workdir.iterdir()) == [LOCK_FILE]  # nothing else was written
