"""The shapes of OpenAI answers: choices, log-probabilities, usage and stream chunks, built from
engine requests. Nothing here decides anything: the tokens, their log-probabilities and the
finish reasons come from the engine, the text from `serve.text`.

A completion's `logprobs` is `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`
(with `echo`, the prompt's tokens first; its first token has no log-probability, null); a
chat's is `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`. `text_offset`
counts characters into the choice's `text`.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from jaxformer.inference.request import Request
from jaxformer.serve.text import Continuation, token_logprobs


@dataclasses.dataclass
class Job:
  """One choice: its engine request, the ids its output follows (the prompt; none for a
  translation), the echoed prompt text (None without echo) and the decoded text. While
  streaming: whether the echo went out (`echo_sent`); `logged` generated tokens (and the
  prompt's, `prompt_logged`) have had their log-probabilities reported, covering `offset`
  characters."""

  index: int
  prompt_ids: list[int]
  echo: str | None
  request: Request
  text: Continuation
  logged: int = 0
  echo_sent: bool = False
  prompt_logged: bool = False
  offset: int = 0


class Answer:
  """The id, creation time and model name that every part of one answer carries."""

  def __init__(self, model: str, chat: bool):
    self.chat = chat
    self.head = {
      "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
      "object": "chat.completion" if chat else "text_completion",
      "created": int(time.time()),
      "model": model,
    }

  def whole(self, jobs: list[Job], tokenizer: Any, k: int | None, prompts: list[list[int]]) -> dict:
    """The non-streamed answer: every choice, and the usage."""
    choices = []
    for job in jobs:
      text, cut = job.text.final(job.request.tokens)
      text = (job.echo or "") + text
      logprobs = None if k is None else self.logprobs(job, tokenizer, k, len(text) if cut else None)
      choice = {"index": job.index, "logprobs": logprobs, "finish_reason": job.request.finish_reason}
      choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
      choices.append(choice)
    return {**self.head, "choices": choices, "usage": usage(jobs, prompts)}

  def logprobs(self, job: Job, tokenizer: Any, k: int, limit: int | None = None) -> dict:
    """The log-probabilities of `job`'s generated tokens from `job.logged` on (with an echo, the
    prompt's first, once), those whose text starts before character `limit` only."""
    r = job.request
    values = r.token_logprobs[job.logged : len(r.tokens)]  # the engine appends a token before its log-probability
    ids = job.prompt_ids + r.tokens[: job.logged + len(values)]
    start = len(job.prompt_ids) + job.logged
    if job.echo is not None and not job.prompt_logged:
      values, start, job.prompt_logged = list(r.prompt_token_logprobs) + values, 0, True
    entries = token_logprobs(tokenizer, ids, values, start, k)
    offsets = []
    for text, _, _ in entries:
      offsets.append(job.offset)
      job.offset += len(text)
    if limit is not None:
      entries, offsets = [e for e, o in zip(entries, offsets) if o < limit], [o for o in offsets if o < limit]
    job.logged = len(ids) - len(job.prompt_ids)
    if self.chat:
      return {
        "content": [
          {
            "token": t,
            "logprob": v,
            "bytes": list(t.encode()),
            "top_logprobs": [{"token": a, "logprob": w, "bytes": list(a.encode())} for a, w in top],
          }
          for t, v, top in entries
        ]
      }
    return {
      "tokens": [t for t, _, _ in entries],
      "token_logprobs": [v for _, v, _ in entries],
      "top_logprobs": [None if top is None else _by_text(top) for _, _, top in entries],
      "text_offset": offsets,
    }

  def chunk(
    self,
    index: int,
    piece: str | None = None,
    logprobs: dict | None = None,
    finish_reason: str | None = None,
    role: bool = False,
  ) -> str:
    """One stream event for choice `index`: a text piece (chat: a delta, with the role first)."""
    if self.chat:
      delta = {"role": "assistant", "content": ""} if role else ({} if piece is None else {"content": piece})
      choice = {"index": index, "delta": delta}
    else:
      choice = {"index": index, "text": piece or ""}
    choice.update({"logprobs": logprobs, "finish_reason": finish_reason})
    return event(
      {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion", "choices": [choice]}
    )

  def usage_chunk(self, jobs: list[Job], prompts: list[list[int]]) -> str:
    """The last event of a stream with `stream_options.include_usage`: no choices, the usage."""
    return event(
      {
        **self.head,
        "object": "chat.completion.chunk" if self.chat else "text_completion",
        "choices": [],
        "usage": usage(jobs, prompts),
      }
    )


def _by_text(top: list[tuple[str, float]]) -> dict[str, float]:
  """Alternatives keyed by their text, most probable first; tokens of the same text keep the best."""
  out: dict[str, float] = {}
  for text, value in top:
    out.setdefault(text, value)
  return out


def usage(jobs: list[Job], prompts: list[list[int]]) -> dict:
  """Prompt tokens (each prompt once, whatever `n`), generated tokens and their total."""
  prompt = sum(len(p) for p in prompts)
  completion = sum(len(j.request.tokens) for j in jobs)
  return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def event(payload: Any) -> str:
  """One server-sent event: `data: <json>` and a blank line."""
  return f"data: {json.dumps(payload)}\n\n"


DONE = "data: [DONE]\n\n"
