"""Rematerialisation (gradient checkpointing) of Transformer blocks by named policy.

Each block is wrapped once in `nn.remat`; its policy decides which intermediates the
forward pass keeps for the backward pass, the rest are recomputed from the block input:

  none       no remat: keep everything (fastest, most memory).
  full       keep only each block's input; recompute the whole block.
  save_dots  keep every matmul output (`jax.checkpoint_policies.dots_saveable`);
             recompute the cheap elementwise work (LayerNorm, ReLU, softmax, dropout).
  minimal    keep only the tagged attention projections q, k, v and the attention
             output (per head, before the output projection); recompute the FFN.

Layers tag those activations with `jax.ad_checkpoint.checkpoint_name` and the constants
below. Dropout inside a remat block draws from the same RNG in the recomputation as in the
forward pass, so the masks (and so the gradients) are identical to no remat.
"""

from __future__ import annotations

from typing import Any

# checkpoint_name tags (jaxformer/layers/attention.py).
QUERY = "query_proj"  # q `[batch, q_len, num_heads, head_dim]`
KEY = "key_proj"  # k `[batch, kv_len, num_heads, head_dim]`
VALUE = "value_proj"  # v `[batch, kv_len, num_heads, head_dim]`
ATTENTION_OUT = "attention_out"  # softmax(q k^T / sqrt(head_dim)) v, `[batch, q_len, num_heads, head_dim]`

POLICY_NAMES = ("none", "full", "save_dots", "minimal")


def _policy(name: str) -> Any:
  """The `jax.checkpoint` policy of a name (JAX is imported here, not with the module, so a
  config naming a policy is checked without it)."""
  import jax  # noqa: PLC0415

  policies = jax.checkpoint_policies
  return {
    "full": policies.nothing_saveable,
    "save_dots": policies.dots_saveable,
    "minimal": policies.save_only_these_names(QUERY, KEY, VALUE, ATTENTION_OUT),
  }[name]


def remat_block(block: Any, policy: str, static_argnums: tuple[int, ...], prevent_cse: bool = True) -> Any:
  """`block` wrapped in `nn.remat` with the named policy (`block` itself for "none").

  Args:
    block: a linen Module class whose `__call__` is the whole block.
    policy: one of `POLICY_NAMES`.
    static_argnums: positions of the non-array call arguments (`deterministic`,
      `decode`), counting `self` as 0.
    prevent_cse: keep XLA from merging the recomputation with the forward pass; may be
      False inside `nn.scan`, whose loop already prevents it.

  Raises:
    ValueError: unknown policy name (configs are checked earlier by `ModelConfig.validate`).
  """
  if policy not in POLICY_NAMES:
    raise ValueError(f"unknown remat policy {policy!r}; use one of {', '.join(POLICY_NAMES)}")
  if policy == "none":
    return block
  import flax.linen as nn  # noqa: PLC0415

  return nn.remat(block, policy=_policy(policy), static_argnums=static_argnums, prevent_cse=prevent_cse)
