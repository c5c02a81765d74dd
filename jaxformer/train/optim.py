"""Learning-rate schedules and the optimizer (paper section 5.3; AdamW with cosine decay)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxformer.config import OptimConfig


def rsqrt_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5) (paper eq. 3).

  The paper counts steps from 1; optax counts updates from 0, so update `count` uses
  paper step `count + 1`. The value at count 0 is therefore finite and positive:
  scale * d_model^-0.5 * warmup_steps^-1.5. Linear warmup for counts < warmup_steps,
  then inverse square-root decay. Computed from the formula at every step (float32), so
  the warmup has no interpolation error and jitted and Python values agree.
  """
  base = scale * d_model**-0.5
  slope = float(warmup_steps) ** -1.5

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return base * jnp.minimum(jax.lax.rsqrt(step), step * slope)

  return schedule


def cosine_schedule(peak: float, warmup_steps: int, decay_steps: int, min_value: float = 0.0) -> optax.Schedule:
  """Linear warmup to `peak`, then cosine decay to `min_value` at `decay_steps`, then flat.

  Update `count` (0-based) gets peak * (count + 1) / warmup_steps while count < warmup_steps
  (so the first update is not wasted at rate 0 and count warmup_steps - 1 is at the peak),
  then min_value + (peak - min_value) * (1 + cos(pi * p)) / 2 with
  p = (count - warmup_steps) / (decay_steps - warmup_steps) clipped to [0, 1].
  """

  def schedule(count):
    count = jnp.asarray(count, jnp.float32)
    warm = peak * (count + 1.0) / warmup_steps
    progress = jnp.clip((count - warmup_steps) / (decay_steps - warmup_steps), 0.0, 1.0)
    decay = min_value + 0.5 * (peak - min_value) * (1.0 + jnp.cos(jnp.pi * progress))
    return jnp.where(count < warmup_steps, warm, decay)

  return schedule


def make_schedule(config: OptimConfig, d_model: int) -> optax.Schedule:
  """The configured schedule: `rsqrt` (paper), `cosine` or `constant`."""
  if config.schedule == "rsqrt":
    return rsqrt_schedule(d_model, config.warmup_steps, config.learning_rate)
  if config.schedule == "cosine":
    return cosine_schedule(config.learning_rate, config.warmup_steps, config.decay_steps, config.min_learning_rate)
  return optax.constant_schedule(config.learning_rate)


def decay_mask(params: Any) -> Any:
  """True for the weights that get weight decay: the projection kernels; biases, norm
  scales and embedding tables get none. Decided by parameter name, so it also holds for
  `model.scan_layers` (where every leaf has an extra leading layers axis)."""

  def decays(path, leaf) -> bool:
    del leaf
    return str(getattr(path[-1], "key", path[-1])) not in _NO_DECAY

  return jax.tree_util.tree_map_with_path(decays, params)


# Parameter names of biases (FFN `bi`/`bo`/`bi_gate`, norm `bias`), norm scales and embedding tables.
_NO_DECAY = frozenset({"bias", "scale", "bi", "bo", "bi_gate", "embedding"})


def make_optimizer(config: OptimConfig, d_model: int) -> optax.GradientTransformation:
  """Adam(b1, b2, eps) with the schedule and optional global-norm clipping; `adamw` adds
  decoupled weight decay (scaled by the learning rate) on the `decay_mask` weights.

  The train state applies it to `layers.lora.trainable(params)`: all params, or with LoRA
  adapters only those, so the frozen base has no moments and clipping and decay see the adapters alone."""
  parts = []
  if config.clip_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(config.clip_grad_norm))
  parts.append(optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps))
  if config.optimizer == "adamw" and config.weight_decay > 0:
    parts.append(optax.add_decayed_weights(config.weight_decay, mask=decay_mask))
  parts.append(optax.scale_by_learning_rate(make_schedule(config, d_model)))
  return optax.chain(*parts)
