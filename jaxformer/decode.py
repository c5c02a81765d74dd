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

# logits_fn(tokens int32 [N], cache, position int32 scalar) -> (float logits [N, vocab], cache):
# feeds `tokens` at decoder position `position` and returns the next-token logits.
LogitsFn = Callable[[jax.Array, Any, jax.Array], "tuple[jax.Array, Any]"]


def _encode_and_decode_bos(module: nn.Module, inputs: jax.Array, bos: jax.Array):
  encoded = module.encode(inputs)
  return module.decode(encoded, inputs, bos, decode=True)


def init_cache(model: nn.Module, batch_size: int, src_len: int) -> Any:
  """A zeroed KV cache for `batch_size` rows and sources of `src_len` tokens."""
  inputs = jnp.ones((batch_size, src_len), jnp.int32)
  bos = jnp.full((batch_size, 1), BOS_ID, jnp.int32)
  shapes = jax.eval_shape(functools.partial(model.init, method=_encode_and_decode_bos), jax.random.key(0), inputs, bos)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def prefill(model: nn.Module, params: Any, inputs: jax.Array) -> tuple[jax.Array, Any]:
  """Encodes `inputs` (int `[batch, src_len]`) once and feeds BOS to the decoder.

  Returns float32 logits `[batch, vocab]` of the first generated token and the filled
  cache (self-attention K/V of BOS, cross-attention K/V of the encoder output).
  """
  batch = inputs.shape[0]
  cache = init_cache(model, batch, inputs.shape[1])
  bos = jnp.full((batch, 1), BOS_ID, jnp.int32)
  encoded = model.apply({"params": params}, inputs, method="encode")
  logits, mutated = model.apply({"params": params, "cache": cache}, encoded, inputs, bos,
                                decode=True, mutable=["cache"], method="decode")
  return logits[:, -1], mutated["cache"]


def model_logits_fn(model: nn.Module, params: Any, inputs: jax.Array) -> LogitsFn:
  """A `LogitsFn` for one cached decode step of `model`; `inputs` `[N, src_len]` must have
  the same rows as the cache (repeat them per beam for beam search)."""
  def fn(tokens, cache, position):
    positions = jnp.full((tokens.shape[0], 1), position, jnp.int32)
    logits, mutated = model.apply({"params": params, "cache": cache}, None, inputs, tokens[:, None],
                                  positions=positions, decode=True, mutable=["cache"], method="decode")
    return logits[:, -1], mutated["cache"]
  return fn


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
  logits, cache = prefill(model, params, inputs)

  def greedy(logits, _):
    return jnp.argmax(logits, axis=-1)

  return token_loop(model_logits_fn(model, params, inputs), logits, cache, greedy, max_decode_len, eos_id)


def token_loop(logits_fn: LogitsFn, init_logits: jax.Array, cache: Any,
               choose: Callable[[jax.Array, jax.Array], jax.Array], max_decode_len: int,
               eos_id: int = EOS_ID) -> jax.Array:
  """The one-token-per-step loop shared by greedy search and sampling.

  Args:
    logits_fn: one cached decode step (see `LogitsFn`).
    init_logits: float `[batch, vocab]` logits of the first token (from `prefill`).
    choose: `(logits [batch, vocab], step) -> tokens [batch]`, e.g. argmax or a draw.
    max_decode_len: tokens to generate at most per row (EOS included).
  Returns:
    int32 `[batch, max_decode_len]`: tokens through EOS, then PAD. Rows stop
    independently; the `jax.lax.while_loop` ends once every row has emitted EOS.
  """
  batch = init_logits.shape[0]

  def cond(carry):
    i, _, _, _, finished = carry
    return (i < max_decode_len) & ~jnp.all(finished)

  def body(carry):
    i, cache, logits, out, finished = carry
    token = choose(logits, i).astype(jnp.int32)                         # [B]
    token = jnp.where(finished, PAD_ID, token)
    out = out.at[:, i].set(token)
    finished = finished | (token == eos_id)
    logits, cache = logits_fn(token, cache, i + 1)
    return i + 1, cache, logits, out, finished

  out = jnp.zeros((batch, max_decode_len), jnp.int32)
  init = (jnp.array(0, jnp.int32), cache, init_logits.astype(jnp.float32), out, jnp.zeros((batch,), bool))
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
