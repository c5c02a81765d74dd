"""Fixed-batch decoding of a model: prefill once, then the strategy's loop over the KV
cache, all inside one jit, as `SearchOptions` (`inference.options`) describes it.

Works for any model kind with `prefill` / `extend` methods (the inputs are sources for an
encoder-decoder, prompts for a decoder-only model).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.inference import cache as kv
from jaxformer.inference.options import SearchOptions
from jaxformer.inference.quantize import decoding_params
from jaxformer.inference.sampling import check_sampling, source_row_keys
from jaxformer.inference.search import (
  BEAM_SIZE,
  EXTRA_TOKENS,
  LENGTH_PENALTY,
  beam_search_core,
  check_beam_options,
  greedy_core,
  sample_core,
)
from jaxformer.inference.speculative import speculative_greedy


def _check_inputs(inputs: jax.Array) -> None:
  if inputs.ndim != 2 or not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError(f"inputs must be integer ids of shape [batch, src_len], got {inputs.dtype} {inputs.shape}")
  if inputs.shape[0] < 1 or inputs.shape[1] < 1:
    raise ValueError(f"inputs must have at least one row and one column, got shape {inputs.shape}")


def default_decode_len(src_len: int, max_length: int, extra_tokens: int = EXTRA_TOKENS) -> int:
  """min(src_len + extra_tokens, max_length): the paper's input length + 50, capped by the
  decoder cache size (model `max_length`)."""
  return min(src_len + extra_tokens, max_length)


def _resolve_decode_len(model: nn.Module, inputs: jax.Array, max_decode_len: int | None) -> int:
  cache_size = model.config.max_length
  if max_decode_len is None:
    return default_decode_len(inputs.shape[1], cache_size)
  if not 1 <= max_decode_len <= cache_size:
    raise ValueError(f"max_decode_len must be in [1, model max_length={cache_size}], got {max_decode_len}")
  return int(max_decode_len)


def start(model: nn.Module, params: Any, inputs: jax.Array, max_decode_len: int):
  """Prefills a contiguous cache with int `[batch, len]` inputs; returns (first-token logits
  `[batch, vocab]`, cache, `LogitsFn` of one cached step), PAD excluded (`cache.no_pad`).

  The cache holds just what `max_decode_len` generated tokens need (the last one is never
  read), so attention touches no unused slots. int8 params (`inference.quantize`) go to the
  model as int8 kernels for its int8 products (`decoding_params`), inside the caller's jit."""
  params = decoding_params(params)
  pad = model.config.pad_id
  capacity = max_decode_len + (0 if model.ENCODES_SOURCE else inputs.shape[1])  # + BOS, - the unread last token
  cache = kv.contiguous_cache(model, params, inputs.shape[0], inputs.shape[1], min(capacity, model.config.max_length))
  logits, cache = kv.prefill(model, params, cache, inputs)

  def logits_fn(tokens, cache, position):
    logits, cache = kv.step(model, params, cache, tokens)
    return kv.no_pad(logits, pad), cache

  return kv.no_pad(logits, pad), cache, logits_fn


def cache_batch_axis(model: nn.Module) -> int:
  """Axis of the batch in the cache's layer leaves: 1 under `model.scan_layers`
  (`[num_layers, batch, ...]`), else 0."""
  return 1 if model.config.scan_layers else 0


def _eos(model: nn.Module, eos_id: int | None) -> int:
  """`eos_id`, or the model's (`model.eos_id`) when None; -1 never stops."""
  return model.config.eos_id if eos_id is None else eos_id


def source_limits(inputs: jax.Array, pad_id: int, extra_tokens: int, max_length: int) -> jax.Array:
  """int32 `[batch]`: each source's own output cap, min(its tokens (not `pad_id`) + `extra_tokens`,
  `max_length`): the paper's input length + 50 (section 6.1), per sentence."""
  return jnp.minimum(jnp.sum(inputs != pad_id, axis=1) + extra_tokens, max_length).astype(jnp.int32)


def greedy_decode(
  model: nn.Module,
  params: Any,
  inputs: jax.Array,
  max_decode_len: int,
  eos_id: int | None = None,
  return_cache: bool = False,
  row_limits: jax.Array | None = None,
) -> Any:
  """Greedy search: int32 `[batch, max_decode_len]` tokens through EOS (`eos_id`, default the
  model's), then padding (`model.pad_id`), for int `[batch, len]` inputs padded with `model.pad_id`.
  Rows stop independently; the loop ends when every row has emitted EOS. `max_decode_len` must
  not exceed the model's `max_length`; int32 `[batch]` `row_limits` (<= max_decode_len) cap rows
  one by one (`search`). With `return_cache`: (tokens, the final `KVCache`)."""
  logits, cache, step = start(model, params, inputs, max_decode_len)
  return greedy_core(
    step,
    logits,
    cache,
    max_decode_len=max_decode_len,
    eos_id=_eos(model, eos_id),
    return_cache=return_cache,
    pad_id=model.config.pad_id,
    row_limits=row_limits,
  )


def beam_search(
  model: nn.Module,
  params: Any,
  inputs: jax.Array,
  beam_size: int = BEAM_SIZE,
  max_decode_len: int | None = None,
  alpha: float = LENGTH_PENALTY,
  eos_id: int | None = None,
  return_cache: bool = False,
  row_limits: jax.Array | None = None,
) -> Any:
  """Beam search with the KV cache (see `search.beam_strategy`). Jittable (`beam_size`,
  `max_decode_len`, `alpha`, `eos_id` static).

  Args:
    inputs: int `[batch, src_len]` source ids, padded with `model.pad_id`.
    beam_size: K >= 1 (paper: 4).
    max_decode_len: tokens per hypothesis at most, EOS included; None gives
      min(src_len + 50, model max_length) (paper section 6.1); must not exceed max_length.
    alpha: GNMT length-penalty exponent (paper: 0.6), >= 0.
    eos_id: the end token (None: `model.eos_id`).
    row_limits: int32 `[batch]` per-row caps (<= max_decode_len; see `search`), or None.

  Returns:
    (int32 `[batch, max_decode_len]` best hypothesis per row, float32 `[batch]` its
    length-normalised log-probability); with `return_cache`, (that pair, the final `KVCache`).

  Raises:
    ValueError: malformed inputs or options (one line).
  """
  _check_inputs(inputs)
  length = _resolve_decode_len(model, inputs, max_decode_len)
  check_beam_options(beam_size, length, alpha)  # before the encoder runs, not after
  logits, cache, step = start(model, params, inputs, length)
  return beam_search_core(
    step,
    logits,
    cache,
    beam_size=beam_size,
    max_decode_len=length,
    alpha=alpha,
    eos_id=_eos(model, eos_id),
    cache_batch_axis=cache_batch_axis(model),
    return_cache=return_cache,
    pad_id=model.config.pad_id,
    row_limits=row_limits,
  )


def sample_decode(
  model: nn.Module,
  params: Any,
  inputs: jax.Array,
  max_decode_len: int | None,
  rng: jax.Array,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  eos_id: int | None = None,
  return_cache: bool = False,
  row_limits: jax.Array | None = None,
) -> Any:
  """Samples one output per row with the KV cache (temperature, top-k, nucleus).

  Reproducible: the output is a function of (params, rng, the row's input tokens, options)
  only. Each row's key is `source_row_keys(rng, inputs)`, so an input gets the same sample
  alone or in any batch; identical inputs in one call get identical samples. top_k = 1 is
  greedy. Returns int32 `[batch, max_decode_len]`: tokens through EOS (`eos_id`, default the
  model's), then padding, each row capped by its `row_limits` entry when given (with
  `return_cache`: those and the final `KVCache`).

  Raises:
    ValueError: malformed inputs or sampling options (one line).
  """
  _check_inputs(inputs)
  check_sampling(temperature, top_k, top_p)
  length = _resolve_decode_len(model, inputs, max_decode_len)
  logits, cache, step = start(model, params, inputs, length)
  pad = model.config.pad_id
  return sample_core(
    step,
    logits,
    cache,
    source_row_keys(rng, inputs, pad),
    max_decode_len=length,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    eos_id=_eos(model, eos_id),
    return_cache=return_cache,
    pad_id=pad,
    row_limits=row_limits,
  )


def decode_with(
  model: nn.Module,
  params: Any,
  inputs: jax.Array,
  out_len: int,
  options: SearchOptions,
  return_cache: bool = False,
  row_limits: jax.Array | None = None,
) -> Any:
  """int32 `[batch, out_len]` tokens for `inputs` by the strategy of `options` (traceable), each
  row capped by its `row_limits` entry when given; with `return_cache`, (tokens, the final `KVCache`)."""
  if options.strategy == "beam":
    (tokens, _), cache = beam_search(
      model,
      params,
      inputs,
      options.beam_size,
      out_len,
      options.length_penalty,
      options.eos_id,
      return_cache=True,
      row_limits=row_limits,
    )
  elif options.strategy == "sample":
    t, k, p = options.sampling_args()
    tokens, cache = sample_decode(
      model,
      params,
      inputs,
      out_len,
      jax.random.key(options.seed),
      t,
      k,
      p,
      options.eos_id,
      return_cache=True,
      row_limits=row_limits,
    )
  else:
    tokens, cache = greedy_decode(
      model, params, inputs, out_len, options.eos_id, return_cache=True, row_limits=row_limits
    )
  return (tokens, cache) if return_cache else tokens


@dataclasses.dataclass
class Draft:
  """A draft model for speculative greedy decoding (`inference.speculative`): its module,
  params (on the same devices as the target's) and the tokens it proposes per round."""

  model: nn.Module
  params: Any
  num_tokens: int = 4


def make_decode_fn(
  model: nn.Module,
  mesh: Mesh,
  max_length: int,
  options: SearchOptions | None = None,
  draft: Draft | None = None,
  rules: sh.Rules = sh.LOGICAL_RULES,
) -> Callable[[Any, jax.Array], jax.Array]:
  """Jitted `(params, inputs [batch, src_len]) -> int32 tokens [batch, out_len]` for the
  strategy of `options` (default: greedy), out_len = min(src_len + extra_tokens, max_length),
  traced on `mesh` with `rules` (the run's `sh.rules_for(config.mesh)`, fixed here). Each
  sentence stops after its own `source_limits` (its tokens + extra_tokens): its output is the
  same alone or beside longer sources.

  The batch is sharded over the data axes (beams stay with their sentence); recompiles
  once per source length. Sampling uses `jax.random.key(options.seed)` for every batch;
  per-row keys come from the source tokens (`sample_decode`), so results do not depend
  on batching. With a `draft`, greedy search runs speculatively (same tokens); the
  function's `speculation` list then gets `(accepted draft tokens, proposed)` per call.

  On a one-device mesh without a draft, the function keeps the last call's KV cache (one
  call's cache, for the last input shape) and donates it to the next call of that shape, whose
  cache then takes its memory; its values are never read. XLA:CPU would otherwise allocate
  the cache afresh with each call's temporaries: at beam 4 and batch 32 (`multi30k_small`)
  a 34 MB buffer, over glibc's 32 MiB mmap limit, so every call faulted in 8,300 new pages
  (about 4% of the call's time).

  Raises:
    ValueError: bad options, or a draft with beam search or sampling (one line).
  """
  options = (options or SearchOptions()).validate()
  if draft is not None:
    options.check_speculative()

  reuse_cache = draft is None and mesh.devices.size == 1

  def sharded(inputs):
    return jax.lax.with_sharding_constraint(inputs, sh.batch_sharding(mesh, rules=rules))

  def limits(inputs):
    return source_limits(inputs, model.config.pad_id, options.extra_tokens, max_length)

  @functools.partial(jax.jit, static_argnums=(2,))
  def run(params, inputs, out_len, draft_params=None):
    if draft is None:
      return decode_with(model, params, sharded(inputs), out_len, options, row_limits=limits(inputs))
    tokens, accepted, rounds = speculative_greedy(
      model,
      params,
      draft.model,
      draft_params,
      sharded(inputs),
      out_len,
      draft.num_tokens,
      options.eos_id,
      row_limits=limits(inputs),
    )
    return tokens, jnp.sum(accepted), jnp.sum(rounds) * draft.num_tokens

  @functools.partial(jax.jit, static_argnums=(2,), donate_argnums=(3,), keep_unused=True)
  def run_reusing(params, inputs, out_len, workspace):  # workspace: a cache of this shape, values unused
    return decode_with(model, params, sharded(inputs), out_len, options, return_cache=True, row_limits=limits(inputs))

  cache_shapes = {}  # per input shape: the cache's shapes (tracing them again would cost as much as a call)

  def workspace_for(params, inputs, out_len):
    key = (inputs.shape, jnp.dtype(inputs.dtype).name, out_len)
    kept = decode_fn.workspace.pop(key, None)
    decode_fn.workspace.clear()  # one shape's cache at most
    if kept is None:
      if key not in cache_shapes:
        cache_shapes[key] = jax.eval_shape(
          lambda p, x: decode_with(model, p, x, out_len, options, return_cache=True)[1], params, inputs
        )
      kept = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), cache_shapes[key])
    return key, kept

  def decode_fn(params, inputs):
    out_len = default_decode_len(inputs.shape[1], max_length, options.extra_tokens)
    with sh.bind(mesh, rules):
      if reuse_cache:
        key, workspace = workspace_for(params, inputs, out_len)
        tokens, decode_fn.workspace[key] = run_reusing(params, inputs, out_len, workspace)
        return tokens
      if draft is None:
        return run(params, inputs, out_len)
      tokens, accepted, proposed = run(params, inputs, out_len, draft.params)
    decode_fn.speculation.append((int(accepted), int(proposed)))
    return tokens

  decode_fn.speculation = []
  decode_fn.workspace = {}
  return decode_fn
