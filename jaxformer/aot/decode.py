"""`jaxformer compile --decode`: ahead-of-time compilation of decoding, the KV-cache decode step
and the prefill, for a batch and context on a mesh (simulated CPU devices or a TPU topology, as
`aot.train_step`), with the memory the KV cache and the weights take per device.

Everything is abstract (`jax.eval_shape`), as for the train step. The cache is the one decoding
runs on (`inference.cache`): contiguous rows of `context` tokens (`decode`, `generate`), or with
`page_size` the serving engine's paged pools (`inference.engine`: one page per `page_size`
tokens of every row, plus the null page). Its rows are split over the data-parallel axes and its
heads over `tensor` (`act_batch` and `act_heads` in the rules), each where the size divides; the
weights keep their training sharding. Both programs donate the cache, so it is updated in place.
"""

from __future__ import annotations

import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxformer import sharding as sh
from jaxformer.aot import train_step as aot
from jaxformer.config import Config, ConfigError
from jaxformer.inference import cache as kv
from jaxformer.tasks import get_task
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import state_shardings
from jaxformer.train.summary import per_device_bytes, total_bytes


def _split(size: int, axes: Any, mesh) -> Any:
  """`axes` (a mesh axis, a tuple of them, or None) if `size` splits evenly over them, else None."""
  names = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return axes if size % int(np.prod([mesh.shape[a] for a in names], dtype=np.int64)) == 0 else None


def cache_shardings(cache: kv.KVCache, mesh, rules: sh.Rules) -> kv.KVCache:
  """NamedShardings for an abstract `KVCache`: each key/value array `[..., rows, kv_heads, length,
  head_dim]` (rows: batch rows, or a paged pool's pages, which all rows share and so stay whole)
  gets its rows over `act_batch`'s mesh axes and its heads over `act_heads`', where they divide;
  the per-row state is replicated."""
  batch_axes, head_axes = nn.logical_to_mesh_axes((sh.ACT_BATCH, sh.ACT_HEADS), rules)

  def layer(x):
    rows = None if cache.state.paged else _split(x.shape[-4], batch_axes, mesh)
    spec = (None,) * (x.ndim - 4) + (rows, _split(x.shape[-3], head_axes, mesh), None, None)
    return NamedSharding(mesh, PartitionSpec(*spec))

  return kv.KVCache(jax.tree.map(layer, cache.layers), jax.tree.map(lambda _: sh.replicated(mesh), cache.state))


def abstract_cache(model, params: Any, batch_size: int, context: int, page_size: int) -> kv.KVCache:
  """The abstract cache of `batch_size` rows of `context` tokens (prefill inputs of `context`
  tokens too): contiguous, or with `page_size` > 0 the engine's paged pools."""
  if not page_size:
    return jax.eval_shape(lambda p: kv.contiguous_cache(model, p, batch_size, context, context), params)
  per_row = -(-context // page_size)
  return jax.eval_shape(
    lambda p: kv.paged_cache(model, p, batch_size, batch_size * per_row + 1, page_size, per_row, per_row), params
  )


def lower_decode(
  config: Config,
  devices: list[Any] | None = None,
  context: int | None = None,
  page_size: int = 0,
  platforms: tuple[str, ...] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
  """(facts, {"decode_step": Lowered, "prefill": Lowered}): `config`'s decode step and prefill for
  `train.batch_size` rows of `context` tokens (default `model.max_length`), lowered on a mesh over
  `devices` (for `platforms`, as `aot.lower_train_step`) from abstract inputs only. The facts are
  `aot.describe`'s fields, `mode` "decode", `batch_size`, `context`, `page_size` (0: contiguous
  cache), `weight_bytes_per_device` (the params as stored, in their training sharding),
  `kv_cache_bytes_per_device` and `kv_cache_bytes` (the whole cache), from the arrays' shapes (a
  TPU compiler's figures also count its tile padding).

  Raises:
    ConfigError: the model does not decode (an encoder-only kind), `context` exceeds
      `model.max_length` or `page_size` is negative, or the mesh does not fit (one line).
  """
  model = get_task(config).make_model()
  context = context or config.model.max_length
  if not hasattr(model, "prefill"):
    raise ConfigError(
      f"--decode: model.kind={config.model.kind} has no KV-cache decoding; "
      "compile its train step (drop --decode) or use a decoder_only or encoder_decoder config"
    )
  if not 0 < context <= config.model.max_length or page_size < 0:
    raise ConfigError(
      f"--context {context} / --page-size {page_size}: the context must be 1..model.max_length="
      f"{config.model.max_length} and the page size >= 0"
    )
  mesh = aot.topology_mesh(config, devices)
  rules = sh.rules_for(config.mesh)
  abstract, shardings = state_shardings(model, make_optimizer(config.optim, config.model.d_model), mesh, rules)
  params = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract.params, shardings.params
  )
  batch = config.train.batch_size
  cache = abstract_cache(model, abstract.params, batch, context, page_size)
  cache_sharding = cache_shardings(cache, mesh, rules)
  cache_in = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), cache, cache_sharding)
  rows = sh.replicated(mesh)

  def keep_layout(new_cache):  # the updated cache stays where the donated one was: written in place
    return jax.lax.with_sharding_constraint(new_cache, cache_sharding)

  def decode_step(params, cache, tokens):
    logits, cache = kv.step(model, params, cache, tokens)
    return logits, keep_layout(cache)

  def prefill(params, cache, inputs):
    logits, cache = kv.prefill(model, params, cache, inputs)
    return logits, keep_layout(cache)

  lowered = {}
  for name, fn, shape in (("decode_step", decode_step, (batch,)), ("prefill", prefill, (batch, context))):
    tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows)
    with sh.bind(mesh, rules):
      lowered[name] = (
        jax.jit(fn, donate_argnums=(1,)).trace(params, cache_in, tokens).lower(lowering_platforms=platforms)
      )
  facts = {
    **aot.describe(config, mesh, abstract.params),
    "mode": "decode",
    "batch_size": batch,
    "context": context,
    "page_size": page_size,
    "weight_bytes_per_device": per_device_bytes(abstract.params, shardings.params),
    "kv_cache_bytes_per_device": per_device_bytes(cache.layers, cache_sharding.layers),
    "kv_cache_bytes": total_bytes(cache.layers),
  }
  return facts, lowered


def compile_decode(
  config: Config,
  devices: list[Any] | None = None,
  hbm_bytes: int | None = None,
  context: int | None = None,
  page_size: int = 0,
) -> dict[str, Any]:
  """Lowers (`lower_decode`) and compiles `config`'s decode step and prefill without running them.

  Returns a JSON-safe dict: `lower_decode`'s facts, `decode_step` and `prefill` (each
  `aot.compile_program`'s fields: per-device memory, flops, fits or the compiler's out-of-memory
  figures), `fits` (both fit; where they say) and `compile_seconds` (both programs, tracing included).

  Raises:
    ConfigError: as `lower_decode`.
    CompileError: the compiler rejected a program for a reason other than memory (one line).
  """
  start = time.perf_counter()
  facts, lowered = lower_decode(config, devices, context, page_size)
  programs = {
    name: aot.compile_program(low, hbm_bytes, f"the {name.replace('_', ' ')}", facts["platform"])
    for name, low in lowered.items()
  }
  fits = {"fits": all(p["fits"] for p in programs.values())} if "fits" in programs["decode_step"] else {}
  return {**facts, **programs, **fits, "compile_seconds": round(time.perf_counter() - start, 2)}


def format_report(result: dict[str, Any]) -> str:
  """A short human-readable summary of a `compile_decode` result."""
  mesh = " ".join(f"{k}={v}" for k, v in result["mesh"].items() if v > 1) or "single device"
  layout = f"pages of {result['page_size']} tokens" if result["page_size"] else "contiguous rows"
  lines = [
    f"{result['config']}: {result['params']:,} parameters, decoding {result['batch_size']} rows x "
    f"{result['context']} tokens ({layout}) on {result['devices']} {result['platform']} devices ({mesh}); "
    f"compiled in {result['compile_seconds']:.1f} s",
    f"per device: weights {aot.gib(result['weight_bytes_per_device'])}, KV cache "
    f"{aot.gib(result['kv_cache_bytes_per_device'])} (of {aot.gib(result['kv_cache_bytes'])} in all)",
  ]
  for name in ("decode_step", "prefill"):
    lines += [f"{name.replace('_', ' ')}:", *aot.program_lines(result[name], result["platform"], "  ")]
  return "\n".join(lines)
