"""Orbax checkpoints of the train state: save every k steps, keep the last n, async;
restore straight into the shardings of whatever mesh the restoring run uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxformer.errors import CheckpointError
from jaxformer.train.state import TrainState


class Checkpointer:
  """Thin wrapper over `ocp.CheckpointManager` rooted at `<workdir>/checkpoints`.

  Orbax writes each step into a temporary directory and renames it only once every
  array is on disk, so an interrupted save is never listed or restored.
  """

  def __init__(self, workdir: str | Path, save_every: int = 1000, keep: int = 3, async_save: bool = True):
    self.directory = Path(workdir).absolute() / "checkpoints"
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_every, max_to_keep=keep, enable_async_checkpointing=async_save,
        create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, state: TrainState, force: bool = False) -> bool:
    """Saves at `state.step` if the interval says so (or `force`); returns whether it saved."""
    step = int(jax.device_get(state.step))
    return self._manager.save(step, args=ocp.args.StandardSave(state), force=force)

  def restore(self, target: TrainState, step: int | None = None) -> TrainState:
    """Restores `step` (default: latest) into `target`, a tree of `jax.ShapeDtypeStruct`s
    carrying the shardings the arrays should land in.

    Raises:
      CheckpointError: there is no checkpoint, or not the requested step.
    """
    return self._manager.restore(self._pick_step(step), args=ocp.args.StandardRestore(target))

  def _pick_step(self, step: int | None) -> int:
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory}; run `jaxformer train --workdir ...` first")
    if step is None:
      return max(steps)
    if step not in steps:
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available: {sorted(steps)}")
    return step

  def restore_params(self, target_params: Any, step: int | None = None) -> tuple[int, Any]:
    """Restores only `step` and `params` (not the optimizer state, about 2/3 of the bytes
    for Adam) into `target_params`, a tree like `target` of `restore`'s params.

    Returns:
      (step, params).
    Raises:
      CheckpointError: as `restore`.
    """
    step = self._pick_step(step)
    target = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": target_params}
    restored = self._manager.restore(step, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    return int(restored["step"]), restored["params"]

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def sharded_target(abstract: Any, shardings: Any) -> Any:
  """Pairs each abstract leaf with its sharding, the form `Checkpointer.restore` expects."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.model"
SOURCE_TOKENIZER_FILE = "source_tokenizer.model"   # only with separate source/target vocabularies


def _write_atomic(path: Path, data: bytes) -> None:
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_bytes(data)
  tmp.replace(path)


def save_run_files(workdir: str | Path, config_yaml: str, tokenizer_bytes: bytes,
                   source_tokenizer_bytes: bytes | None = None) -> None:
  """Writes the resolved config and the tokenizer model (the target's, and the source's
  when the vocabularies are separate) next to the checkpoints, so `eval`/`translate` need
  only the workdir. Each file is replaced atomically."""
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  _write_atomic(workdir / CONFIG_FILE, config_yaml.encode())
  _write_atomic(workdir / TOKENIZER_FILE, tokenizer_bytes)
  if source_tokenizer_bytes is not None:
    _write_atomic(workdir / SOURCE_TOKENIZER_FILE, source_tokenizer_bytes)


def load_vocabulary(workdir: str | Path):
  """The workdir's `data.Vocabulary` (`tokenizer.model`, and `source_tokenizer.model` when the
  vocabularies are separate), or None before the first run has written it."""
  from jaxformer.data import Vocabulary, tokenizer_from_bytes  # noqa: PLC0415
  workdir = Path(workdir)
  if not (workdir / TOKENIZER_FILE).is_file():
    return None
  target = tokenizer_from_bytes((workdir / TOKENIZER_FILE).read_bytes())
  source_file = workdir / SOURCE_TOKENIZER_FILE
  return Vocabulary(tokenizer_from_bytes(source_file.read_bytes()) if source_file.is_file() else target, target)


def run_file(workdir: str | Path, name: str) -> Path:
  """Path of a run file in `workdir`.

  Raises:
    CheckpointError: the file does not exist (not a training workdir).
  """
  path = Path(workdir) / name
  if not path.is_file():
    raise CheckpointError(
        f"{path} is missing: {workdir} is not a jaxformer workdir; pass the --workdir of a `jaxformer train` run")
  return path
