"""A function's Threefry hashes merged into a few wide calls: the same bits, a much cheaper compile.

Initialising a model draws every parameter from its own key: each module folds its name into
the key (`random_fold_in`) and each initializer draws its bits (`random_bits`). Every one of
these is a Threefry-2x32 hash, which XLA:CPU lowers as its own rolled `while` loop, so a tiny
encoder-decoder's init compiled 94 of them and took 5x longer to compile than its forward pass.

Threefry is elementwise in (key, counter), so hashes that do not depend on each other can be
computed by one call over their inputs laid end to end, and the results are bitwise the ones the
separate calls give. `batched_threefry(fn)` traces `fn` to a jaxpr, expands the key operations
into their Threefry hashes, and evaluates the result in waves: all hashes whose inputs are
ready are merged into one call, so the number of hashes left is the depth of the key chain
(two for the models here) instead of the number of draws.

Only draws of at most `max_size` elements are merged. Larger ones keep their own call, which
the SPMD partitioner can split over a mesh, so no device computes a big parameter's bits whole.

Key arrays that enter control flow (a scan over layers) are passed to it as they are, and the
hashes inside it keep their own calls. Falls back to `fn` itself, unchanged, for a key
implementation other than Threefry or a function with side effects. Rematerialisation is
inlined: the result is for evaluating, not for differentiating.

Source: Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3" (Threefry is a
counter-based, elementwise hash); JAX's `jax._src.random` for the key primitives' expansions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.random import prng
from jax._src.random.threefry2x32 import threefry2x32_p, threefry_prng_impl

_INLINED = {"jit", "pjit", "closed_call", "core_call"}
_REMAT = {"checkpoint", "remat2"}  # only values are taken here, so rematerialisation is inlined too
_KEY_OPS = {"random_bits", "random_fold_in", "random_split", "random_seed"}
_ALIASES = {"random_wrap", "random_unwrap"}  # a key and its raw uint32 data are the same value here


class _Eqn:
  """One primitive application of the flattened program: inputs and outputs are value ids, or
  ("literal", value) for constants written into the jaxpr. Keys are held as raw uint32 data, so
  `keys_in` and `keys_out` flag the operands this primitive takes and gives as key arrays."""

  __slots__ = ("primitive", "params", "ins", "outs", "keys_in", "keys_out")

  def __init__(self, eqn, ins, outs):
    self.primitive, self.params, self.ins, self.outs = eqn.primitive, eqn.params, ins, outs
    self.keys_in = [_is_key(v.aval) for v in eqn.invars]
    self.keys_out = [_is_key(v.aval) for v in eqn.outvars]

  def apply(self, args: list) -> list:
    """This primitive on `args`, raw key data wrapped into key arrays on the way in and out."""
    args = [prng.random_wrap(a, impl=threefry_prng_impl) if k else a for a, k in zip(args, self.keys_in)]
    out = self.primitive.bind(*args, **self.primitive.get_bind_params(self.params))  # as jax.core.eval_jaxpr
    out = out if self.primitive.multiple_results else [out]
    return [prng.random_unwrap(o) if k else o for o, k in zip(out, self.keys_out)]


def _is_key(aval) -> bool:
  dtype = getattr(aval, "dtype", None)  # tokens have none
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _only_threefry(jaxpr: core.Jaxpr) -> bool:
  """Whether every key `jaxpr` seeds, takes or gives (through the calls the merge inlines) is a
  Threefry key: the only implementation whose expansion the merge knows."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "random_seed" and eqn.params["impl"] is not threefry_prng_impl:
      return False
    if any(_is_key(v.aval) and v.aval.dtype._impl is not threefry_prng_impl for v in (*eqn.invars, *eqn.outvars)):
      return False
    inner = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINED | _REMAT else None
    if inner is not None and not _only_threefry(getattr(inner, "jaxpr", inner)):
      return False
  return True


def _key_op_jaxpr(eqn) -> core.ClosedJaxpr:
  """The Threefry key operation `eqn` written over raw uint32 key data, as JAX itself expands it."""
  name, params, avals = eqn.primitive.name, eqn.params, [v.aval for v in eqn.invars]
  impl, key = threefry_prng_impl, avals[0]
  expansions = {
    "random_bits": lambda k: prng.random_bits_impl_base(
      impl, k, key.ndim, bit_width=params["bit_width"], shape=params["shape"]
    ),
    "random_fold_in": lambda k, m: prng.random_fold_in_impl_base(impl, k, m, key.shape),
    "random_split": lambda k: prng.random_split_impl_base(impl, k, key.ndim, shape=params["shape"]),
    "random_seed": lambda s: prng.random_seed_impl_base(impl, s),
  }
  raw = [core.physical_aval(a) for a in avals]
  return jax.make_jaxpr(expansions[name])(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in raw))


class _Flat:
  """`jaxpr` as one flat list of primitive applications: calls inlined, key operations expanded."""

  def __init__(self):
    self.ids = itertools.count()
    self.eqns: list[_Eqn] = []
    self.values: dict[int, Any] = {}  # id -> concrete or traced value known before evaluation

  def add(self, jaxpr: core.Jaxpr, consts, ins: list) -> list:
    """Flattens `jaxpr` applied to `ins` (ids or literals); returns its outputs' ids or literals."""
    env: dict = dict(zip(jaxpr.invars, ins))
    for var, const in zip(jaxpr.constvars, consts):
      env[var] = next(self.ids)
      self.values[env[var]] = const

    def read(v):
      return ("literal", v.val) if isinstance(v, core.Literal) else env[v]

    for eqn in jaxpr.eqns:
      ins_ = [read(v) for v in eqn.invars]
      name = eqn.primitive.name
      if name in _ALIASES:
        outs = ins_
      elif name in _KEY_OPS:
        expanded = _key_op_jaxpr(eqn)
        outs = self.add(expanded.jaxpr, expanded.consts, ins_)
      elif name in _INLINED:
        outs = self.add(eqn.params["jaxpr"].jaxpr, eqn.params["jaxpr"].consts, ins_)
      elif name in _REMAT:
        outs = self.add(eqn.params["jaxpr"], (), ins_)
      else:
        outs = [next(self.ids) for _ in eqn.outvars]
        self.eqns.append(_Eqn(eqn, ins_, outs))
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _waves(eqns: list[_Eqn], outputs: list) -> list[tuple[bool, list[_Eqn]]]:
  """The live equations of `eqns` grouped into waves, [(is_threefry, equations)]: an equation's wave
  is the number of hashes on its longest input chain; each wave's other equations come first, in
  program order, then its hashes, which need nothing computed later and so can be merged."""
  live = {o for o in outputs if not isinstance(o, tuple)}
  kept = []
  for eqn in reversed(eqns):  # dead-code elimination: init's forward pass computes nothing kept
    if any(o in live for o in eqn.outs):
      kept.append(eqn)
      live.update(i for i in eqn.ins if not isinstance(i, tuple))
  depth: dict[int, int] = {}
  keyed = []
  for index, eqn in enumerate(reversed(kept)):
    d = max((depth.get(i, 0) for i in eqn.ins if not isinstance(i, tuple)), default=0)
    hashing = eqn.primitive is threefry2x32_p
    depth.update((o, d + hashing) for o in eqn.outs)
    keyed.append(((d, hashing, index), eqn))
  keyed.sort(key=lambda item: item[0])
  return [(h, [e for _, e in group]) for (_, h), group in itertools.groupby(keyed, key=lambda item: item[0][:2])]


def _hash_together(args: list[list], max_size: int) -> list[list]:
  """Threefry of each of `args` ([k1, k2, x1, x2] each, broadcastable): those of at most `max_size`
  elements in one call over their inputs laid end to end, the rest each in its own call."""
  shapes = [jnp.broadcast_shapes(*(jnp.shape(a) for a in four)) for four in args]
  small = [i for i, s in enumerate(shapes) if math.prod(s) <= max_size]
  results: list = [None] * len(args)
  if small:
    columns = [jnp.concatenate([jnp.broadcast_to(args[i][j], shapes[i]).ravel() for i in small]) for j in range(4)]
    merged, start = threefry2x32_p.bind(*columns), 0
    if not jax.sharding.get_abstract_mesh().empty:
      # Replicated: each device slices its shards out locally. Left free, the partitioner spreads
      # the params' shardings back into the merged call: 2.5x slower to compile (8 devices, fsdp, -O0).
      merged = [jax.lax.with_sharding_constraint(m, jax.sharding.PartitionSpec()) for m in merged]
    for i in small:
      size = math.prod(shapes[i])
      results[i] = [m[start : start + size].reshape(shapes[i]) for m in merged]
      start += size
  for i, four in enumerate(args):
    if results[i] is None:
      results[i] = threefry2x32_p.bind(*four)
  return results


def batched_threefry(fn: Callable, max_size: int = 1 << 16) -> Callable:
  """`fn` with its independent Threefry hashes merged (see the module docstring).

  Args:
    fn: a function of arrays and key arrays (pytrees allowed), traceable by `jax.make_jaxpr`.
    max_size: the largest draw, in elements, merged with others.

  Returns:
    A function with `fn`'s signature whose outputs are bitwise `fn`'s. Call it inside `jax.jit`:
    on its own it would evaluate eagerly, one primitive at a time.
  """

  def merged(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    if closed.effects or not _only_threefry(closed.jaxpr):
      return fn(*args)  # what the merge does not handle runs as written
    flat, ins = _Flat(), []
    for var, arg in zip(closed.jaxpr.invars, jax.tree.leaves(args)):
      ins.append(next(flat.ids))
      flat.values[ins[-1]] = jax.random.key_data(arg) if _is_key(var.aval) else arg
    outputs = flat.add(closed.jaxpr, closed.consts, ins)
    values = flat.values

    def read(i):
      return i[1] if isinstance(i, tuple) else values[i]

    for hashing, eqns in _waves(flat.eqns, outputs):
      if hashing:
        for e, out in zip(eqns, _hash_together([[read(i) for i in e.ins] for e in eqns], max_size)):
          values.update(zip(e.outs, out))
        continue
      for e in eqns:  # in program order: later ones read earlier ones of the same wave
        values.update(zip(e.outs, e.apply([read(i) for i in e.ins])))
    leaves = [read(o) for o in outputs]
    avals = [v.aval for v in closed.jaxpr.outvars]
    leaves = [jax.random.wrap_key_data(x, impl="threefry2x32") if _is_key(a) else x for x, a in zip(leaves, avals)]
    return jax.tree.unflatten(jax.tree.structure(out_shape), leaves)

  return merged
