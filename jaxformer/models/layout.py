"""The two layouts of a layer stack, and conversion between them.

Unrolled (`model.scan_layers=false`): layer i of the stack `encoder` is the param subtree
`encoder_{i}`. Scanned (`model.scan_layers=true`): one subtree `encoder` whose leaves stack
the layers on a new leading `[num_layers]` axis (logical axis `layers`). The scanned layout
is a pure re-layout of the unrolled one:

  * init: `StackedInit` makes a scanned model's `init` initialise the unrolled model and
    stack its layers, so the scanned params are bitwise the stacked unrolled params;
  * dropout: layer i draws from `fold_in(stack key, i)` in both layouts (`layer_rngs`);
  * so the losses and gradients agree up to float rounding of the loop, and a run may switch
    layout on resume: `restore_state` / `restore_params` read a checkpoint written in either
    layout into the current one.

The model classes name their stacks in `STACKS`, `((stack name, ModelConfig field with its
layer count), ...)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxformer import sharding as sh


def layer_stacks(model: nn.Module) -> dict[str, int]:
  """`{stack name: number of layers}` of a model (an `EncoderDecoder`, `DecoderOnly` or `EncoderOnly`)."""
  return {name: getattr(model.config, field) for name, field in model.STACKS}


def layer_rngs(module: nn.Module, num_layers: int, deterministic: bool) -> jax.Array | None:
  """Dropout keys of a stack's layers, a `[num_layers]` key array: layer i gets
  `fold_in(k, i)` of one key `k` the stack's owner draws from its "dropout" stream, so
  the masks do not depend on the layout. None when deterministic or the model has no dropout."""
  cfg = module.config
  if deterministic or (cfg.dropout_rate == 0.0 and cfg.attention_dropout_rate == 0.0):
    return None
  key = module.make_rng("dropout")
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_layers, dtype=jnp.uint32))


def _stack_leaves(*xs: Any) -> Any:
  x = xs[0]
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
      sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return jax.ShapeDtypeStruct((len(xs),) + x.shape, x.dtype, sharding=sharding)
  return jnp.stack(xs)


def _layer_leaf(x: Any, i: int) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
      sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)
  return x[i]


def _stack_dict(tree: Mapping[str, Any], stacks: dict[str, int]) -> dict[str, Any]:
  out = dict(tree)
  for name, n in stacks.items():
    if f"{name}_0" in out:
      layers = [out.pop(f"{name}_{i}") for i in range(n)]
      out[name] = nn.meta.add_axis(jax.tree.map(_stack_leaves, *layers), 0, {nn.PARTITION_NAME: sh.LAYERS})
  return out


def _unstack_dict(tree: Mapping[str, Any], stacks: dict[str, int]) -> dict[str, Any]:
  out = dict(tree)
  for name, n in stacks.items():
    if name in out:
      stacked = nn.meta.remove_axis(out.pop(name), 0, {nn.PARTITION_NAME: sh.LAYERS})
      out.update({f"{name}_{i}": jax.tree.map(lambda x, i=i: _layer_leaf(x, i), stacked) for i in range(n)})
  return out


def _map_layer_dicts(tree: Any, stacks: dict[str, int], keys: Callable[[str], str], fn) -> Any:
  """Applies `fn` to every dict of `tree` holding a key `keys(stack name)`: the params, and
  each params-shaped part of an optimizer state, gradients or a cache collection."""

  def holds_stack(x):
    return isinstance(x, Mapping) and any(keys(name) in x for name in stacks)

  return jax.tree.map(lambda x: fn(x, stacks) if holds_stack(x) else x, tree, is_leaf=holds_stack)


def stack_layers(tree: Any, stacks: dict[str, int]) -> Any:
  """Unrolled -> scanned layout: in every dict of `tree` with layers `{name}_{i}`, those are
  replaced by `name`, their leaves stacked on a new leading axis. Works on params, gradients,
  optimizer states, cache collections; leaves may be arrays, `jax.ShapeDtypeStruct`s (a
  NamedSharding gets an unsharded leading axis) or boxed params (`nn.Partitioned` gets the
  logical axis `layers` first). `stacks` is `layer_stacks(model)`."""
  return _map_layer_dicts(tree, stacks, lambda name: f"{name}_0", _stack_dict)


def unstack_layers(tree: Any, stacks: dict[str, int]) -> Any:
  """Scanned -> unrolled layout, the inverse of `stack_layers`."""
  return _map_layer_dicts(tree, stacks, lambda name: name, _unstack_dict)


def is_scanned(params: Mapping[str, Any], stacks: dict[str, int]) -> bool:
  """Whether a params dict (or a dict with the params' keys) is in the scanned layout."""
  return any(name in params for name in stacks)


class StackedInit:
  """Mixin for the models: with `config.scan_layers`, `init` (and `init_with_output`)
  initialise the unrolled model with the same rngs and stack its layers (params and any
  cache), so the two layouts start from bitwise the same weights."""

  @nn.nowrap
  def init_with_output(self, rngs, *args, **kwargs):
    """`nn.Module.init_with_output`; with `scan_layers`, inits the unrolled model and stacks its layers."""
    if not self.config.scan_layers:
      return super().init_with_output(rngs, *args, **kwargs)
    unrolled = self.clone(config=dataclasses.replace(self.config, scan_layers=False))
    out, variables = unrolled.init_with_output(rngs, *args, **kwargs)
    return out, stack_layers(variables, layer_stacks(self))


def saved_layout_is_scanned(step_dir: str | Path, stacks: dict[str, int]) -> bool | None:
  """Whether the checkpoint in `step_dir` (`<workdir>/checkpoints/<step>`) holds scanned
  params; None when its metadata cannot be read (a damaged step: restoring reports it)."""
  import orbax.checkpoint as ocp  # noqa: PLC0415  (only restoring needs Orbax here)

  try:
    with ocp.StandardCheckpointer() as reader:
      tree = reader.metadata(Path(step_dir) / "default").item_metadata.tree
  except Exception:  # whatever Orbax raises on damaged metadata; the restore itself names the damage
    return None
  return is_scanned(tree.get("params", {}), stacks)


def _in_saved_layout(checkpointer, step: int | None, target: Any, model: nn.Module, read: Callable[[Any], Any]) -> Any:
  """`read(target)`, or, when the checkpoint of `step` (default: the newest) has the other
  layout, `read` of the converted target, converted back onto `target`'s shardings."""
  steps = checkpointer.all_steps()
  stacks = layer_stacks(model)
  saved = None
  if steps:
    saved = saved_layout_is_scanned(checkpointer.directory / str(max(steps) if step is None else step), stacks)
  if saved is None or saved == model.config.scan_layers:
    return read(target)
  to_saved, back = (stack_layers, unstack_layers) if saved else (unstack_layers, stack_layers)
  restored = read(to_saved(target, stacks))
  shardings = jax.tree.map(lambda t: t.sharding, target)
  return jax.jit(lambda tree: back(tree, stacks), out_shardings=shardings)(restored)


def restore_state(checkpointer, target: Any, model: nn.Module, step: int | None = None) -> Any:
  """`checkpointer.restore(target, step)` from a checkpoint of either layout: `target` is the
  sharded abstract `TrainState` of `model`'s layout; the params and the optimizer state come
  back in that layout and sharding. The layout is that of `step` (default: the newest step);
  should the restore fall back past a damaged step to one of the other layout, it fails in
  one line, and the next run (the damaged step set aside) reads it."""
  return _in_saved_layout(checkpointer, step, target, model, lambda t: checkpointer.restore(t, step))


def restore_params(checkpointer, target_params: Any, model: nn.Module, step: int | None = None) -> tuple[int, Any]:
  """`checkpointer.restore_params(target_params, step)` from a checkpoint of either layout;
  returns `(step, params)` with the params in `model`'s layout (see `restore_state`)."""
  found = []

  def read(target):
    restored_step, params = checkpointer.restore_params(target, step)
    found.append(restored_step)
    return params

  params = _in_saved_layout(checkpointer, step, target_params, model, read)
  return found[0], params
