"""Host-side bookkeeping of KV-cache pages: which pages of a pool are free, and the page
table of each batch slot.

Page 0 is the null page: it is never handed out, idle table entries point at it, and the
cache writes padding tokens there (`layers.kv_cache`), so it is never read as valid.
"""

from __future__ import annotations

import numpy as np


class PageAllocator:
  """Free list over pages 1..num_pages-1 of one pool, plus a page table `[num_slots,
  pages_per_slot]` (int32, 0 = no page) for the slots of a running batch."""

  def __init__(self, num_pages: int, page_size: int, num_slots: int, pages_per_slot: int):
    if num_pages < 2 or page_size < 1:
      raise ValueError(
        f"a page pool needs at least 2 pages (page 0 is the null page) of >= 1 token, "
        f"got {num_pages} pages of {page_size}"
      )
    self.num_pages, self.page_size = num_pages, page_size
    self.free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
    self.table = np.zeros((num_slots, pages_per_slot), np.int32)
    self.used = np.zeros((num_slots,), np.int32)  # pages held per slot

  @property
  def pages_in_use(self) -> int:
    """Pages held by slots (the null page 0 not counted)."""
    return self.num_pages - 1 - len(self.free)

  def pages_for(self, tokens: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // self.page_size)

  def reserve(self, slot: int, tokens: int) -> bool:
    """Makes `slot` hold pages for `tokens` tokens in all; False (nothing taken) if the pool
    has too few free pages or the slot's table is too short."""
    need = self.pages_for(tokens) - int(self.used[slot])
    if need <= 0:
      return True
    if need > len(self.free) or self.used[slot] + need > self.table.shape[1]:
      return False
    for _ in range(need):
      self.table[slot, self.used[slot]] = self.free.pop()
      self.used[slot] += 1
    return True

  def release(self, slot: int) -> None:
    """Returns the pages of `slot` to the pool and points its table at the null page."""
    self.free.extend(int(p) for p in self.table[slot, : self.used[slot]][::-1])
    self.table[slot] = 0
    self.used[slot] = 0
