"""Preemption and Ctrl-C for `train`: SIGTERM (what SLURM, Kubernetes and TPU maintenance
send) or SIGINT stops the run at a step boundary with a committed checkpoint, then exits with
status 128 + the signal's number: 143 for SIGTERM, 130 for SIGINT.

Python runs signal handlers only on the main thread between bytecodes, so a signal that
lands while XLA compiles, or while native threads (checkpoint writes, prefetch) are busy,
either waits for them or races interpreter shutdown against them. Instead, `install` blocks
SIGINT and SIGTERM in every thread and a watcher thread takes them with `sigwait`:

  * inside the step loop (`loop_active`), the first signal sets `requested`; the loop finishes
    the current call, saves a checkpoint of that step synchronously, waits for any pending
    asynchronous save, closes its logs and raises `KeyboardInterrupt` (the CLI then exits with
    `status()`). Rerunning the same command resumes at that step and loses nothing. With
    several processes, the loop stops where any process was signalled (all agree on the
    step, see `train.loop`);
  * anywhere else (imports, data preparation, compiling, restoring), and on a second signal
    (also during that final save), the process exits at once. Nothing half-written is ever
    taken as complete: prepared data and checkpoints are written under temporary names and
    renamed when complete, so an interrupted save leaves the previous checkpoint the latest.

`exit_interrupted` ends the process without interpreter teardown, so no native thread
outlives the objects it uses.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
requested = threading.Event()  # a signal asked the loop to stop
loop_active = threading.Event()  # the step loop checks `requested` between steps
_installed = threading.Event()
_received: list[int] = []  # the signals taken so far, in order


def status() -> int:
  """The exit status for the first signal taken: 128 + its number (130 SIGINT, 143 SIGTERM);
  130 when none was (a KeyboardInterrupt raised by Python itself)."""
  return 128 + (_received[0] if _received else signal.SIGINT)


def pending() -> int:
  """The number of the signal that asked the step loop to stop, or 0."""
  return _received[0] if requested.is_set() else 0


def adopt(signum: int) -> None:
  """Stops this process as if it had taken `signum` (another process of the run did)."""
  if not _received:
    _received.append(signum)
  requested.set()


def exit_interrupted() -> None:
  """Prints `interrupted` (or `terminated`), flushes the standard streams and exits with
  `status()` at once."""
  print("terminated" if status() == 128 + signal.SIGTERM else "interrupted", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(status())


def _watch(signals: set[int]) -> None:
  _received.append(signal.sigwait(signals))
  if not loop_active.is_set():
    exit_interrupted()
  requested.set()
  print(
    f"{signal.Signals(_received[0]).name}: stopping after the current step and saving a checkpoint "
    "(a second signal quits at once)",
    file=sys.stderr,
    flush=True,
  )
  signal.sigwait(signals)
  exit_interrupted()


def install() -> None:
  """Routes SIGINT and SIGTERM to the watcher thread; call before any other thread starts
  (before JAX is imported), since threads inherit the blocked signal mask. Idempotent. A
  signal the process inherited as ignored (SIGINT in a background job of a script) stays
  ignored."""
  if _installed.is_set() or threading.current_thread() is not threading.main_thread():
    return
  signals = {s for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
  if not signals:
    return
  signal.pthread_sigmask(signal.SIG_BLOCK, signals)
  threading.Thread(target=_watch, args=(signals,), name="jaxformer-interrupt", daemon=True).start()
  _installed.set()
