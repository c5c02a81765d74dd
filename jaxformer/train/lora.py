"""LoRA fine-tuning of a workdir trained (or imported) without adapters.

Train in that workdir with `model.lora_rank` > 0 (and `model.lora_alpha`, `model.lora_targets`):
`loop._check_resume_config` lets the `model.lora_*` keys change when the saved run has no
adapters (`model.lora_rank=0`), and the run's first restore finds a checkpoint without them.
`restore_state` then reads that checkpoint's params and step (either layer layout, any mesh)
into the frozen base, adds fresh adapters (B = 0, so the model computes exactly the base's
function at that step) and a fresh optimizer state for the adapters (its schedule counts from 0;
the step count continues from the checkpoint's). The run's own checkpoints then hold the
adapters, and later runs resume from them as usual. A run with adapters cannot go back to
full fine-tuning in the same workdir: export it (merged) and import that.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import jax

from jaxformer.checkpoint import manager as ckpt
from jaxformer.layers import lora
from jaxformer.models import layout
from jaxformer.train.state import TrainState


def saved_tree(step_dir: str | Path) -> dict | None:
  """The metadata tree of the checkpoint in `step_dir` (`<workdir>/checkpoints/<step>`); None when
  it cannot be read (a damaged step: restoring reports it)."""
  import orbax.checkpoint as ocp  # noqa: PLC0415  (only restoring needs Orbax here)

  try:
    with ocp.StandardCheckpointer() as reader:
      return dict(reader.metadata(Path(step_dir) / "default").item_metadata.tree)
  except Exception:  # whatever Orbax raises on damaged metadata; the restore itself names the damage
    return None


def saved_has_adapters(step_dir: str | Path) -> bool | None:
  """Whether the checkpoint in `step_dir` holds LoRA adapters; None when its metadata cannot be read."""
  tree = saved_tree(step_dir)
  return None if tree is None else lora.has_adapters(tree.get("params", {}))


def restore_state(checkpointer, target: TrainState, model, fresh: Callable[..., TrainState]) -> TrainState:
  """The state to resume from: `layout.restore_state(checkpointer, target, model)`; or, when
  `target` (the sharded abstract state) has adapters and the newest checkpoint has none, its
  params and step under fresh adapters and a fresh optimizer state (see the module docstring);
  or, when the newest checkpoint holds params alone (`Checkpointer.save_params`: an import, which
  so never builds an optimizer state), its params and step with a fresh optimizer state.

  Args:
    fresh: `fresh(known=params, step=step)` -> a new state holding `params` (`state.create_state`
      with the run's model, optimizer, mesh and seed bound).

  Raises:
    CheckpointError: as `Checkpointer.restore`.
  """
  tree = saved_tree(checkpointer.directory / str(max(checkpointer.all_steps())))
  new_adapters = tree is not None and lora.has_adapters(target.params) and not lora.has_adapters(tree.get("params", {}))
  if tree is None or ("opt_state" in tree and not new_adapters):
    return layout.restore_state(checkpointer, target, model)
  # A reader of its own: restoring params alone on the run's checkpointer would bind its items to
  # Orbax's PyTree handler, and the run's own saves (StandardSave) would then fail.
  reader = ckpt.Checkpointer(checkpointer.directory.parent, read_only=True)
  try:
    step, base = layout.restore_params(
      reader, lora.without_adapters(target.params) if new_adapters else target.params, model
    )
  finally:
    reader.close()
  if jax.process_index() == 0 and new_adapters:
    print(
      f"the step-{step} checkpoint has no LoRA adapters: fine-tuning it with new ones (model.lora_rank="
      f"{model.config.lora_rank}); the base params stay frozen",
      file=sys.stderr,
      flush=True,
    )
  elif jax.process_index() == 0:
    print(
      f"the step-{step} checkpoint holds params alone: training them with a fresh optimizer state",
      file=sys.stderr,
      flush=True,
    )
  return fresh(known=base, step=step)
