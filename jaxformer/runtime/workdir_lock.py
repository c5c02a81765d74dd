"""One training run per workdir: `train` holds an exclusive lock on `<workdir>/train.lock`.

The lock is `fcntl.flock` on the open file, so the kernel drops it when the holder exits in
any way, `kill -9` and crashes included: the lock of a dead run is simply taken over. The
file's text names the holder (pid, host, start time) for the refusal message; it outlives the
run and means nothing unless the lock is held. The file is never deleted (deleting it would
let two runs lock two different files of the same name).

NFS: Linux turns `flock` on NFS into a POSIX byte-range lock that the server arbitrates
(NFSv4, or NFSv3 with lockd), so two hosts exclude each other too; the lock of a host that
died is freed when the server's lease runs out (about 90 s on NFSv4). A filesystem without
locks (some FUSE mounts) fails with ENOLCK or EOPNOTSUPP: the run then says in one line that
nothing stops a second run, and goes on. Forked children that outlive the run (no exec) keep
the lock with the file descriptor they inherited.

In a multi-process run only process 0 takes the lock (the caller decides).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from jaxformer.errors import CheckpointError

LOCK_FILE = "train.lock"


@contextlib.contextmanager
def hold(workdir: str | Path) -> Iterator[None]:
  """Holds the lock of `workdir` (created if missing) for the `with` block.

  A workdir that is not a writable directory is not locked: training in it fails at the
  workdir check that follows, with its own one-line error.

  Raises:
    CheckpointError: a live process holds the lock (the message names its pid and host), or
      the lock file cannot be opened in a writable workdir.
  """
  path = Path(workdir) / LOCK_FILE
  with contextlib.suppress(OSError):
    path.parent.mkdir(parents=True, exist_ok=True)
  if not (path.parent.is_dir() and os.access(path.parent, os.W_OK)):
    yield
    return
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise CheckpointError(
      f"cannot open the lock file {path}: {e.strerror}; remove it or pass another --workdir"
    ) from None
  try:
    if _lock(fd, path):
      holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      }
      os.ftruncate(fd, 0)
      os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    yield
  finally:
    os.close(fd)  # releases the lock


def _lock(fd: int, path: Path) -> bool:
  """Takes the lock without waiting; False if this filesystem has no locks."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    raise CheckpointError(
      f"{path.parent} is in use by another `jaxformer train` ({_holder(fd)}); "
      "wait for it to finish or stop it, or pass another --workdir"
    ) from None
  except OSError as e:  # ENOLCK, EOPNOTSUPP: a filesystem without locks
    print(
      f"warning: cannot lock {path} ({e.strerror}): nothing stops a second run on this workdir",
      file=sys.stderr,
      flush=True,
    )
    return False
  return True


def _holder(fd: int) -> str:
  """Who holds the lock, from the file's text."""
  try:
    holder = json.loads(os.pread(fd, 4096, 0))
    return f"pid {holder['pid']} on host {holder['host']}, since {holder['since']}"
  except (ValueError, KeyError, TypeError):  # the holder has not written its name yet
    return "a process that has not written its name yet"
