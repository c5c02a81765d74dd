"""Packing sentence pairs into rows: two-sided bin packing (`data.packing=true`).

A row holds pairs whose sources fit in `length` tokens and whose targets fit in `length`
tokens. The problem is two-dimensional: a row whose sources are full wastes the room
left on its target side, and the reverse.

`first_fit` is first-fit decreasing: pairs longest first (source + target tokens), each
into the first row with room on both sides. `pack_pairs` starts from it and repairs it by
emptying the rows with the most room, in the manner of the local optimisation of
Falkenauer's grouping genetic algorithm for bin packing (J. Heuristics 2, 1996). Each
round:

1. the `pool_rows` rows with the most free room are emptied into a pool;
2. each pooled pair, largest first, goes into the row where it fits and leaves the least
   room, or else takes the place of a smaller pair in the row where it fits in that pair's
   stead and leaves the least room; the smaller pair goes back to the pool;
3. what is left in the pool is packed by first fit into new rows.

Rows thus fill with larger pairs and the pool keeps the small ones, which fit the gaps
later rounds open. The packing with the fewest rows is kept; the search stops after
`rounds` rounds or at the first round that moves no pair, so the rows are a pure function
of the lengths. Sizes and free room weigh the side with more tokens double: it sets the
number of rows, while the other side has slack to spare. On Multi30k's training split
(29,000 pairs, 64-token rows, chunks of 8,192 pairs as `PackedBatches` packs them) first
fit takes 7,537 rows (3.9% padding) and `pack_pairs` 7,393 (2.1%), 0.3% above the lower
bound the target side sets (7,370 rows).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 40  # repair rounds at most
POOL_ROWS = 32  # rows emptied into the pool each round


def first_fit(src_lengths: np.ndarray, tgt_lengths: np.ndarray, length: int) -> list[list[int]]:
  """Rows of pair indices whose sources and targets each fit in `length` tokens.

  Args:
    src_lengths, tgt_lengths: int `[n]`, tokens of each pair's source and target.
    length: the row length on each side, in tokens.

  Returns:
    Rows as lists of pair indices, every pair in exactly one row; first-fit decreasing:
    pairs are placed longest first (source + target tokens), each into the first row with
    room on both sides.

  Raises:
    ValueError: a pair is longer than `length` on either side.
  """
  if len(src_lengths) and max(src_lengths.max(), tgt_lengths.max()) > length:
    raise ValueError(f"a pair is longer than the packed row length {length}; prepare with data.max_length <= it")
  order = np.argsort(-(src_lengths.astype(np.int64) + tgt_lengths), kind="stable")
  room = np.empty((len(order), 2), np.int64)  # free tokens of each open row: source, target
  rows: list[list[int]] = []
  for i in order:
    need = (src_lengths[i], tgt_lengths[i])
    fits = np.flatnonzero((room[: len(rows), 0] >= need[0]) & (room[: len(rows), 1] >= need[1]))
    if len(fits):
      r = fits[0]
      rows[r].append(int(i))
      room[r] -= need
    else:
      room[len(rows)] = (length - need[0], length - need[1])
      rows.append([int(i)])
  return rows


def pack_pairs(
  src_lengths: np.ndarray, tgt_lengths: np.ndarray, length: int, *, rounds: int = ROUNDS, pool_rows: int = POOL_ROWS
) -> list[list[int]]:
  """Rows of pair indices as `first_fit` gives, repaired into fewer rows (see the module docstring).

  Args:
    src_lengths, tgt_lengths: int `[n]`, tokens of each pair's source and target.
    length: the row length on each side, in tokens.
    rounds: repair rounds at most (0: first fit alone).
    pool_rows: rows emptied into the pool each round.

  Returns:
    Rows as lists of pair indices, every pair in exactly one row, each row's sources and
    targets within `length` tokens; at most as many rows as `first_fit`, and a deterministic
    function of the arguments.

  Raises:
    ValueError: a pair is longer than `length` on either side.
  """
  best = first_fit(src_lengths, tgt_lengths, length)
  s, t = np.asarray(src_lengths, np.int64), np.asarray(tgt_lengths, np.int64)
  ws, wt = (2, 1) if s.sum() > t.sum() else (1, 2)
  size, never = ws * s + wt * t, np.iinfo(np.int64).max
  # Up to one row per pair. An empty row's room is -1 on both sides, so nothing goes into it;
  # so is a pooled pair's spare room (its row's room without it), so nothing takes its place.
  rows = [list(row) for row in best] + [[] for _ in range(len(s) - len(best))]
  row_of = np.zeros_like(s)
  room_s, room_t, spare_s, spare_t = (np.full_like(s, -1) for _ in range(4))
  room_w, spare_w = np.zeros_like(s), np.zeros_like(s)  # weighted: ws * room_s + wt * room_t

  def update(r: int) -> None:
    row = rows[r]
    row_of[row] = r
    room_s[r], room_t[r] = length - s[row].sum(), length - t[row].sum()
    spare_s[row], spare_t[row] = room_s[r] + s[row], room_t[r] + t[row]
    room_w[r], spare_w[row] = ws * room_s[r] + wt * room_t[r], ws * spare_s[row] + wt * spare_t[row]

  for r in range(len(best)):
    update(r)
  used = len(best)  # rows[used:] have always been empty
  for _ in range(rounds):
    emptied = np.argsort(-room_w[:used], kind="stable")[:pool_rows]
    pool = [p for r in emptied for p in rows[r]]
    for r in emptied:
      rows[r] = []
    room_s[emptied] = room_t[emptied] = room_w[emptied] = spare_s[pool] = spare_t[pool] = -1
    moved, left = False, []
    for p in sorted(pool, key=lambda p: -size[p]):
      fit = np.where((room_s[:used] >= s[p]) & (room_t[:used] >= t[p]), room_w[:used], never)
      r = int(np.argmin(fit))
      if fit[r] == never:  # p takes the place of a smaller pair q, which goes back to the pool
        swap = np.where((spare_s >= s[p]) & (spare_t >= t[p]) & (size < size[p]), spare_w, never)
        q = int(np.argmin(swap))
        if swap[q] == never:
          left.append(p)
          continue
        r = int(row_of[q])
        rows[r].remove(q)
        spare_s[q] = spare_t[q] = -1
        left.append(q)
      rows[r].append(p)
      update(r)
      moved = True
    free = [r for r in range(used) if not rows[r]]
    for k, new in enumerate(first_fit(s[left], t[left], length)):
      r = free[k] if k < len(free) else used
      rows[r] = [left[j] for j in new]
      update(r)
      used = max(used, r + 1)
    if sum(map(bool, rows[:used])) < len(best):
      best = [list(row) for row in rows[:used] if row]
    if not moved:
      break
  return best
