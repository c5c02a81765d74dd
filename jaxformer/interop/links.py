"""Tensor correspondences between our params and a Hugging Face state dict, invertible by
construction, so one table per architecture serves both export and import.

A `Link` ties one or more of our param leaves (paths like `encoder_0/ffn_sublayer/...`, in
the unrolled layer layout) to one Hugging Face tensor through a pair of inverse functions
(numpy arrays in, numpy arrays out). A `Const` is a Hugging Face tensor with no counterpart
in our model (an attention bias, a token-type embedding): export writes its fixed value,
import checks that the checkpoint holds exactly that value, since anything else would change
the model's function.

The d_model permutation: when a Hugging Face architecture orders the residual stream's
features differently (Marian's sinusoids: all sines, then all cosines; ours interleave
them), every tensor with a d_model axis is permuted by the same fixed `perm`. Attention,
FFN, LayerNorm and the logits are equivariant under it, so the model's function is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

Array = np.ndarray


@dataclasses.dataclass(frozen=True)
class Link:
  """`hf` (a state-dict name) = `to_hf(*[our leaves at `ours`])`; `from_hf` inverts it,
  returning a tuple with one array per path of `ours`. A derived link (`from_hf` None) is
  computed from params other links carry: import skips it, and its round trip checks it.
  `absent`: the shape of a tensor some checkpoints leave out (a bias they do not have), read as zeros.
  `fallback`: the tensor read when `hf` is left out (T5's head: transformers 5 ties it to `shared.weight`)."""

  ours: tuple[str, ...]
  hf: str
  to_hf: Callable[..., Array]
  from_hf: Callable[[Array], tuple[Array, ...]] | None
  absent: tuple[int, ...] | None = None
  fallback: str | None = None


@dataclasses.dataclass(frozen=True)
class Const:
  """A Hugging Face tensor that must hold `value` (float32)."""

  hf: str
  value: Array


class Basis:
  """Maps tensors' d_model axes between our order and Hugging Face's: `hf[..., k] = ours[..., perm[k]]`
  (identity when `perm` is None)."""

  def __init__(self, perm: Array | None = None):
    self.perm = perm
    self.inverse = None if perm is None else np.argsort(perm)

  def to_hf(self, x: Array, axis: int) -> Array:
    """`x` with its d_model axis `axis` in Hugging Face's order."""
    return x if self.perm is None else np.take(x, self.perm, axis=axis)

  def from_hf(self, x: Array, axis: int) -> Array:
    """`x` with its d_model axis `axis` back in our order (inverts `to_hf`)."""
    return x if self.inverse is None else np.take(x, self.inverse, axis=axis)


def mismatches(m: Any, wanted: dict[str, Any], checks: dict[str, bool] | None = None) -> list[str]:
  """`model.key=value` of each option of the `ModelConfig` `m` that differs from `wanted[key]` or
  whose entry in `checks` is False: the options an architecture has no counterpart for."""
  bad = [k for k, v in wanted.items() if getattr(m, k) != v] + [k for k, ok in (checks or {}).items() if not ok]
  return [f"model.{k}={getattr(m, k)}" for k in bad]


def vector(ours: str, hf: str, basis: Basis) -> Link:
  """A `[d_model]` vector (norm scale or bias, output bias)."""
  return Link((ours,), hf, lambda x: basis.to_hf(x, 0), lambda y: (basis.from_hf(y, 0),))


def plain(ours: str, hf: str, absent: tuple[int, ...] | None = None) -> Link:
  """A tensor stored the same way on both sides (an FFN bias `[d_ff]`); `absent` as in `Link`."""
  return Link((ours,), hf, lambda x: x, lambda y: (y,), absent)


def reshaped(ours: str, hf: str, shape: Sequence[int]) -> Link:
  """Our `shape` tensor (an attention projection's bias `[heads, head_dim]`) as a flat Hugging Face vector."""
  return Link((ours,), hf, lambda x: x.reshape(-1), lambda y: (y.reshape(shape),))


def linear_in(ours: str, hf: str, basis: Basis, shape: Sequence[int], transpose: bool = True) -> Link:
  """Our kernel `[d_model, *rest]` (attention `[d_model, heads, head_dim]`, FFN `[d_model, d_ff]`)
  as a torch `Linear` weight `[prod(rest), d_model]` (or, `transpose=False`, a GPT-2 `Conv1D`
  weight `[d_model, prod(rest)]`). `shape` is our kernel's shape."""

  def to_hf(x):
    y = basis.to_hf(x.reshape(shape[0], -1), 0)
    return y.T if transpose else y

  def from_hf(y):
    return (basis.from_hf(y.T if transpose else y, 0).reshape(shape),)

  return Link((ours,), hf, to_hf, from_hf)


def linear_out(ours: str, hf: str, basis: Basis, shape: Sequence[int], transpose: bool = True) -> Link:
  """Our kernel `[*rest, d_model]` (attention output `[heads, head_dim, d_model]`, FFN
  `[d_ff, d_model]`) as a torch `Linear` weight `[d_model, prod(rest)]` (or a `Conv1D`
  weight `[prod(rest), d_model]` with `transpose=False`)."""

  def to_hf(x):
    y = basis.to_hf(x.reshape(-1, shape[-1]), 1)
    return y.T if transpose else y

  def from_hf(y):
    return (basis.from_hf(y.T if transpose else y, 1).reshape(shape),)

  return Link((ours,), hf, to_hf, from_hf)


def embedding(ours: str, hf: str, basis: Basis, scale: float = 1.0, extra_rows: int = 0, row_offset: int = 0) -> Link:
  """Our `[rows, d_model]` table (token embedding, learned positions) as a Hugging Face table
  times `scale` (Hugging Face models that do not multiply embeddings by sqrt(d_model) get
  it folded in), with `row_offset` rows before ours and `extra_rows` after (zeros)."""

  def to_hf(x):
    y = basis.to_hf(x, 1) * np.float32(scale)
    return np.pad(y, ((row_offset, extra_rows), (0, 0)))

  def from_hf(y):
    return (basis.from_hf(y[row_offset : y.shape[0] - extra_rows], 1) / np.float32(scale),)

  return Link((ours,), hf, to_hf, from_hf)


def flatten(tree: Any, prefix: str = "") -> dict[str, Array]:
  """`{"a/b/c": leaf}` of a nested dict of arrays (as float32 numpy arrays)."""
  out = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict) or hasattr(value, "items"):
      out.update(flatten(value, path + "/"))
    else:
      out[path] = np.asarray(value, np.float32)
  return out


def unflatten(flat: dict[str, Array]) -> dict[str, Any]:
  """The nested dict of `flatten`'s output."""
  tree: dict[str, Any] = {}
  for path, value in flat.items():
    *parents, leaf = path.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def to_hf(links: Sequence[Link], consts: Sequence[Const], params: dict[str, Array]) -> dict[str, Array]:
  """The Hugging Face tensors of our flat params.

  Raises:
    ValueError: a param no link reads, or a link to a param that is missing (a mapping bug).
  """
  return dict(to_hf_items(links, consts, params))


def to_hf_items(
  links: Sequence[Link], consts: Sequence[Const], params: dict[str, Array]
) -> Iterator[tuple[str, Array]]:
  """`to_hf`'s (name, float32 tensor) pairs one at a time, so a caller holds one tensor at once.

  Raises:
    ValueError: as `to_hf` (before the first pair).
  """
  unused = sorted(set(params) - {p for link in links for p in link.ours})
  if unused:
    raise ValueError(f"the export mapping does not cover the params exactly: unused {unused[:3]}")
  for link in links:
    yield link.hf, np.ascontiguousarray(link.to_hf(*[params[p] for p in link.ours]), np.float32)
  for c in consts:
    yield c.hf, np.asarray(c.value, np.float32)


def from_hf(links: Sequence[Link], consts: Sequence[Const], tensors: dict[str, Array]) -> dict[str, Array]:
  """Our flat params from Hugging Face tensors.

  Raises:
    ValueError: a tensor is missing, or a `Const` tensor holds another value than the one our
      model implies (one line naming it: jaxformer has no counterpart for it).
  """
  for c in consts:
    if c.hf in tensors and not np.array_equal(tensors[c.hf], np.broadcast_to(c.value, tensors[c.hf].shape)):
      raise ValueError(
        f"{c.hf} holds values jaxformer's model has no counterpart for (it expects "
        f"{'zeros' if not np.any(c.value) else 'a fixed value'}); "
        "this checkpoint cannot be imported exactly"
      )
  out = {}
  for link in links:
    if link.from_hf is None:
      continue
    value = tensors.get(link.hf)
    if value is None and link.fallback is not None:
      value = tensors.get(link.fallback)
    if value is None and link.absent is not None:
      value = np.zeros(link.absent, np.float32)
    if value is None:
      raise ValueError(f"the checkpoint has no tensor {link.hf}")
    out.update(zip(link.ours, link.from_hf(value)))
  return out


def allclose(a: Array, b: Array, rtol: float = 1e-5, atol: float = 1e-6, block: int = 1 << 22) -> bool:
  """`np.allclose(a, b, rtol, atol)`, over about `block` elements at a time when `a` and `b` have one
  shape, so its temporaries stay small (on a whole `[128256, 2048]` table they are several copies of it)."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.ndim == 0:
    return bool(np.allclose(a, b, rtol=rtol, atol=atol))
  rows = max(1, block // max(1, math.prod(a.shape[1:])))
  return all(np.allclose(a[i : i + rows], b[i : i + rows], rtol=rtol, atol=atol) for i in range(0, a.shape[0], rows))


def from_hf_checked(links: Sequence[Link], consts: Sequence[Const], tensors: Any, kind: str, out: Any = None) -> Any:
  """`from_hf`, each param checked by mapping it back (`to_hf`) against the checkpoint, holding
  the params and about one tensor at a time.

  `tensors` maps names to float32 arrays: a dict, or an `hf_weights.HFWeights`, which reads
  each tensor from disk on request. Each link's tensor is read, converted, mapped back,
  compared with what it was read from and dropped (the params it becomes may be views of it);
  the largest go first, while few params are held, so the temporaries of converting and
  comparing a large table cost least. A tensor a link leaves out is compared with its fallback
  or zeros, as it was read. Derived tensors (a tied head, when the file holds one), the
  `Const`s, and a link's tensor when a later link overwrites one of its params are compared
  once all are converted, each read again. Comparisons use `allclose` (relative 1e-5, absolute
  1e-6), a derived tensor the file leaves out is not compared.

  Returns:
    `out` (by default a new dict) with our flat params set in it: another mapping may store
    them elsewhere (the scanned layout), giving each back when asked for its path.

  Raises:
    ValueError: as `from_hf`; or a tensor our `kind` model cannot express exactly (one line).
  """
  for c in consts:
    if c.hf in tensors:
      value = tensors[c.hf]
      if not np.array_equal(value, np.broadcast_to(c.value, value.shape)):
        raise ValueError(
          f"{c.hf} holds values jaxformer's model has no counterpart for (it expects "
          f"{'zeros' if not np.any(c.value) else 'a fixed value'}); "
          "this checkpoint cannot be imported exactly"
        )
      del value

  def source(link: Link) -> str | None:  # the tensor a link reads: its own, else its fallback
    if link.hf in tensors:
      return link.hf
    return link.fallback if link.fallback is not None and link.fallback in tensors else None

  for link in links:
    if link.from_hf is not None and source(link) is None and link.absent is None:
      raise ValueError(f"the checkpoint has no tensor {link.hf}")
  derived = {link.hf for link in links if link.from_hf is None}
  fallbacks = {link.hf: link.fallback for link in links if link.fallback}
  shape = getattr(tensors, "shape", None)  # HFWeights: a tensor's shape without reading it

  def size(link: Link) -> int:
    name = source(link)
    if name is None:
      return math.prod(link.absent)
    return math.prod(shape(name) if callable(shape) else tensors[name].shape)

  def check(name: str, again: Array, expected: Array | None = None) -> None:
    if expected is None:  # read it: the tensor, else its fallback, else zeros
      fallback = fallbacks.get(name)
      expected = (
        tensors[name]
        if name in tensors
        else tensors[fallback]
        if fallback is not None and fallback in tensors
        else np.zeros(again.shape, np.float32)
      )
    if not allclose(again, expected):
      raise ValueError(
        f"{name} has values jaxformer's {kind} model cannot express exactly; this checkpoint cannot be imported"
      )

  last = {p: k for k, link in enumerate(links) if link.from_hf is not None for p in link.ours}  # a path's writer
  out = {} if out is None else out
  later = set()  # links checked once every param is converted
  order = sorted((k for k, link in enumerate(links) if link.from_hf is not None), key=lambda k: -size(links[k]))
  for k in order:
    link = links[k]
    name = source(link)
    value = tensors[name] if name is not None else np.zeros(link.absent, np.float32)
    for p, v in zip(link.ours, link.from_hf(value)):
      if last[p] == k:
        out[p] = v
    if any(last[p] != k for p in link.ours):
      later.add(k)
    elif link.hf in tensors or link.hf not in derived:  # (a derived tensor the file leaves out is not checked)
      check(link.hf, np.asarray(link.to_hf(*[out[p] for p in link.ours]), np.float32), value)
    del value
  for k, link in enumerate(links):
    if (link.from_hf is None or k in later) and not (link.hf not in tensors and link.hf in derived):
      check(link.hf, np.asarray(link.to_hf(*[out[p] for p in link.ours]), np.float32))
  for c in consts:
    check(c.hf, np.asarray(c.value, np.float32))
  return out
