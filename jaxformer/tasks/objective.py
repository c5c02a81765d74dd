"""A task's objective and the eval step that sums it.

`loss_fn` is the loss of a batch: the label-smoothed cross-entropy of the task's outputs over
real target tokens plus a mixture of experts' router terms; the train step differentiates it,
`make_eval_step` jits its metric sums with dropout off, and `evaluate_loss` adds those sums
over validation batches (`train`'s validation and `eval`'s teacher-forced loss).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.config import Config
from jaxformer.data import global_batch
from jaxformer.models.pipeline import pipelined
from jaxformer.tasks import get_task
from jaxformer.tasks.base import Task
from jaxformer.tasks.losses import cross_entropy_sums
from jaxformer.tasks.router import add_router_sums

Batch = dict[str, jax.Array]


def loss_fn(
  task: Task, model: nn.Module, params, batch: Batch, rng: jax.Array | None, label_smoothing: float, z_loss: float = 0.0
):
  """(float32 loss per real target token, metric sums) of `task`'s `model` on `batch`.

  `batch` holds int32 `inputs` and `targets` `[batch, length]` (0 is padding; what they
  mean depends on the task, see `jaxformer/tasks/`) and, when packed, segment ids and
  positions; `rng` is the step's key (dropout,
  MLM masks), None for evaluation. The sums are those of `cross_entropy_sums` (with
  `z_loss`) plus, for a mixture of experts, the router's (`router.add_router_sums`: its
  weighted auxiliary losses are part of `loss`); the loss is computed in float32 whatever the
  compute dtype.
  """
  out = task.outputs(model, params, batch, rng)
  with jax.named_scope("loss"):  # names the ops in profiles and HLO dumps (benchmarks/profile_train_step.py)
    sums = add_router_sums(
      cross_entropy_sums(out.logits, out.targets, out.weights, label_smoothing, z_loss), out.aux, model.config
    )
  # Normalise by the global count of real target tokens (section 5.4 loss per token).
  return sums["loss"] / jnp.maximum(sums["num_tokens"], 1.0), sums


def make_eval_step(model: nn.Module, config: Config, mesh: Mesh, param_shardings) -> Callable[[object, Batch], dict]:
  """Returns jitted `(params, batch) -> metric sums` with dropout off (validation loss)."""
  label_smoothing, z_loss = config.optim.label_smoothing, config.train.z_loss
  task = get_task(config)
  model = pipelined(model, config, mesh)

  def step(params, batch: Batch):
    return loss_fn(task, model, params, batch, None, label_smoothing, z_loss)[1]

  rules = sh.rules_for(config.mesh)
  jitted = jax.jit(
    step, in_shardings=(param_shardings, sh.batch_sharding(mesh, rules=rules)), out_shardings=sh.replicated(mesh)
  )
  return sh.with_mesh(jitted, mesh, rules)


def evaluate_loss(eval_step, params, batches, mesh, rules: sh.Rules = sh.LOGICAL_RULES) -> dict[str, float]:
  """Token-averaged validation loss, NLL and accuracy over `batches` (dropout off), placed on
  `mesh` by `rules` (those `eval_step` was built with)."""
  totals: dict[str, float] = {}
  for batch in batches:
    sums = jax.device_get(eval_step(params, global_batch(batch, mesh, rules)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)  # (the router's load is per layer)
  n = max(totals["num_tokens"], 1.0)
  return {
    "loss": float(totals["loss"] / n),
    "nll": float(totals["nll"] / n),
    "accuracy": float(totals["correct"] / n),
    "num_tokens": float(totals["num_tokens"]),
  }
