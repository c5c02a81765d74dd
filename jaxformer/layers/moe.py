"""Mixture-of-experts feed-forward layer (`model.num_experts` > 0): a router sends each token
to its top-k experts (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch Transformer,
Fedus et al. 2021), each expert an FFN of `layers.feed_forward`'s kind.

Routing, per row of the batch (the group is one sequence row, so it is defined by the data
and not by the device layout: losses are the same on every mesh):

  * router logits `x W_r` in float32 (ST-MoE, Zoph et al. 2022, section 3), softmax over the
    experts, the top k (`model.experts_per_token`) chosen; their gates are the chosen
    probabilities renormalised to sum 1, or for k = 1 the top probability itself (Switch), so
    the router also learns from the task loss;
  * capacity: each expert takes at most C = ceil(capacity_factor * length * k / E) tokens of a
    row (at most the row's length; capacity_factor 0 = the length: nothing is dropped). Its
    buffer fills in token order, a token's choices in rank order (position-major), so a
    token's routing depends only on the tokens before it and a causal model stays causal.
    An assignment past an expert's capacity is dropped: it adds nothing (its gate is not
    given to the token's other choices), and a token whose every choice is dropped passes
    the layer on the residual alone;
  * padding (`valid` False) is routed nowhere: it takes no capacity and does not count in
    the auxiliary losses or the load.

Dispatch and combine are one-hot einsums: tokens `[batch, length]` -> expert buffers
`[batch, experts, capacity]`. With the batch split over the data axes and the experts over
`expert` (logical axes `act_expert_batch`, `act_experts`), XLA turns the re-sharding between
them into all-to-alls.

Statistics and auxiliary losses: each call adds per-layer sums to the `AUX` collection
(`self.sow`; recorded only when the caller makes the collection mutable, see
`tasks.base.apply_model`): `router_balance`, the load-balancing loss (Switch section 2.2,
E * sum_e f_e P_e per row with f_e the row's fraction of assignments to expert e and P_e its
mean router probability, summed over rows weighted by their real tokens); `router_z`, the
router z-loss (ST-MoE eq. 5), sum over real tokens of logsumexp(logits)^2; `router_load`
`[experts]`, assignments chosen per expert (before capacity); `router_dropped`, assignments
dropped for capacity.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from jaxformer import sharding as sh
from jaxformer.layers.feed_forward import ACTIVATIONS

AUX = "aux"  # the collection of per-layer auxiliary sums (the auxiliary-loss channel)

_EXPERT_AXES = (sh.ACT_EXPERT_BATCH, sh.ACT_EXPERTS, None)  # [batch, experts, capacity, ...]


def expert_capacity(length: int, num_experts: int, k: int, factor: float) -> int:
  """Tokens one expert takes from a row of `length` tokens: ceil(factor * length * k /
  num_experts), at least 1 and at most `length` (a token picks an expert once); `factor` 0
  means `length` (no token is ever dropped)."""
  if factor == 0:
    return length
  return max(1, min(length, math.ceil(factor * length * k / num_experts)))


@struct.dataclass
class Routing:
  """Where each token goes. `dispatch` `[batch, length, experts, capacity]` is 1 where token t
  of row b sits in slot c of expert e's buffer; `combine` (same shape, float32) is its gate
  there; `stats` the per-layer sums named in the module docstring (float32)."""

  dispatch: jax.Array
  combine: jax.Array
  stats: dict


def route(logits: jax.Array, valid: jax.Array | None, k: int, capacity: int) -> Routing:
  """Top-k routing with per-row capacity (module docstring) from float32 router `logits`
  `[batch, length, experts]`; `valid` bool `[batch, length]` marks real tokens (None = all)."""
  batch, length, num_experts = logits.shape
  valid = jnp.ones((batch, length), bool) if valid is None else valid
  real = valid.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)  # [B, T, E]
  top_p, top_e = jax.lax.top_k(probs, k)  # [B, T, k]
  gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True) if k > 1 else top_p
  choice = jax.nn.one_hot(top_e, num_experts, dtype=jnp.float32) * real[..., None, None]  # [B, T, k, E]
  # Slot of each assignment in its expert's buffer: the assignments before it in (token, rank) order.
  order = choice.reshape(batch, length * k, num_experts)
  slot = (jnp.cumsum(order, axis=1) - order).reshape(choice.shape)  # [B, T, k, E]
  chosen = jnp.sum(choice, axis=2)  # [B, T, E] 0/1: a token picks e once
  token_slot = jnp.sum(slot * choice, axis=2).astype(jnp.int32)  # [B, T, E]
  kept = chosen * (token_slot < capacity)
  dispatch = jax.nn.one_hot(token_slot, capacity, dtype=jnp.float32) * kept[..., None]  # [B, T, E, C]
  gate = jnp.sum(gates[..., None] * choice, axis=2)  # [B, T, E]
  tokens = jnp.sum(real, axis=1)  # [B]
  fraction = jnp.sum(chosen, axis=1) / k  # [B, E] (times the row's tokens)
  mean_prob = jnp.sum(probs * real[..., None], axis=1) / jnp.maximum(tokens, 1.0)[:, None]
  stats = {
    "router_balance": num_experts * jnp.sum(fraction * mean_prob),
    "router_z": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * real),
    "router_load": jnp.sum(chosen, axis=(0, 1)),
    "router_dropped": jnp.sum(chosen - kept),
  }
  return Routing(dispatch, dispatch * gate[..., None], stats)


class MixtureOfExperts(nn.Module):
  """`[batch, length, d_model]` -> same: the routed sum of `num_experts` FFNs (module docstring).

  Params: `router` `[d_model, experts]`; per expert, the FFN's kernels and biases with a
  leading `[experts]` axis (`wi`, `wi_gate` for gated activations, `wo`, `bi`, `bo`; logical
  axes `experts, embed, mlp`: experts over `expert`, d_ff over `tensor`).

  Raises:
    ValueError: an unknown activation.
  """

  num_experts: int
  experts_per_token: int
  d_ff: int
  capacity_factor: float = 1.25
  dtype: jnp.dtype = jnp.float32
  activation: str = "relu"

  def _expert_in(self, name: str, x: jax.Array) -> jax.Array:
    e, d = self.num_experts, x.shape[-1]
    init = nn.initializers.xavier_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))
    w = sh.param(self, name, init, (sh.EXPERTS, sh.EMBED, sh.MLP), (e, d, self.d_ff))
    b = sh.param(self, name.replace("wi", "bi"), nn.initializers.zeros, (sh.EXPERTS, sh.MLP), (e, self.d_ff))
    return jnp.einsum("becd,edf->becf", x, w.astype(self.dtype)) + b.astype(self.dtype)[None, :, None]

  @nn.compact
  def __call__(self, x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """`x` `[batch, length, d_model]`, `valid` bool `[batch, length]` (None = all real) ->
    `[batch, length, d_model]`; sows the routing statistics into `AUX`."""
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"unknown activation {self.activation!r}; use one of {', '.join(ACTIVATIONS)}")
    act, gated = ACTIVATIONS[self.activation]
    batch, length, d_model = x.shape
    router = sh.param(self, "router", nn.initializers.xavier_uniform(), (sh.EMBED, None), (d_model, self.num_experts))
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), router)
    capacity = expert_capacity(length, self.num_experts, self.experts_per_token, self.capacity_factor)
    routing = route(logits, valid, self.experts_per_token, capacity)
    for name, value in routing.stats.items():
      self.sow(AUX, name, value, init_fn=lambda: 0.0, reduce_fn=jnp.add)
    x = x.astype(self.dtype)
    xe = jnp.einsum("btec,btd->becd", routing.dispatch.astype(self.dtype), x)  # [B, E, C, D]
    xe = sh.constrain(xe, (*_EXPERT_AXES, sh.ACT_EMBED))
    h = self._expert_in("wi", xe)
    h = act(self._expert_in("wi_gate", xe)) * h if gated else act(h)
    h = sh.constrain(h, (*_EXPERT_AXES, sh.ACT_MLP))  # [B, E, C, F]
    init = nn.initializers.xavier_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))
    wo = sh.param(self, "wo", init, (sh.EXPERTS, sh.MLP, sh.EMBED), (self.num_experts, self.d_ff, d_model))
    bo = sh.param(self, "bo", nn.initializers.zeros, (sh.EXPERTS, sh.EMBED), (self.num_experts, d_model))
    ye = jnp.einsum("becf,efd->becd", h, wo.astype(self.dtype)) + bo.astype(self.dtype)[None, :, None]
    ye = sh.constrain(ye, (*_EXPERT_AXES, sh.ACT_EMBED))
    y = jnp.einsum("btec,becd->btd", routing.combine.astype(self.dtype), ye)
    return sh.constrain(y, (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_EMBED))
