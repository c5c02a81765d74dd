"""Label-smoothed cross-entropy over non-padding tokens (paper section 5.4), with an
optional z-loss (PaLM, Chowdhery et al. 2022, section 5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def logit_statistics(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, ...]:
  """Per-token statistics of float32 `logits` `[..., vocab]` that the losses need:
  (log Z = logsumexp, the target's logit, the mean logit, the max logit), each `[...]`.

  One custom gradient for all of them: d log Z = softmax, d target logit = one-hot,
  d mean = 1/vocab (the max is not differentiated), computed in a single elementwise pass
  over `[..., vocab]` with the one-hot from an iota comparison. Autodiff of the unfused
  form materialises log-probabilities and scatter-adds the gathered target, several passes
  over the largest activation of the step.
  """
  return _logit_statistics_fwd(logits, targets)[0]


def _logit_statistics_fwd(logits, targets):
  max_logits = jnp.max(logits, axis=-1)
  log_z = max_logits + jnp.log(jnp.sum(jnp.exp(logits - max_logits[..., None]), axis=-1))
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return (log_z, target_logits, jnp.mean(logits, axis=-1), max_logits), (logits, targets, log_z)


def _logit_statistics_bwd(residuals, cotangents):
  logits, targets, log_z = residuals
  d_log_z, d_target, d_mean, _ = cotangents
  one_hot = jnp.arange(logits.shape[-1]) == targets[..., None]
  d_logits = (
    d_log_z[..., None] * jnp.exp(logits - log_z[..., None])
    + jnp.where(one_hot, d_target[..., None], 0.0)
    + d_mean[..., None] / logits.shape[-1]
  )
  return d_logits, None


logit_statistics.defvjp(_logit_statistics_fwd, _logit_statistics_bwd)


def cross_entropy_sums(
  logits: jax.Array, targets: jax.Array, weights: jax.Array, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> dict[str, jax.Array]:
  """Summed losses, to be divided by `num_tokens` after summing over batches and devices.

  The smoothed target puts 1 - label_smoothing on the true token and spreads
  label_smoothing uniformly over all `vocab_size` tokens. The z-loss adds
  z_loss * log(Z)^2 per token, Z = sum(exp(logits)), pulling log Z towards 0 so the
  softmax normaliser stays stable.

  Args:
    logits: float `[batch, length, vocab_size]` (computed in float32 here).
    targets: int `[batch, length]` token ids.
    weights: float `[batch, length]`, 1 for real tokens and 0 for padding.
    label_smoothing: epsilon in [0, 1).
    z_loss: weight of log(Z)^2 (>= 0; 0 = off).

  Returns:
    float32 scalars: `loss` (smoothed cross-entropy plus z-loss sum, nats), `nll` (unsmoothed
    negative log-likelihood sum, nats), `correct` (argmax hits), `num_tokens`.
  """
  log_z, target_logits, mean_logits, max_logits = logit_statistics(logits.astype(jnp.float32), targets)
  nll = log_z - target_logits  # -log p(target), [B, T]
  smooth = log_z - mean_logits  # -mean_v log p(v), [B, T]
  loss = (1.0 - label_smoothing) * nll + label_smoothing * smooth + z_loss * jnp.square(log_z)
  # Hit: the target's logit is the largest (ties count as hits); no separate argmax pass.
  correct = (target_logits >= max_logits).astype(jnp.float32)
  return {
    "loss": jnp.sum(loss * weights),
    "nll": jnp.sum(nll * weights),
    "correct": jnp.sum(correct * weights),
    "num_tokens": jnp.sum(weights),
  }
