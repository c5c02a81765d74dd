"""Autoregressive decoding with a KV cache: one prefill, then one token per step inside
`jax.lax.while_loop`, all jitted.

The encoder runs once per source batch; cross-attention keys/values are projected once
at prefill and cached; each step feeds only the newest token at its absolute position.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.models.transformer import BOS_ID, PAD_ID

EOS_ID = 3


def _prefill(module: nn.Module, inputs: jax.Array, bos: jax.Array):
  encoded = module.encode(inputs)
  return module.decode(encoded, inputs, bos, decode=True)


def init_cache(model: nn.Module, batch_size: int, src_len: int) -> Any:
  """A zeroed KV cache for `batch_size` rows and sources of `src_len` tokens."""
  inputs = jnp.ones((batch_size, src_len), jnp.int32)
  bos = jnp.full((batch_size, 1), BOS_ID, jnp.int32)
  shapes = jax.eval_shape(functools.partial(model.init, method=_prefill), jax.random.key(0), inputs, bos)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def greedy_decode(model: nn.Module, params: Any, inputs: jax.Array, max_decode_len: int,
                  eos_id: int = EOS_ID) -> jax.Array:
  """Greedy search: at each step the highest-probability token.

  Args:
    inputs: int32 `[batch, src_len]` source ids, PAD (0) padded.
    max_decode_len: tokens to generate at most per row (EOS included); must not exceed
      the model's `max_length` (the cache size).
  Returns:
    int32 `[batch, max_decode_len]`: each row's tokens up to and including EOS, then PAD.
    Rows stop independently; the loop ends when every row has emitted EOS.
  """
  batch = inputs.shape[0]
  cache = init_cache(model, batch, inputs.shape[1])
  bos = jnp.full((batch, 1), BOS_ID, jnp.int32)
  encoded = model.apply({"params": params}, inputs, method="encode")
  logits, mutated = model.apply({"params": params, "cache": cache}, encoded, inputs, bos,
                                decode=True, mutable=["cache"], method="decode")

  def cond(carry):
    i, _, _, _, finished = carry
    return (i < max_decode_len) & ~jnp.all(finished)

  def body(carry):
    i, cache, logits, out, finished = carry
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)       # [B]
    token = jnp.where(finished, PAD_ID, token)
    out = out.at[:, i].set(token)
    finished = finished | (token == eos_id)
    positions = jnp.full((batch, 1), i + 1, jnp.int32)
    logits, mutated = model.apply({"params": params, "cache": cache}, None, inputs, token[:, None],
                                  positions=positions, decode=True, mutable=["cache"], method="decode")
    return i + 1, mutated["cache"], logits, out, finished

  out = jnp.zeros((batch, max_decode_len), jnp.int32)
  init = (jnp.array(0), mutated["cache"], logits, out, jnp.zeros((batch,), bool))
  return jax.lax.while_loop(cond, body, init)[3]


def make_greedy_fn(model: nn.Module, mesh: Mesh, max_length: int, extra_tokens: int = 50,
                   eos_id: int = EOS_ID) -> Callable[[Any, jax.Array], jax.Array]:
  """Jitted `(params, inputs [batch, src_len]) -> tokens [batch, out_len]` with
  out_len = min(src_len + extra_tokens, max_length) (the paper's input length + 50).
  The batch is sharded over the data axes; recompiles once per source length."""
  @functools.partial(jax.jit, static_argnums=(2,))
  def run(params, inputs, out_len):
    inputs = jax.lax.with_sharding_constraint(inputs, sh.batch_sharding(mesh))
    return greedy_decode(model, params, inputs, out_len, eos_id)

  def decode_fn(params, inputs):
    out_len = min(inputs.shape[1] + extra_tokens, max_length)
    with jax.set_mesh(mesh), sh.axis_rules():
      return run(params, inputs, out_len)
  return decode_fn
