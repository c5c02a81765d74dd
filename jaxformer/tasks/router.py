"""The mixture of experts' router terms (`layers/moe.py`) in the train step's loss and metric
sums, and in the training log.

The auxiliary losses are sums over real tokens (the load-balancing loss weighted by each
row's real tokens), so, like the cross-entropy, they add up exactly across devices,
microbatches and processes; the step adds them, weighted by `model.router_aux_loss` and
`model.router_z_loss`, to the loss sum, which is divided by the real target tokens. For a
causal LM the router terms are therefore their per-token means, summed over the layers (as
Switch and ST-MoE sum them); where the targets are a subset of the routed tokens (the masked
LM's 15%, or translation, whose encoder routes the source too) they weigh proportionally more.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import ModelConfig


def add_router_sums(sums: dict[str, jax.Array], aux: dict[str, jax.Array], config: ModelConfig) -> dict[str, jax.Array]:
  """`sums` (`losses.cross_entropy_sums`) with the router's weighted losses added to `loss`
  and its statistics as new sums: `router_balance`, `router_z` (unweighted, summed over
  layers), `router_dropped` (dropped assignments) and `router_load` `[layers, experts]`
  (assignments per expert); `sums` itself when `aux` (`tasks.base.Outputs.aux`) has no router."""
  if "router_load" not in aux:
    return sums
  balance, z = jnp.sum(aux["router_balance"]), jnp.sum(aux["router_z"])
  return dict(
    sums,
    loss=sums["loss"] + config.router_aux_loss * balance + config.router_z_loss * z,
    router_balance=balance,
    router_z=z,
    router_dropped=jnp.sum(aux["router_dropped"]),
    router_load=aux["router_load"],
  )


def summarise_router(history: list[dict[str, Any]], num_tokens: float) -> dict[str, Any]:
  """The log's router fields over the host metrics of some steps (`add_router_sums`' sums),
  {} without a router: `router_balance_loss`, `router_z_loss` (per target token, summed over
  layers, unweighted), `router_dropped` (the fraction of assignments dropped for capacity),
  `router_load` (per layer, the fraction of assignments each expert was chosen for) and
  `router_max_load` (per layer, the largest of those times the number of experts: 1 is a
  perfect balance, E all tokens on one expert)."""
  if not history or "router_load" not in history[0]:
    return {}
  load = sum(np.asarray(m["router_load"], np.float64) for m in history)  # [layers, experts]
  fractions = load / np.maximum(load.sum(axis=-1, keepdims=True), 1.0)
  n = max(num_tokens, 1.0)
  return {
    "router_balance_loss": sum(float(m["router_balance"]) for m in history) / n,
    "router_z_loss": sum(float(m["router_z"]) for m in history) / n,
    "router_dropped": sum(float(m["router_dropped"]) for m in history) / max(float(load.sum()), 1.0),
    "router_load": np.round(fractions, 4).tolist(),
    "router_max_load": np.round(fractions.max(axis=-1) * load.shape[-1], 4).tolist(),
  }
