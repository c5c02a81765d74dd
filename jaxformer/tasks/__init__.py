"""The task registry: `model.kind` -> the task that trains and evaluates it.

Adding a model kind is one new module with a `Task` subclass (`tasks/base.py`) and one line here.
"""

from __future__ import annotations

import importlib

TASKS = {
  "encoder_decoder": "jaxformer.tasks.translation:Translation",
  "decoder_only": "jaxformer.tasks.causal_lm:CausalLM",
  "encoder_only": "jaxformer.tasks.masked_lm:MaskedLM",
}


def task_class(kind: str):
  """The `Task` subclass of model kind `kind` (its class attributes answer questions about the kind)."""
  module, cls = TASKS[kind].split(":")
  return getattr(importlib.import_module(module), cls)


def get_task(config):
  """The task of `config.model.kind`, bound to `config`."""
  return task_class(config.model.kind)(config)


__all__ = ["TASKS", "get_task", "task_class"]
