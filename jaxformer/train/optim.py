"""Learning-rate schedules and the optimizer (paper section 5.3)."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from jaxformer.config import OptimConfig


def rsqrt_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5) (paper eq. 3).

  The paper counts steps from 1; optax counts updates from 0, so update `count` uses
  paper step `count + 1`. The value at count 0 is therefore finite and positive:
  scale * d_model^-0.5 * warmup_steps^-1.5. Linear warmup for counts < warmup_steps,
  then inverse square-root decay.
  """
  peak = scale * d_model ** -0.5 * warmup_steps ** -0.5
  warmup = optax.linear_schedule(
      init_value=peak / warmup_steps, end_value=peak, transition_steps=max(warmup_steps - 1, 1))

  def decay(count):  # count is relative to the boundary: paper step = count + warmup_steps
    return scale * d_model ** -0.5 * jnp.asarray(count + warmup_steps, jnp.float32) ** -0.5

  if warmup_steps == 1:
    return lambda count: decay(count)
  return optax.join_schedules([warmup, decay], boundaries=[warmup_steps - 1])


def make_schedule(config: OptimConfig, d_model: int) -> optax.Schedule:
  """The configured schedule: `rsqrt` (paper) or `constant`."""
  if config.schedule == "rsqrt":
    return rsqrt_schedule(d_model, config.warmup_steps, config.learning_rate)
  return optax.constant_schedule(config.learning_rate)


def make_optimizer(config: OptimConfig, d_model: int) -> optax.GradientTransformation:
  """Adam(b1, b2, eps) with the schedule; optional global-norm clipping and weight decay."""
  parts = []
  if config.clip_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(config.clip_grad_norm))
  parts.append(optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps))
  if config.weight_decay > 0:
    parts.append(optax.add_decayed_weights(config.weight_decay))
  parts.append(optax.scale_by_learning_rate(make_schedule(config, d_model)))
  return optax.chain(*parts)
