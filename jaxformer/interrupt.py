"""Ctrl-C for `train`: stop at a step boundary, finish what is being written, exit with 130.

Python runs signal handlers only on the main thread between bytecodes, so a Ctrl-C that
lands while XLA compiles, or while native threads (checkpoint writes, prefetch) are busy,
either waits for them or races interpreter shutdown against them. Instead, `install` blocks
SIGINT in every thread and a watcher thread takes it with `sigwait`:

  * inside the step loop (`loop_active`), the first Ctrl-C sets `requested`; the loop stops
    after the current step, waits for pending checkpoint writes, closes its logs and raises
    `KeyboardInterrupt`;
  * anywhere else (imports, data preparation, compiling, restoring), and on a second Ctrl-C,
    the process exits at once with status 130. Nothing half-written is ever taken as
    complete: prepared data and checkpoints are written under temporary names and renamed
    when complete.

`exit_interrupted` ends the process without interpreter teardown, so no native thread
outlives the objects it uses.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

requested = threading.Event()     # a Ctrl-C asked the loop to stop
loop_active = threading.Event()   # the step loop checks `requested` between steps
_installed = threading.Event()


def exit_interrupted() -> None:
  """Prints `interrupted`, flushes the standard streams and exits with status 130 at once."""
  print("interrupted", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(130)


def _watch() -> None:
  signal.sigwait({signal.SIGINT})
  if not loop_active.is_set():
    exit_interrupted()
  requested.set()
  print("stopping after the current step (Ctrl-C again to quit at once)", file=sys.stderr, flush=True)
  signal.sigwait({signal.SIGINT})
  exit_interrupted()


def install() -> None:
  """Routes SIGINT to the watcher thread; call before any other thread starts (before JAX is
  imported), since threads inherit the blocked signal mask. Idempotent. A process that
  inherited SIGINT ignored (a background job of a script) keeps ignoring it."""
  if (_installed.is_set() or threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
    return
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  threading.Thread(target=_watch, name="jaxformer-interrupt", daemon=True).start()
  _installed.set()


def check() -> None:
  """Raises KeyboardInterrupt if a Ctrl-C asked the step loop to stop."""
  if requested.is_set():
    raise KeyboardInterrupt
