"""Counter-based inverted dropout (paper section 5.4, "residual dropout") that XLA fuses.

`jax.random.bernoulli` lowers JAX's Threefry as a rolled loop whose loop-carried copies
XLA:CPU does not fuse, so dropout's random bits cost several times the elementwise work
they gate. Here Threefry-2x32 is written out round by round in plain uint32 ops: XLA fuses
the whole hash, the compare and the select into one elementwise kernel.

Each element's random word hashes its *global* position, counter (row, column pair), with
the leading dims flattened into rows: element (r, c) takes word c % 2 of the hash of
(r, c // 2), so the two words of one hash belong to columns 2j and 2j+1.
The counters come from `lax.broadcasted_iota`, so the mask is the same under any sharding
of x, and two counter words reach past 2^32 elements.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = 0x1BD11BDA  # Threefish key-schedule parity constant (Random123's SKEIN_KS_PARITY32)


def _rotl(x: jax.Array, r: int) -> jax.Array:
  return lax.bitwise_or(lax.shift_left(x, np.uint32(r)), lax.shift_right_logical(x, np.uint32(32 - r)))


def threefry_2x32(key: tuple[jax.Array, jax.Array], x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Threefry-2x32 with 20 rounds (Salmon et al. 2011; Random123's threefry2x32_20).

  Args:
    key: two uint32 words `(k0, k1)`, scalars or arrays broadcastable against x0 / x1.
    x0, x1: uint32 counter words of one (broadcastable) shape.

  Returns:
    `(y0, y1)`, uint32 of the broadcast shape.
  """
  k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
  x0, x1, k0, k1 = jnp.broadcast_arrays(jnp.asarray(x0, jnp.uint32), jnp.asarray(x1, jnp.uint32), k0, k1)
  ks = (k0, k1, lax.bitwise_xor(lax.bitwise_xor(k0, k1), np.uint32(_PARITY)))
  # lax ops on operands of one shape: each jnp operator would trace its own promotion and
  # broadcasting (the tiny train step's 12 hashes traced in 0.18 s of its 1.5 s that way, 0.11 s this way).
  x0, x1 = lax.add(x0, ks[0]), lax.add(x1, ks[1])
  for i in range(20):  # Python loop on purpose: unrolled, so XLA fuses it into one kernel
    x0 = lax.add(x0, x1)
    x1 = lax.bitwise_xor(_rotl(x1, _ROTATIONS[i % 8]), x0)
    if i % 4 == 3:  # key injection s after every 4 rounds, with the injection count added
      s = i // 4 + 1
      x0 = lax.add(x0, ks[s % 3])
      x1 = lax.add(lax.add(x1, ks[(s + 1) % 3]), np.uint32(s))
  return x0, x1


def _key_words(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The first two uint32 words of a typed PRNG key or a raw uint32 key."""
  if not isinstance(key, (jax.Array, np.ndarray)):
    raise TypeError(f"dropout key must be one jax.random.key or a raw uint32[2] key, got {type(key).__name__}")
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  if key.dtype != jnp.uint32 or key.ndim != 1 or key.shape[0] < 2:
    raise TypeError(f"dropout key must be one jax.random.key or a raw uint32[2] key, got {key.dtype}{list(key.shape)}")
  return key[0], key[1]


def _threshold(keep_prob: float) -> np.uint32:
  # A word w keeps its element iff w < threshold, which has probability threshold / 2^32.
  return np.uint32(min(max(round(keep_prob * 2.0**32), 0), 2**32 - 1))


def random_words(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """uint32 `shape` of Threefry words, one per element, from its global (row, column) position.

  Rows are the flattened leading dims (row-major), columns the last dim; the word of
  column c is word c % 2 of the hash of counter (row, c // 2) (an odd last dim leaves the
  last pair's second word unused). Each element computes its pair's hash itself (see below).
  Raises ValueError for 2^32 rows or columns or more (a counter word would wrap).
  """
  shape = tuple(shape)
  if len(shape) == 0:
    return random_words(key, (1,)).reshape(())
  *lead, cols = shape
  if math.prod(lead) >= 2**32 or cols >= 2**32:
    raise ValueError(f"dropout needs fewer than 2^32 rows and columns, got shape {shape}; reshape x to fit")
  row = jnp.zeros(shape, jnp.uint32)
  for d in range(len(lead)):  # row-major flat row index; < 2^32 so no wrap
    row = row * np.uint32(lead[d]) + lax.broadcasted_iota(jnp.uint32, shape, d)
  col = lax.broadcasted_iota(jnp.uint32, shape, len(lead))
  # Counters at x's own shape rather than hashing at [..., pairs] and interleaving the two
  # outputs: XLA:CPU cannot vectorize the interleave (stack + reshape), and in one fused
  # kernel it recomputes the pair's hash per element either way. Measured at [64, 32, 256]:
  # 0.45 ms this way, 0.75-0.9 ms interleaved, 1.4 ms jax.random.bernoulli. It also keeps
  # every op elementwise in x's shape, so sharding x on any dim needs no reshape.
  y0, y1 = threefry_2x32(_key_words(key), row, col >> np.uint32(1))
  return jnp.where((col & np.uint32(1)) == 0, y0, y1)


def _computed_once(keep: jax.Array, key: jax.Array) -> jax.Array:
  """`keep` (bool) unchanged, passed through an integer division by a 1 that only the run knows.

  XLA's fusion pass copies a cheap elementwise producer into every consumer, and it counts the
  hash's adds, shifts and xors as cheap; integer division it counts as expensive, so the
  divided mask is written once to a buffer that the consumers read. Without it each mask's
  hash (about 130 ops) is copied into every fusion that reads the residual stream, forward
  and backward: measured on XLA:CPU at the tests' compile flags, a 3+3-layer train step held
  47 copies of each hash, and its compile time grew with about the cube of the depth
  (2.6, 7.0, 14.5 and 30 s at 1 to 4 layers a side).
  """
  one = (_key_words(key)[0] >> np.uint32(31)) | np.uint32(1)  # 1, but not a constant XLA can fold
  return (keep.astype(jnp.uint8) // one.astype(jnp.uint8)).astype(bool)


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
  """Inverted dropout: each element kept with probability 1 - rate and scaled by 1 / (1 - rate).

  Args:
    x: float array of any shape (see `random_words` for how positions become counters).
    rate: Python float in [0, 1], the drop probability. 0 returns x without drawing; 1 zeros.
    key: a typed `jax.random.key` (any impl; its first two data words are used) or raw uint32[2].

  Returns:
    Array of x's shape and dtype: kept elements are `x * (1 / (1 - rate))`, the scale
    rounded to x's dtype (within an ulp of `x / (1 - rate)`; in float32 when the scale
    overflows x's dtype), dropped ones 0.

  Raises:
    TypeError: x is not floating point, or the key is not one key.
    ValueError: rate outside [0, 1].
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"dropout needs a floating-point x, got {x.dtype}; cast it first (x.astype(jnp.float32))")
  rate = float(rate)
  if not 0.0 <= rate <= 1.0:
    raise ValueError(f"dropout rate must be in [0, 1], got {rate}; pass a drop probability such as 0.1")
  if rate == 0.0:
    return x
  if rate == 1.0:
    return jnp.zeros_like(x)
  keep_prob = 1.0 - rate
  keep = _computed_once(random_words(key, x.shape) < _threshold(keep_prob), key)
  # Multiply by the reciprocal rounded to x's dtype: XLA:CPU turns a divide by a constant
  # into this anyway; written out, the kept values are defined exactly on every backend.
  with np.errstate(over="ignore"):
    scale = np.asarray(1.0 / keep_prob, x.dtype)
  if np.isfinite(scale):
    kept = x * scale
  else:  # a rate within an ulp of 1 in float16: the reciprocal overflows, x / (1 - rate) may not
    kept = (x.astype(jnp.float32) * np.float32(1.0 / keep_prob)).astype(x.dtype)
  return lax.select(keep, kept, jnp.zeros_like(x))


class Dropout(nn.Module):
  """`dropout` as a linen module drawing from the "dropout" RNG stream.

  Deterministic calls, and rate 0, return x unchanged without calling `make_rng`. A given
  `rng` key is used instead of the stream (the layer stacks pass per-layer keys, so the
  masks do not depend on the module path: see `models.layout`). Either way the key depends
  only on the module path and call count, or on `rng`, so an `nn.remat` recomputation
  redraws the same mask.
  """

  rate: float

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool, rng: jax.Array | None = None) -> jax.Array:
    """`x` with each element zeroed with probability `rate` and the rest scaled by 1 / (1 - rate)."""
    if deterministic or self.rate == 0.0:
      return x
    return dropout(x, self.rate, self.make_rng("dropout") if rng is None else rng)
