"""Length-bucketed translation batches: step-indexed train stream, eval batches.

A split is tokenized once (:func:`tokenize_split`): source ids are the plain
encoding of the source plus the tokenizer's EOS (:func:`sentence_ids`), target ids
likewise (the model adds its start token when shifting right). Each batch has one bucket length ``L`` (the smallest
bucket >= the longest source/target in it); ``inputs`` and ``targets`` are
``int32 [rows, L]`` padded with the model's pad id (``pad_id``, ours 0). There are at most
``len(buckets)`` distinct shapes.

Training (:class:`TrainBatches`) is a pure function of the global step: epoch
``e = step // batches_per_epoch`` permutes the examples with
``np.random.default_rng((seed, e))``, sorts chunks of ``batch_size *
chunk_batches`` examples by length, cuts them into full batches and shuffles
the batch order. Resuming at step ``k`` is just starting at index ``k``. With
``group=k > 1`` (the loop's ``train.steps_per_call``) whole runs of ``k``
consecutive, similar-length batches are shuffled instead, aligned to global
steps that are multiples of ``k``, and each batch is padded to the longest
bucket of its run: a call's batches stack (:func:`stack_batches`) with little
extra padding, and a batch is the same whichever call it falls in.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from jaxformer.data.tokenizer import PAD_ID, Tokenizer

DEFAULT_BUCKETS = (12, 14, 16, 18, 20, 24, 32, 48, 64)
OVERLONG_MODES = ("drop", "truncate")


def sentence_ids(tokenizer, texts: Sequence[str], eos_id: int | None = None) -> tuple[list[list[int]], int]:
  """(ids of each text without special tokens, the EOS id that ends each side of a pair).

  A published tokenizer's post-processor may add its own EOS (T5, Marian) or [CLS]/[SEP]; a
  translation side is its plain encoding (`encode_plain` where the tokenizer has one) followed
  by exactly one EOS: `eos_id` (a model's `model.eos_id`), or when None the tokenizer's (ours: 3;
  Marian's: 0).

  Raises:
    ValueError: no EOS: none given and the tokenizer has none (one line).
  """
  eos = tokenizer.special_ids.eos if eos_id is None else eos_id
  if eos < 0:
    raise ValueError(
      "the tokenizer has no EOS token, which ends every translation source and target; "
      "use a tokenizer with an eos_token"
    )
  return plain_ids(tokenizer, texts), eos


def plain_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
  """Ids of each text without the special tokens a published tokenizer's post-processor adds
  (`encode_plain` where the tokenizer has one; ours add none)."""
  plain = getattr(tokenizer, "encode_plain", None)
  return [plain(t) for t in texts] if plain is not None else tokenizer.encode_batch(list(texts))


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
  """A tokenized parallel split.

  Attributes:
    inputs: per example an ``int32 [len_i]`` array ending with EOS.
    targets: per example an ``int32 [len_i]`` array ending with EOS.
    source_texts: raw source strings (aligned with ``inputs``).
    target_texts: raw reference strings (aligned with ``targets``).
    index: ``int64 [n]`` position of each example in the raw split.
    max_length: length limit the split was built with (tokens, incl. EOS).
    num_dropped: overlong pairs dropped. num_truncated: pairs truncated.
  """

  inputs: list[np.ndarray]
  targets: list[np.ndarray]
  source_texts: list[str]
  target_texts: list[str]
  index: np.ndarray
  max_length: int
  num_dropped: int = 0
  num_truncated: int = 0

  def __len__(self) -> int:
    return len(self.inputs)

  @property
  def lengths(self) -> np.ndarray:
    """``int32 [n]``: max(source length, target length) per example."""
    return np.array([max(len(s), len(t)) for s, t in zip(self.inputs, self.targets)], dtype=np.int32)

  def fetch(self, ids) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(source id arrays, target id arrays) of example ``ids``."""
    return [self.inputs[i] for i in ids], [self.targets[i] for i in ids]


def tokenize_split(
  tokenizer: Tokenizer,
  source_texts: Sequence[str],
  target_texts: Sequence[str],
  max_length: int,
  overlong: str = "truncate",
  target_tokenizer: Tokenizer | None = None,
  eos_id: int | None = None,
) -> TokenizedSplit:
  """Tokenize a parallel split and enforce ``max_length`` (tokens incl. EOS).

  ``target_tokenizer`` encodes the targets when the vocabularies are separate
  (default: ``tokenizer`` for both sides); ``eos_id`` ends both sides (the model's
  ``model.eos_id``; default each tokenizer's, see :func:`sentence_ids`).

  ``overlong="drop"`` removes pairs whose source or target is too long;
  ``"truncate"`` keeps the first ``max_length - 1`` tokens plus EOS.
  """
  if overlong not in OVERLONG_MODES:
    raise ValueError(f"overlong={overlong!r} is invalid; use one of {OVERLONG_MODES}.")
  if len(source_texts) != len(target_texts):
    raise ValueError(f"got {len(source_texts)} sources but {len(target_texts)} targets; pass aligned lists.")
  if max_length < 2:
    raise ValueError(f"max_length={max_length} is too small; use >= 2.")
  src_ids, src_eos = sentence_ids(tokenizer, source_texts, eos_id)
  tgt_ids, tgt_eos = sentence_ids(target_tokenizer or tokenizer, target_texts, eos_id)
  inputs, targets, keep = [], [], []
  dropped = truncated = 0
  for i, (s, t) in enumerate(zip(src_ids, tgt_ids)):
    if len(s) >= max_length or len(t) >= max_length:
      if overlong == "drop":
        dropped += 1
        continue
      truncated += 1
      s, t = s[: max_length - 1], t[: max_length - 1]
    inputs.append(np.array(s + [src_eos], dtype=np.int32))
    targets.append(np.array(t + [tgt_eos], dtype=np.int32))
    keep.append(i)
  return TokenizedSplit(
    inputs=inputs,
    targets=targets,
    source_texts=[source_texts[i] for i in keep],
    target_texts=[target_texts[i] for i in keep],
    index=np.array(keep, dtype=np.int64),
    max_length=max_length,
    num_dropped=dropped,
    num_truncated=truncated,
  )


def make_buckets(max_length: int, base: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
  """Buckets of ``base`` below ``max_length``, plus ``max_length`` last."""
  return tuple(b for b in base if b < max_length) + (int(max_length),)


def _check_buckets(buckets: Sequence[int], data) -> tuple[int, ...]:
  buckets = tuple(int(b) for b in buckets)
  if not buckets or any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
    raise ValueError(f"buckets={buckets} must be positive and strictly increasing; e.g. make_buckets(max_length).")
  longest = int(data.lengths.max()) if len(data) else 0
  if longest > buckets[-1]:
    raise ValueError(
      f"an example has {longest} tokens > the largest bucket {buckets[-1]}; make the last bucket = max_length."
    )
  return buckets


def shard_rows(batch_size: int, process_index: int, process_count: int) -> slice:
  """The rows `[start, stop)` of a global batch of `batch_size` that process `process_index` of
  `process_count` feeds.

  Raises:
    ValueError: a process index outside `[0, process_count)`, or a batch size that is not a
      positive multiple of `process_count`.
  """
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count}).")
  if batch_size <= 0 or batch_size % process_count:
    raise ValueError(
      f"batch_size={batch_size} is not a positive multiple of process_count={process_count}; change batch_size."
    )
  local = batch_size // process_count
  return slice(process_index * local, (process_index + 1) * local)


def _bucket_length(lengths: np.ndarray, ids: np.ndarray, buckets: tuple[int, ...]) -> int:
  """Smallest bucket >= the longest of ``lengths[ids]`` (``-1`` ids ignored)."""
  real = ids[ids >= 0]
  longest = int(lengths[real].max()) if len(real) else 1
  return next(b for b in buckets if b >= longest)


def _pack(data, ids: np.ndarray, length: int, pad_id: int) -> dict[str, np.ndarray]:
  """Pad examples ``ids`` (``-1`` = filler row) into ``[len(ids), length]`` with ``pad_id``."""
  inputs = np.full((len(ids), length), pad_id, dtype=np.int32)
  targets = np.full((len(ids), length), pad_id, dtype=np.int32)
  rows = np.flatnonzero(ids >= 0)
  sources, targets_ = data.fetch(ids[rows])
  for r, src, tgt in zip(rows, sources, targets_):
    inputs[r, : len(src)] = src
    targets[r, : len(tgt)] = tgt
  return {"inputs": inputs, "targets": targets}


class StepBatches:
  """Base of the step-indexed training streams: ``self[step]`` is a batch; subclasses set
  ``_prefetch`` and ``_num_threads`` (grain thread prefetch; 0 threads: none)."""

  def dataset(self, start_step: int = 0, num_steps: int | None = None):
    """A ``grain.MapDataset`` whose item ``i`` is batch ``start_step + i``."""
    import grain  # noqa: PLC0415  (imported when batches are read, so config checks stay light)

    stop = start_step + num_steps if num_steps is not None else 2**62
    return grain.MapDataset.range(start_step, stop).map(self.__getitem__)

  def iterate(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Batches ``start_step, start_step + 1, ...`` with thread prefetch."""
    ds = self.dataset(start_step, num_steps)
    if self._num_threads <= 0:
      return iter(ds)
    import grain  # noqa: PLC0415

    return iter(
      ds.to_iter_dataset(grain.ReadOptions(num_threads=self._num_threads, prefetch_buffer_size=max(1, self._prefetch)))
    )


class TrainBatches(StepBatches):
  """Infinite, deterministic stream of training batches indexed by step.

  ``batches[step]`` is this process's rows of global batch ``step``:
  ``{"inputs": int32 [batch_size // process_count, L], "targets": same}``.
  """

  def __init__(
    self,
    data,
    batch_size: int,
    buckets: Sequence[int] | None = None,
    *,
    seed: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    chunk_batches: int = 64,
    group: int = 1,
    prefetch: int = 4,
    num_threads: int = 1,
    pad_id: int = PAD_ID,
  ):
    """See class docstring. ``group``: batches per shuffled run (>= 1); ``pad_id``: the
    model's padding id (``model.pad_id``).
    ``prefetch``/``num_threads`` size grain's thread prefetch in
    :meth:`iterate` (``num_threads=0``: no threads)."""
    if group < 1:
      raise ValueError(f"group={group} must be >= 1; use train.steps_per_call >= 1.")
    if buckets is None:
      buckets = make_buckets(data.max_length)
    self._buckets = _check_buckets(buckets, data)
    self._rows = shard_rows(batch_size, process_index, process_count)
    if len(data) < batch_size:
      raise ValueError(
        f"the training split has {len(data)} examples, fewer than batch_size={batch_size}; lower batch_size."
      )
    self._data = data
    self.batch_size = batch_size
    self.seed = seed
    self.pad_id = pad_id
    self._chunk = batch_size * max(1, chunk_batches)
    self.group = group
    self._lengths = data.lengths
    self._prefetch = prefetch
    self._num_threads = num_threads
    self._lock = threading.Lock()
    self._plans: dict[int, np.ndarray] = {}

  @property
  def batches_per_epoch(self) -> int:
    """Full global batches per epoch (``len(data) // batch_size``)."""
    return len(self._data) // self.batch_size

  @property
  def buckets(self) -> tuple[int, ...]:
    """The padded lengths (tokens) a batch may have, ascending."""
    return self._buckets

  def _epoch_plan(self, epoch: int) -> np.ndarray:
    """``int64 [batches_per_epoch, batch_size]`` example ids of an epoch."""
    with self._lock:
      plan = self._plans.get(epoch)
      if plan is not None:
        return plan
    rng = np.random.default_rng((self.seed, epoch))
    order = rng.permutation(len(self._data))
    batches = []
    for start in range(0, len(order), self._chunk):
      chunk = order[start : start + self._chunk]
      chunk = chunk[np.argsort(self._lengths[chunk], kind="stable")]
      full = len(chunk) // self.batch_size * self.batch_size
      batches.extend(chunk[:full].reshape(-1, self.batch_size))
    order = _run_order(len(batches), self.group, epoch * self.batches_per_epoch, rng)
    plan = np.stack(batches)[order]
    with self._lock:
      if len(self._plans) >= 2:
        self._plans.pop(min(self._plans))
      self._plans[epoch] = plan
    return plan

  def _global_ids(self, step: int) -> np.ndarray:
    epoch, k = divmod(step, self.batches_per_epoch)
    return self._epoch_plan(epoch)[k]

  def __getitem__(self, step: int) -> dict[str, np.ndarray]:
    step = int(step)
    if step < 0:
      raise ValueError(f"step={step} must be >= 0.")
    # The bucket comes from the global batch so all processes agree on L.
    # With groups, every batch of a run gets the run's longest bucket: the
    # run stacks as is, and a step's shape (hence its dropout masks) does
    # not depend on where the loop's calls end.
    first = step - step % self.group
    longest = max(int(self._lengths[self._global_ids(s)].max()) for s in range(first, first + self.group))
    length = self._buckets[np.searchsorted(self._buckets, longest)]
    return _pack(self._data, self._global_ids(step)[self._rows], length, self.pad_id)


def _run_order(num_batches: int, group: int, first_step: int, rng: np.random.Generator) -> np.ndarray:
  """Order of an epoch's ``num_batches`` (length-sorted) batches, whose first
  one is global step ``first_step``: runs of ``group`` consecutive batches
  that start at steps divisible by ``group`` are shuffled; the partial runs
  at the epoch's two ends stay in place. ``group=1`` is a plain shuffle."""
  head = min(-first_step % group, num_batches)
  full = (num_batches - head) // group
  runs = np.arange(head, head + full * group).reshape(full, group)
  return np.concatenate(
    [np.arange(head), runs[rng.permutation(full)].reshape(-1), np.arange(head + full * group, num_batches)]
  )


def stack_batches(batches: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """``[n, rows, L]`` arrays (every key: ``inputs``, ``targets``, segment
  ids, ...) from ``n`` batches of ``[rows, L]`` (one jitted call's steps).

  Raises:
    ValueError: the batches differ in shape (a call spans two runs of a
      grouped ``TrainBatches``; end calls at multiples of the group).
  """
  shapes = {(b["inputs"].shape, b["targets"].shape) for b in batches}
  if len(shapes) != 1:
    raise ValueError(
      f"cannot stack batches of shapes {sorted(shapes)}; end each call within one run of train.steps_per_call steps."
    )
  return {key: np.stack([b[key] for b in batches]) for key in batches[0]}


def eval_batches(
  data,
  batch_size: int,
  buckets: Sequence[int] | None = None,
  *,
  sort_by_length: bool = True,
  process_index: int = 0,
  process_count: int = 1,
  pad_id: int = PAD_ID,
) -> list[dict[str, np.ndarray]]:
  """Every example exactly once, in fixed order, last batch padded.

  Returns a list of dicts: ``inputs``/``targets`` ``int32 [rows, L]`` and
  ``index`` ``int32 [rows]`` = position of the row's example in ``data``
  (``-1`` for all-PAD filler rows). ``rows = batch_size // process_count``;
  this process gets its slice of each global batch. With ``sort_by_length``
  the examples are ordered by length (less padding); use ``index`` to restore
  the original order. Rows are padded with ``pad_id`` (``model.pad_id``);
  filler rows are all padding, so token weights ``targets != pad_id`` ignore them.
  """
  if buckets is None:
    buckets = make_buckets(data.max_length)
  buckets = _check_buckets(buckets, data)
  rows = shard_rows(batch_size, process_index, process_count)
  order = np.arange(len(data))
  lengths = data.lengths
  if sort_by_length:
    order = order[np.argsort(lengths, kind="stable")]
  out = []
  for start in range(0, len(order), batch_size):
    ids = np.full(batch_size, -1, dtype=np.int64)
    chunk = order[start : start + batch_size]
    ids[: len(chunk)] = chunk
    local = ids[rows]
    # The bucket comes from the global batch so all processes agree on L.
    batch = _pack(data, local, _bucket_length(lengths, ids, buckets), pad_id)
    batch["index"] = local.astype(np.int32)
    out.append(batch)
  return out


def padding_fraction(batch: dict[str, np.ndarray], pad_id: int = PAD_ID) -> float:
  """Fraction of padding (``pad_id``) entries over ``inputs`` and ``targets`` together."""
  total = batch["inputs"].size + batch["targets"].size
  pads = np.count_nonzero(batch["inputs"] == pad_id) + np.count_nonzero(batch["targets"] == pad_id)
  return pads / total if total else 0.0
