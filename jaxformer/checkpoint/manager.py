"""Orbax checkpoints of the train state: save every k steps, keep the last n, async;
restore straight into the shardings of whatever mesh the restoring run uses.

Damaged checkpoints. A step directory is intact when it has Orbax's commit marker
(`commit_success.txt`, written just before the rename that publishes a step), a `default/`
item whose `_METADATA` is valid JSON, and every array asked for reads back. Restoring without
an explicit step takes the newest intact step; each newer damaged one is reported in one
stderr line naming the step and what is wrong. An explicit step that is damaged is a
`CheckpointError`, with no fallback. A read error that is not damage (a state that does not
fit the checkpoint, a permission error) is a `CheckpointError` too, and nothing is set aside.

Deletion rule: damaged steps are never deleted. A reader (`eval`, `translate`, `generate`)
only skips them. The writer (`train`, holding the workdir lock) moves each damaged step it
skipped to `<workdir>/damaged_checkpoints/<step>` for the user to inspect, so Orbax's
keep-the-last-n garbage collection never counts them. Orbax deletes old steps only after a
newer save has committed (TensorStore has written and synced every file, then Orbax writes the
commit marker and renames): a step is deleted only once n newer steps were committed by saves
that reported no error, and a failed save deletes nothing. So a run that falls back to an older
step keeps it until n new steps are written. While damaged steps are set aside and no intact
step is left, `train` refuses to start over (remove `damaged_checkpoints/` to start from
scratch). Orbax's temporary directories (`<step>.orbax-checkpoint-tmp*`, a save that never
finished) are never restored: a failed save removes its own, and Orbax replaces a leftover one
when it saves that step again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxformer.errors import CheckpointError
from jaxformer.runtime.distributed import any_process

if TYPE_CHECKING:  # the train package imports this one
  from jaxformer.train.state import TrainState

DAMAGED_DIR = "damaged_checkpoints"  # next to `checkpoints/`: the damaged steps a training run set aside
COMMIT_MARKER = "commit_success.txt"
# TensorStore status codes of an array that cannot be read because its files are damaged.
_DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION")


class Checkpointer:
  """Thin wrapper over `ocp.CheckpointManager` rooted at `<workdir>/checkpoints`.

  Orbax writes each step into a temporary directory and renames it only once every
  array is on disk, so an interrupted save is never listed or restored. A `read_only`
  checkpointer (eval, translate, generate) writes nothing: it creates no directory and sets
  no damaged step aside.

  Asynchronous saves: `save` returns once the arrays are copied to host memory and they are
  written in the background while training goes on, so under load the newest checkpoint on
  disk can lag the saved step by a step or more. The lag is bounded: each save first waits
  for the previous one (one save in flight at most), and `close` waits for all; so a kill
  loses at most `save_every` steps plus those run while one save writes. A failed write (full
  disk, read-only workdir) raises `CheckpointError` from the next `check`, `save` or `close`,
  naming the step, and its temporary directory is removed.
  """

  def __init__(
    self, workdir: str | Path, save_every: int = 1000, keep: int = 3, async_save: bool = True, read_only: bool = False
  ):
    self.directory = Path(workdir).absolute() / "checkpoints"
    self.damaged_directory = self.directory.with_name(DAMAGED_DIR)
    self._read_only = read_only
    _mute_orbax_noise()
    # Step directories are made before `save` returns: a failure there raises at once (made in
    # the background, it would leave Orbax's other writer threads waiting for them until exit).
    options = ocp.CheckpointManagerOptions(
      save_interval_steps=save_every,
      max_to_keep=keep,
      enable_async_checkpointing=async_save,
      create=not read_only,
      read_only=read_only,
      async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._saving: int | None = None  # the step whose save may still be writing
    self._failed = False  # a failed save was reported

  def latest_step(self) -> int | None:
    """The newest step directory (`restore` falls back if it is damaged); None for a fresh run.

    Raises:
      CheckpointError: (writer only) no step is left but damaged ones were set aside:
        starting over would silently abandon them.
    """
    steps = self.all_steps()
    if not steps and not self._read_only and self.damaged_directory.is_dir() and any(self.damaged_directory.iterdir()):
      raise CheckpointError(
        f"no intact checkpoint in {self.directory}; the damaged ones are in {self.damaged_directory}: "
        "remove that folder to train from scratch, or pass another --workdir"
      )
    return max(steps, default=None)

  def all_steps(self) -> list[int]:
    """Every step directory, oldest first, damaged ones included."""
    return sorted(self._manager.all_steps())

  def save(self, state: TrainState, force: bool = False) -> bool:
    """Saves at `state.step` if the interval says so (or `force`); returns whether it saved.
    Waits for the previous save first.

    Raises:
      CheckpointError: this save or the previous one failed (full disk, read-only workdir).
    """
    step = int(jax.device_get(state.step))
    self._wait()
    try:
      saved = self._manager.save(step, args=ocp.args.StandardSave(state), force=force)
    except Exception as e:  # whatever Orbax or TensorStore raise: one line naming the step and the cause
      raise self._save_failed(step, e) from e
    if saved:
      self._saving = step
    return saved

  def check(self) -> None:
    """Returns at once while a save is still writing or all went well.

    Raises:
      CheckpointError: the last save failed in the background.
    """
    if self._saving is not None and not self._manager.is_saving_in_progress():
      self._wait()

  def _wait(self) -> None:
    step, self._saving = self._saving, None
    if step is None:
      return
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # raised by the background write
      raise self._save_failed(step, e) from e

  def _save_failed(self, step: int, error: BaseException) -> CheckpointError:
    """Removes the unfinished save of `step` and describes its failure in one line."""
    self._failed = True
    if jax.process_index() == 0:
      for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
        shutil.rmtree(tmp, ignore_errors=True)
    return CheckpointError(
      f"saving the step-{step} checkpoint in {self.directory} failed ({_cause(error)}); training stopped: "
      "free disk space or make the workdir writable, then rerun to resume from the last checkpoint"
    )

  def save_params(self, step: int, params: Any) -> None:
    """Saves `{"step", "params"}` only (no optimizer state) at `step`: what `restore_params`
    reads, for derived checkpoints (averaged, best) that are evaluated but not trained on."""
    tree = {"step": jnp.asarray(step, jnp.int32), "params": params}
    self._manager.save(step, args=ocp.args.StandardSave(tree), force=True)

  def restore(self, target: TrainState, step: int | None = None) -> TrainState:
    """Restores `step` (default: the newest intact step, see the module docstring) into
    `target`, a tree of `jax.ShapeDtypeStruct`s carrying the shardings the arrays should land in.

    Raises:
      CheckpointError: there is no checkpoint, not the requested step, the requested step is
        damaged, no step is intact, or the checkpoint does not fit `target`.
    """
    return self._restore(step, lambda s: self._manager.restore(s, args=ocp.args.StandardRestore(target)))

  def restore_params(self, target_params: Any, step: int | None = None) -> tuple[int, Any]:
    """Restores only `step` and `params` (not the optimizer state, about 2/3 of the bytes
    for Adam) into `target_params`, a tree like `target` of `restore`'s params.

    Returns:
      (step, params).

    Raises:
      CheckpointError: as `restore`.
    """
    target = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": target_params}
    args = ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    restored = self._restore(step, lambda s: self._manager.restore(s, args=args))
    return int(restored["step"]), restored["params"]

  def _restore(self, step: int | None, read: Callable[[int], Any]) -> Any:
    """`read(step)`, or `read` of the newest intact step (reporting the damaged newer ones)."""
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory}; run `jaxformer train --workdir ...` first")
    if step is not None:
      if step not in steps:
        raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available: {steps}")
      result, problem = self._try(step, read)
      if problem is not None:
        raise CheckpointError(
          f"checkpoint step {step} in {self.directory} is damaged ({problem}); "
          f"pass another --step (steps: {steps}), or none for the newest intact one"
        )
      return result
    for candidate in reversed(steps):
      result, problem = self._try(candidate, read)
      if problem is None:
        self._manager.reload()  # forget the steps set aside, so garbage collection never counts them
        return result
      self._set_aside(candidate, problem)
    raise CheckpointError(
      f"no intact checkpoint in {self.directory} (steps {steps} are damaged); "
      "train into a new --workdir, or remove the damaged steps to start from scratch"
    )

  def _try(self, step: int, read: Callable[[int], Any]) -> tuple[Any, str | None]:
    """(`read(step)`, None), or (None, what is wrong) when the step is damaged on any process
    (each reads its own shards; they agree before falling back). A read error that is not
    damage raises at once."""
    result, problem = None, _structure_damage(self.directory / str(step))
    if problem is None:
      try:
        result = read(step)
      except Exception as e:  # Orbax wraps TensorStore's errors in several layers: classify the cause
        problem = _cause(e)
        if not problem.startswith(_DAMAGE_CODES):
          raise CheckpointError(f"cannot restore checkpoint step {step} in {self.directory}: {problem}") from e
    if any_process(problem is not None) and problem is None:
      problem = "another process could not read it"
    return result, problem

  def _set_aside(self, step: int, problem: str) -> None:
    """Reports the damaged `step` in one line; a writer moves it to `damaged_directory`."""
    if jax.process_index() != 0:
      return
    action = "skipping it"
    if not self._read_only:
      self.damaged_directory.mkdir(exist_ok=True)
      dest = self.damaged_directory / str(step)
      n = 0
      while dest.exists():
        n += 1
        dest = self.damaged_directory / f"{step}.{n}"
      (self.directory / str(step)).rename(dest)
      action = f"moved it to {dest}"
    print(f"checkpoint step {step} in {self.directory} is damaged ({problem}); {action}", file=sys.stderr, flush=True)

  def close(self) -> None:
    """Waits for the save in flight and releases Orbax's threads.

    Raises:
      CheckpointError: that save failed.
    """
    try:
      self._wait()
    finally:
      if self._failed:
        with contextlib.suppress(Exception):  # Orbax raises the failure reported above again
          self._manager.close()
      else:
        self._manager.close()


HOST_DATA_FILE_BYTES = 64 << 20  # the OCDBT data files `save_host_params` writes


def save_host_params(workdir: str | Path, step: int, params: Any, data_file_bytes: int = HOST_DATA_FILE_BYTES) -> None:
  """Writes what `Checkpointer(workdir, async_save=False).save_params(step, params)` writes (read by
  `restore_params`) for params held as host numpy arrays (an import), in less memory. Orbax's
  numpy handler copies every host array before writing it (a guard against the caller changing
  them during an asynchronous save; this one is synchronous), and TensorStore holds each OCDBT
  data file in memory until it is written, 2 GiB by default: here `data_file_bytes`. Together
  those held 1.3 times a 1.2B-parameter model's float32 params on top of them; here about 0.1
  (benchmarks/results/2026-12-03-import-memory.md)."""
  _mute_orbax_noise()
  types = ocp.type_handlers.create_type_handler_registry(
    (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
    (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)),
  )
  handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
  handlers.add("default", ocp.args.PyTreeSave, ocp.PyTreeCheckpointHandler(type_handler_registry=types))
  options = ocp.CheckpointManagerOptions(
    enable_async_checkpointing=False,
    create=True,
    async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
  )
  manager = ocp.CheckpointManager(Path(workdir).absolute() / "checkpoints", options=options, handler_registry=handlers)
  try:
    tree = {"step": jnp.asarray(step, jnp.int32), "params": params}
    manager.save(step, args=ocp.args.PyTreeSave(tree, ocdbt_target_data_file_size=data_file_bytes), force=True)
    manager.wait_until_finished()
  finally:
    manager.close()


def _structure_damage(step_dir: Path) -> str | None:
  """What is wrong with the files of `step_dir` that Orbax would not say clearly, or None."""
  if not (step_dir / COMMIT_MARKER).is_file():
    return f"no commit marker {COMMIT_MARKER}: a save that never finished"
  if not (step_dir / "default").is_dir():
    return "its default/ folder is missing"
  try:
    json.loads((step_dir / "default" / "_METADATA").read_bytes())
  except FileNotFoundError:
    return "default/_METADATA is missing"
  except ValueError:  # JSONDecodeError, UnicodeDecodeError
    return "default/_METADATA is not valid JSON"
  return None


def _cause(error: BaseException) -> str:
  """The first line of the innermost cause of `error`, without TensorStore's driver chain,
  database path and `[key=value]` annotations."""
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  if isinstance(error, OSError) and error.strerror:
    return f"{error.strerror}: {error.filename}" if error.filename else error.strerror
  text = (str(error).strip().splitlines() or [type(error).__name__])[0]
  return re.sub(
    r'Error opening "\w+" driver: | in OCDBT database at local file "[^"]*"| \[[\w ]+(\[\d+\])?=.*', "", text
  )[:400]


def _mute_orbax_noise() -> None:
  """Mutes what Orbax and TensorStore print on their own, since the checkpointer reports every
  problem in one line instead (installed once per process).

  * Orbax's log lines (a failed background save logs the same error five times, with tracebacks);
  * after a failed restore, the reads Orbax abandoned: TensorStore still finishes them, their
    callbacks meet a closed event loop, and Python and asyncio report the errors of the
    coroutines left behind, dozens of tracebacks. Exactly those are dropped: a closed event
    loop, a TensorStore damage code at the root, or GeneratorExit (a coroutine still waiting
    on a read, closed at exit), and "coroutine ... was never awaited" warnings.
  """
  if getattr(sys.unraisablehook, "mutes_orbax_noise", False):
    return
  logging.getLogger("absl").addFilter(lambda record: f"{os.sep}orbax{os.sep}" not in record.pathname)
  previous = sys.unraisablehook

  def abandoned(error: BaseException | None, codes=_DAMAGE_CODES) -> bool:
    # Self-contained: some of these arrive at interpreter exit, after module globals are cleared.
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
      return True
    while error is not None and (error.__cause__ is not None or error.__context__ is not None):
      error = error.__cause__ or error.__context__
    return isinstance(error, GeneratorExit) or (error is not None and str(error).startswith(codes))

  def hook(unraisable):
    if not abandoned(unraisable.exc_value):
      previous(unraisable)

  hook.mutes_orbax_noise = True
  sys.unraisablehook = hook
  warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
  logging.getLogger("asyncio").addFilter(lambda record: not (record.exc_info and abandoned(record.exc_info[1])))


def sharded_target(abstract: Any, shardings: Any) -> Any:
  """Pairs each abstract leaf with its sharding, the form `Checkpointer.restore` expects."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
