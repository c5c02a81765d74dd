"""glibc's arena cap and malloc_trim (runtime/host_memory.py): applied on glibc, left to the environment when it
chooses, and given-back memory leaves the data intact."""

import numpy as np
import pytest

from jaxformer.runtime import host_memory

glibc = pytest.mark.skipif(host_memory._glibc() is None, reason="needs glibc")


@glibc
def test_arena_cap_applied_unless_the_environment_sets_it(monkeypatch):
  monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
  assert host_memory.limit_malloc_arenas(2) is True
  monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
  assert host_memory.limit_malloc_arenas(2) is False


@glibc
def test_release_gives_back_freed_heap_and_keeps_live_data():
  kept = [np.full(1000, i, np.int64) for i in range(2000)]  # small blocks: malloc'd on the heap, not mmap'd
  freed = [np.ones(1000, np.int64) for _ in range(20000)]
  del freed
  assert host_memory.release_free_memory() is True  # 160 MB of freed heap blocks: some pages go back
  assert all(int(a.sum()) == 1000 * i for i, a in enumerate(kept))


def test_without_glibc_both_do_nothing(monkeypatch):
  monkeypatch.setattr(host_memory, "_glibc", lambda: None)
  assert host_memory.limit_malloc_arenas() is False
  assert host_memory.release_free_memory() is False
