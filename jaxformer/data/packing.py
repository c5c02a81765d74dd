"""Sequence packing of sentence pairs (`data.packing=true`), as in flax's wmt example and t5x.

Each row of a packed batch holds several pairs: the sources one after another in
`inputs`, the targets in `targets`, both `data.max_length` tokens long. Segment ids
(1, 2, ... per pair of the row, 0 on padding) and per-segment positions (0 at each pair's
first token) let the model keep attention within each pair (encoder self-attention,
decoder causal self-attention and cross-attention), so each pair's loss is what it would be
unpacked. The rows are packed by `binpack.pack_pairs` (first-fit decreasing, then rounds
that empty the emptiest rows and place their pairs again) over chunks of `PACK_CHUNK` of
the epoch's shuffled pairs.

The stream is a pure function of (seed, step): epoch `e` shuffles with
`np.random.default_rng((seed, e))`, packs, and shuffles the rows; every epoch has the
same number of batches (an epoch that packs into fewer rows repeats its first rows), so
step `k`'s batch does not depend on the number of processes or where a run resumed.
"""

from __future__ import annotations

import threading

import numpy as np

from jaxformer.data.binpack import pack_pairs
from jaxformer.data.pipeline import StepBatches, shard_rows
from jaxformer.data.tokenizer import PAD_ID

PACK_CHUNK = 8192  # pairs packed together; bounds the packing's work per pair, so an epoch packs in linear time


def pack_rows(
  sources: list[list[np.ndarray]], targets: list[list[np.ndarray]], length: int, pad_id: int = PAD_ID
) -> dict[str, np.ndarray]:
  """A packed batch from per-row lists of source / target id arrays, padded with `pad_id`.

  Returns int32 `[rows, length]` arrays: `inputs`, `targets`, `inputs_segment_ids`,
  `targets_segment_ids` (k for the row's k-th pair, 0 on padding), `inputs_positions`,
  `targets_positions` (0 at each pair's first token, 0 on padding).
  """
  out = {
    k: np.zeros((len(sources), length), np.int32)
    for k in ("inputs", "targets", "inputs_segment_ids", "targets_segment_ids", "inputs_positions", "targets_positions")
  }
  out["inputs"][:] = out["targets"][:] = pad_id
  for r, (row_src, row_tgt) in enumerate(zip(sources, targets)):
    for side, row in (("inputs", row_src), ("targets", row_tgt)):
      at = 0
      for k, ids in enumerate(row, 1):
        out[side][r, at : at + len(ids)] = ids
        out[f"{side}_segment_ids"][r, at : at + len(ids)] = k
        out[f"{side}_positions"][r, at : at + len(ids)] = np.arange(len(ids))
        at += len(ids)
  return out


class PackedBatches(StepBatches):
  """Infinite, deterministic stream of packed training batches indexed by step.

  `batches[step]` is this process's rows of global batch `step`: the arrays of
  `pack_rows`, `[batch_size // process_count, length]`. `data` is a prepared or tokenized
  split (`lengths`, `side_lengths` or `inputs`/`targets`, `fetch`).
  """

  def __init__(
    self,
    data,
    batch_size: int,
    length: int,
    *,
    seed: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    prefetch: int = 4,
    num_threads: int = 1,
    pad_id: int = PAD_ID,
  ):
    self._data, self.batch_size, self.length, self.seed, self.pad_id = data, batch_size, length, seed, pad_id
    self._rows = shard_rows(batch_size, process_index, process_count)
    sides = getattr(data, "side_lengths", None)
    if sides is None:
      sides = np.array([[len(s), len(t)] for s, t in zip(data.inputs, data.targets)], np.int32).reshape(-1, 2)
    self._src, self._tgt = sides[:, 0], sides[:, 1]
    self._prefetch, self._num_threads = prefetch, num_threads
    self._lock = threading.Lock()
    self._plans: dict[int, list[list[int]]] = {}
    self.batches_per_epoch = len(self._epoch_rows(0)) // batch_size
    if self.batches_per_epoch < 1:
      raise ValueError(
        f"the training split packs into {len(self._epoch_rows(0))} rows, fewer than "
        f"batch_size={batch_size}; lower train.batch_size"
      )

  def _epoch_rows(self, epoch: int) -> list[list[int]]:
    with self._lock:
      if epoch in self._plans:
        return self._plans[epoch]
    rng = np.random.default_rng((self.seed, epoch))
    order = rng.permutation(len(self._src))
    rows: list[list[int]] = []
    for start in range(0, len(order), PACK_CHUNK):
      chunk = order[start : start + PACK_CHUNK]
      rows += [[int(chunk[i]) for i in row] for row in pack_pairs(self._src[chunk], self._tgt[chunk], self.length)]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    with self._lock:
      if len(self._plans) >= 2:
        self._plans.pop(min(self._plans))
      self._plans[epoch] = rows
    return rows

  def global_rows(self, step: int) -> list[list[int]]:
    """The pair ids of each row of global batch `step`."""
    epoch, k = divmod(int(step), self.batches_per_epoch)
    rows = self._epoch_rows(epoch)
    picked = [rows[(k * self.batch_size + r) % len(rows)] for r in range(self.batch_size)]
    return picked

  def __getitem__(self, step: int) -> dict[str, np.ndarray]:
    rows = self.global_rows(step)[self._rows]
    flat = [i for row in rows for i in row]
    sources, targets = self._data.fetch(np.asarray(flat, np.int64))
    it_s, it_t = iter(sources), iter(targets)
    return pack_rows(
      [[next(it_s) for _ in row] for row in rows], [[next(it_t) for _ in row] for row in rows], self.length, self.pad_id
    )
