"""From tokens to the text a client sees: a continuation decoded behind its prompt, cut at the
first stop string, released piece by piece while streaming; and the text of each token for
log-probabilities (`token_logprobs`).

A continuation is decoded behind the end of its prompt (`context`) and that text cut off, so
word boundaries at the seam survive (a SentencePiece "▁we" after "Citizen:" reads " we"). While
streaming, the last `longest stop - 1` characters are held back until they cannot begin a
stop string, so the pieces always join to the final text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT = 8  # ids decoded before a token to find its text (`context`)


class Continuation:
  """The text of one request's tokens after `prompt_ids`, with `stop` strings.

  Args:
    tokenizer: decodes ids (stops at EOS, skips special tokens).
    prompt_ids: what the tokens continue (empty for a translation: the output stands alone).
    stop: strings that end the text (excluded from it).
  """

  def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
    self.tokenizer, self.prompt, self.stop = tokenizer, context(tokenizer, prompt_ids), tuple(stop)
    self.prompt_text = tokenizer.decode(self.prompt) if self.prompt else ""
    self.sent = 0  # characters released so far

  def text(self, tokens: Sequence[int]) -> str:
    """The decoded continuation, uncut."""
    return self.tokenizer.decode(self.prompt + list(tokens))[len(self.prompt_text) :]

  def cut(self, text: str) -> int | None:
    """Where the first stop string begins in `text`, or None."""
    found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
    return min(found) if found else None

  def stopped(self, request) -> bool:
    """Whether the request's text holds a stop string (the engine's `Request.stop` test)."""
    return bool(self.stop) and self.cut(self.text(request.tokens)) is not None

  def final(self, tokens: Sequence[int]) -> tuple[str, bool]:
    """(the text cut before its first stop string, whether a stop string cut it)."""
    text = self.text(tokens)
    at = self.cut(text)
    return (text, False) if at is None else (text[:at], True)

  def release(self, tokens: Sequence[int], done: bool) -> str:
    """The next piece to stream: the text not yet released that can no longer change (all of
    it, cut at a stop string, once `done`). Held back while not done: what could still begin
    a stop string, and a trailing U+FFFD (a character whose bytes have not all arrived)."""
    text, cut = self.final(tokens)
    if not done and not cut:
      if self.stop:
        text = text[: len(text) - max(len(s) for s in self.stop) + 1]
      text = text.rstrip("\ufffd")
    piece = text[self.sent :]
    self.sent = max(self.sent, len(text))
    return piece


def token_logprobs(tokenizer: Any, ids: Sequence[int], logprobs: Sequence, start: int, k: int) -> list[tuple]:
  """For each of `ids[start:]`, with `logprobs[j]` its `inference.request.TokenLogprob` (or None):
  (its text, its log-probability or None, [(text, log-probability)] of its `k` best
  alternatives, plus itself when it is not among them; None with no log-probability). A
  token's text is what it adds to the `CONTEXT` ids before it, decoded."""
  ids, out = list(ids), []
  for i in range(start, len(ids)):
    ids_before = context(tokenizer, ids[:i])
    before = tokenizer.decode(ids_before) if ids_before else ""

    def text(token, ids_before=ids_before, before=before):
      after = tokenizer.decode([*ids_before, token])
      return after[len(before) :] if after.startswith(before) else after

    entry = logprobs[i - start]
    own = text(ids[i])
    if entry is None:
      out.append((own, None, None))
      continue
    top = [(text(t), v) for t, v in entry.top[:k]]
    if ids[i] not in [t for t, _ in entry.top[:k]]:
      top.append((own, entry.logprob))
    out.append((own, entry.logprob, top))
  return out


def context(tokenizer: Any, ids: Sequence[int]) -> list[int]:
  """The ids to decode a following token behind: the last `CONTEXT` of `ids`, after their last
  EOS (decoding stops at EOS, so a chat's earlier turns would hide what follows)."""
  ids = list(ids)[-CONTEXT:]
  eos = tokenizer.special_ids.eos
  return ids[len(ids) - ids[::-1].index(eos) :] if eos >= 0 and eos in ids else ids
