"""Start-up summary: every parameter with its shape, logical axes, PartitionSpec and
per-device bytes, plus per-device totals for parameters and optimizer state."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxformer.train.state import TrainState


def per_device_bytes(abstract: Any, shardings: Any) -> int:
  """Bytes one device holds for a tree of ShapeDtypeStructs under `shardings`.

  With several devices holding different shard sizes (uneven splits are rejected
  earlier), this is the size of one shard per leaf.
  """
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
    shard = sharding.shard_shape(leaf.shape)
    total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return total


def total_bytes(abstract: Any) -> int:
  """Bytes of a tree of ShapeDtypeStructs held once, unsharded."""
  return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract))


def _human(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
    n /= 1024
  raise AssertionError("unreachable")


def sharding_rows(abstract: TrainState, logical: TrainState, shardings: TrainState) -> list[dict[str, Any]]:
  """One row per parameter: name, shape, logical axes, mesh PartitionSpec, per-device bytes."""
  rows = []
  flat = jax.tree_util.tree_flatten_with_path(abstract.params)[0]
  specs = jax.tree.leaves(logical.params, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  named = jax.tree.leaves(shardings.params)
  for (path, leaf), spec, sharding in zip(flat, specs, named):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    rows.append(
      {
        "name": name,
        "shape": tuple(leaf.shape),
        "logical": tuple(spec),
        "spec": tuple(sharding.spec),
        "bytes_per_device": per_device_bytes(leaf, sharding),
      }
    )
  return rows


def format_summary(abstract: TrainState, logical: TrainState, shardings: TrainState, mesh, table: bool = True) -> str:
  """The per-device totals as text (two lines), after the parameter table when `table`."""
  rows = sharding_rows(abstract, logical, shardings)
  lines = []
  if table:
    header = ("parameter", "shape", "logical axes", "PartitionSpec", "per device")
    cells = [header] + [
      (r["name"], str(r["shape"]), str(r["logical"]), str(r["spec"]), _human(r["bytes_per_device"])) for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in cells]
  params = per_device_bytes(abstract.params, shardings.params)
  opt = per_device_bytes(abstract.opt_state, shardings.opt_state)
  num_params = sum(int(np.prod(r["shape"])) for r in rows)
  lines += [
    f"mesh {dict(mesh.shape)} over {mesh.devices.size} devices; {num_params:,} parameters",
    f"per device: params {_human(params)} (unsharded {_human(total_bytes(abstract.params))}), "
    f"optimizer state {_human(opt)} (unsharded {_human(total_bytes(abstract.opt_state))})",
  ]
  return "\n".join(lines)
