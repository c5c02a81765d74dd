"""Language-model batches: token windows over a split's token stream.

Training (`WindowBatches`) draws windows of `context + 1` tokens at random offsets of the
stream; batch `k` is a pure function of `(seed, k)`, whatever the number of processes.
Evaluation (`window_eval_batches`) covers a split once in consecutive windows.

With packing (`data.packing=true`) each window keeps its document boundaries: tokens get
segment ids (1, 2, ... per document in the row) and positions that restart at each
document, so attention never crosses documents, and a causal LM's target that would be the
next document's first token becomes padding (weight 0). Without packing, windows run across
documents as one text (nanoGPT style).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxformer.data.pipeline import shard_rows
from jaxformer.data.sft import unmask
from jaxformer.data.tokenizer import PAD_ID


class ArrayStream:
  """An in-memory int32 token stream with the `PreparedText` interface (one document)."""

  def __init__(self, tokens: np.ndarray, masked: bool = False):
    self.tokens = np.asarray(tokens, np.int32)
    self.doc_starts = np.zeros(1, np.int64)
    self.masked = masked  # values are `sft.masked_ids` (fine-tuning rows' loss masks)

  def __len__(self) -> int:
    return len(self.tokens)

  def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
    """int32 `[len(starts), length]`: row i holds tokens `starts[i] .. starts[i] + length - 1`."""
    return self.tokens[np.asarray(starts)[:, None] + np.arange(length)]

  def read(self) -> np.ndarray:
    """The whole token stream, int32 `[num_tokens]`."""
    return self.tokens


def segments(doc_starts: np.ndarray, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids and positions of windows `[starts[i], starts[i] + length)` of a stream whose
  documents begin at the sorted offsets `doc_starts` (the first is 0).

  Returns:
    (int32 segment ids `[rows, length]`, 1 for the document the window starts in, +1 at
    each document start inside it; int32 positions `[rows, length]`, 0 at the window's
    start and at each document start).
  """
  offsets = np.asarray(starts, np.int64)[:, None] + np.arange(length)  # [rows, length]
  doc = np.searchsorted(doc_starts, offsets, side="right") - 1
  segment_ids = (doc - doc[:, :1] + 1).astype(np.int32)
  begin = np.maximum(doc_starts[doc], offsets[:, :1])
  return segment_ids, (offsets - begin).astype(np.int32)


def _batch(stream, starts: np.ndarray, context: int, shift: bool, packing: bool, pad_id: int) -> dict[str, np.ndarray]:
  w = stream.windows(starts, context + 1)
  counted = None
  if stream.masked:  # fine-tuning rows: targets the loss skips become padding (weight 0)
    w, counted = unmask(w)
  inputs, targets = w[:, :-1], (w[:, 1:] if shift else w[:, :-1]).copy()
  if counted is not None:
    targets[~(counted[:, 1:] if shift else counted[:, :-1])] = pad_id
  batch = {"inputs": inputs, "targets": targets}
  if packing:
    seg, pos = segments(stream.doc_starts, starts, context + 1)
    if shift:  # the last token of a document does not predict the next document's first
      targets[seg[:, 1:] != seg[:, :-1]] = pad_id
    batch.update(inputs_segment_ids=seg[:, :-1], inputs_positions=pos[:, :-1])
  return batch


class WindowBatches:
  """Training batches of random windows; `batches[k]` is this process's rows of global batch k:
  `inputs` int32 `[batch_size // process_count, context]`, `targets` the windows shifted one
  token ahead (`shift=True`, causal LM) or equal to `inputs` (masked LM), and with `packing`
  `inputs_segment_ids` / `inputs_positions`. Offsets come from `np.random.default_rng((seed, k))`.

  `stream`: a `PreparedText`, `ArrayStream` or int array of tokens; `pad_id`: the model's padding
  id (`model.pad_id`), the targets that get no loss.
  """

  def __init__(
    self,
    stream,
    batch_size: int,
    context: int,
    *,
    seed: int = 0,
    shift: bool = True,
    packing: bool = False,
    process_index: int = 0,
    process_count: int = 1,
    pad_id: int = PAD_ID,
  ):
    stream = ArrayStream(stream) if isinstance(stream, np.ndarray) else stream
    if len(stream) < context + 2:
      raise ValueError(
        f"the training split has {len(stream)} tokens, too few for windows of {context + 1}; "
        "lower data.max_length or add text"
      )
    self._stream = stream
    self._rows = shard_rows(batch_size, process_index, process_count)
    self.batch_size, self.context, self.seed, self.shift, self.packing = batch_size, context, seed, shift, packing
    self.pad_id = pad_id

  def __getitem__(self, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((self.seed, int(step)))
    starts = rng.integers(0, len(self._stream) - self.context, self.batch_size)[self._rows]
    return _batch(self._stream, starts, self.context, self.shift, self.packing, self.pad_id)

  def iterate(self, start_step: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """The batches of steps `start_step`, `start_step + 1`, ... (endless)."""
    step = start_step
    while True:
      yield self[step]
      step += 1


def window_eval_batches(
  stream,
  batch_size: int,
  context: int,
  *,
  shift: bool = True,
  packing: bool = False,
  process_index: int = 0,
  process_count: int = 1,
  pad_id: int = PAD_ID,
) -> list[dict[str, np.ndarray]]:
  """The whole split once, in consecutive non-overlapping windows of `context` tokens.

  With `shift`, window i has inputs `tokens[i*context : (i+1)*context]` and targets one
  token ahead, so every token but the first is predicted exactly once; without it
  (masked LM) inputs = targets = the window. The last window and the last batch are
  padded with `pad_id` (weight 0 in the loss). Returns this process's rows of each batch.
  """
  stream = ArrayStream(stream) if isinstance(stream, np.ndarray) else stream
  tokens = stream.read()
  n = len(tokens) - 1 if shift else len(tokens)  # predicted (or maskable) tokens
  num_windows = -(-n // context)
  padded_windows = -(-num_windows // batch_size) * batch_size
  masked = getattr(stream, "masked", False)
  fill = -max(pad_id, 0) - 1 if masked else pad_id  # a masked stream's padding: a token the loss skips
  flat = ArrayStream(np.full(padded_windows * context + 1, fill, np.int32), masked)
  flat.tokens[: len(tokens)] = tokens
  flat.doc_starts = stream.doc_starts
  rows = shard_rows(batch_size, process_index, process_count)
  starts = np.arange(padded_windows) * context
  out = []
  for s in range(0, padded_windows, batch_size):
    batch = _batch(flat, starts[s : s + batch_size][rows], context, shift, packing, pad_id)
    out.append(batch)
  return out
