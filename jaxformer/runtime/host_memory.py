"""Host memory of a training process under glibc: fewer malloc arenas, freed memory given back.

XLA compiles and runs on many threads (the compile pool, the intra-op pool, grain's and
TensorStore's readers: about 120 in a `multi30k_small` run). glibc gives threads their own
malloc arenas, up to eight per core, and memory freed in one arena is reused only by the
threads using it, so each compile of a new batch shape left several hundred MiB that were free
but still resident (measured in benchmarks/results/2026-12-03-main-job-memory.md). Allocation
order and sizes do not change what is computed, so neither setting changes any result.
Elsewhere (musl, macOS) both functions do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_ARENA_MAX = -8  # mallopt's parameter number (glibc malloc.h)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
  """The C library if it is glibc (it has `malloc_trim`), else None."""
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name)
    libc.malloc_trim, libc.mallopt  # noqa: B018  (glibc only)
  except (OSError, TypeError, AttributeError):
    return None
  return libc


def limit_malloc_arenas(count: int = 2) -> bool:
  """Caps glibc's malloc arenas at `count` (as `MALLOC_ARENA_MAX` would), unless the
  environment sets `MALLOC_ARENA_MAX` itself. Threads started afterwards share those arenas;
  call it before JAX starts its thread pools.

  Returns:
    Whether the cap was applied (False: not glibc, or the environment chose).
  """
  libc = _glibc()
  if libc is None or "MALLOC_ARENA_MAX" in os.environ:
    return False
  return bool(libc.mallopt(M_ARENA_MAX, count))


def release_free_memory() -> bool:
  """Returns the free pages of every malloc arena to the operating system (`malloc_trim(0)`).
  Call it after a compile or an evaluation, whose temporaries were freed.

  Returns:
    Whether memory was given back (False: none, or not glibc).
  """
  libc = _glibc()
  return bool(libc.malloc_trim(0)) if libc is not None else False
