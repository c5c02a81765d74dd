"""The fields of an OpenAI completions or chat request, checked and turned into engine settings.

Sampling follows the OpenAI API: `temperature` in [0, 2] (default 1; 0 is greedy), `top_p` in
(0, 1], `top_k` (an extra field; -1 or 0: off), `seed` (default: a fresh one per request, so
samples differ from call to call; greedy ignores it), `n` samples per prompt, `stop` (a string
or a list of up to 4). A translation model decodes greedily unless `temperature` is given.
Every mistake raises `BadRequest` naming the field (`param`).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Any

from jaxformer.inference.request import MAX_LOGPROBS
from jaxformer.serve.errors import BadRequest

MAX_STOPS = 4
MAX_N = 16
UNSUPPORTED = {
  "suffix": None,
  "logit_bias": None,
  "frequency_penalty": 0,
  "presence_penalty": 0,
  "tools": None,
  "functions": None,
  "response_format": None,
}


@dataclasses.dataclass(frozen=True)
class Options:
  """A request's generation settings (see the module docstring); `temperature` None: greedy."""

  max_tokens: int | None
  temperature: float | None
  top_p: float | None
  top_k: int | None
  seed: int
  n: int
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool
  logprobs: int | None
  echo: bool

  def engine_fields(self) -> dict[str, Any]:
    """The `inference.request.Request` sampling fields: greedy when `temperature` is None."""
    if self.temperature is None:
      return {"seed": self.seed}
    return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": self.seed}


def get(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
  """`body[name]` (`default` when absent or null), which must be of `kind` (int is not bool;
  an int is taken where a float is expected).

  Raises:
    BadRequest: a value of another type.
  """
  value = body.get(name)
  if value is None:
    return default
  kinds = kind if isinstance(kind, tuple) else (kind,)
  if float in kinds and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
    names = " or ".join(
      {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "an object", list: "a list"}[k]
      for k in kinds
    )
    raise BadRequest(f'"{name}" must be {names}, got {_short(value)}', name)
  return value


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 40 else text[:37] + "..."


def _in_range(name: str, value: float | None, low: float, high: float, low_open: bool = False) -> None:
  if value is None:
    return
  if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    raise BadRequest(f'"{name}" must be in {interval}, got {value}', name)


def options(body: dict, *, chat: bool, translation: bool = False, max_queue: int = MAX_N) -> Options:
  """The generation settings of a completions (`chat` False) or chat request body.

  Raises:
    BadRequest: a field of the wrong type or out of range, or one this server does not support.
  """
  for name, neutral in UNSUPPORTED.items():
    if body.get(name) not in (None, neutral, {}, []):
      raise BadRequest(f'"{name}" is not supported by this server; leave it out', name)
  temperature = get(body, "temperature", float, None if translation else 1.0)
  _in_range("temperature", temperature, 0.0, 2.0)
  top_p = get(body, "top_p", float)
  _in_range("top_p", top_p, 0.0, 1.0, low_open=True)
  top_k = get(body, "top_k", int)
  if top_k is not None and top_k < -1:
    raise BadRequest(f'"top_k" must be -1 or 0 (off) or a positive integer, got {top_k}', "top_k")
  seed = get(body, "seed", int)
  if seed is not None and not 0 <= seed < 2**32:
    raise BadRequest(f'"seed" must be an integer in [0, 2**32), got {seed}', "seed")
  n = get(body, "n", int, 1)
  if not 1 <= n <= min(MAX_N, max_queue):
    raise BadRequest(f'"n" must be in [1, {min(MAX_N, max_queue)}], got {n}', "n")
  best_of = get(body, "best_of", int)
  if best_of is not None and best_of != n:
    raise BadRequest(f'"best_of" ({best_of}) other than "n" is not supported; leave it out', "best_of")
  stream = get(body, "stream", bool, False)
  stream_options = get(body, "stream_options", dict)
  if stream_options is not None and not stream:
    raise BadRequest('"stream_options" needs "stream": true', "stream_options")
  include_usage = get(stream_options or {}, "include_usage", bool, False)
  logprobs, echo = _logprobs(body, chat), False if chat else get(body, "echo", bool, False)
  max_tokens = get(body, "max_tokens", int)
  if chat and max_tokens is None:
    max_tokens = get(body, "max_completion_tokens", int)
  if max_tokens is not None and max_tokens < 1:
    raise BadRequest(f'"max_tokens" must be >= 1, got {max_tokens}', "max_tokens")
  greedy = temperature is None or temperature == 0.0 or top_k == 1
  return Options(
    max_tokens=max_tokens,
    temperature=None if greedy else temperature,
    top_p=None if top_p is None or top_p == 1.0 else top_p,
    top_k=None if top_k is None or top_k <= 0 else top_k,
    seed=secrets.randbelow(2**32) if seed is None else seed,
    n=n,
    stop=_stops(body),
    stream=stream,
    include_usage=include_usage,
    logprobs=logprobs,
    echo=echo,
  )


def _logprobs(body: dict, chat: bool) -> int | None:
  """Alternatives per token to report, or None: completions' `logprobs` (an integer), chat's
  `logprobs` (a boolean) with `top_logprobs`."""
  if chat:
    top = get(body, "top_logprobs", int)
    if not get(body, "logprobs", bool, False):
      if top is not None:
        raise BadRequest('"top_logprobs" needs "logprobs": true', "top_logprobs")
      return None
    count, name = (0 if top is None else top), "top_logprobs"
  else:
    count, name = get(body, "logprobs", int), "logprobs"
    if count is None:
      return None
  if not 0 <= count <= MAX_LOGPROBS:
    raise BadRequest(f'"{name}" must be in [0, {MAX_LOGPROBS}], got {count}', name)
  return count


def _stops(body: dict) -> tuple[str, ...]:
  stop = get(body, "stop", (str, list), [])
  stops = [stop] if isinstance(stop, str) else stop
  if len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
    raise BadRequest(f'"stop" must be a non-empty string or a list of at most {MAX_STOPS} of them', "stop")
  return tuple(stops)


def prompts(body: dict, vocab_size: int, pad_id: int) -> list[str | list[int]]:
  """The completions request's prompts: texts, or token-id lists (`prompt` may be a string, a
  list of strings, a list of ids or a list of id lists, as the OpenAI API allows).

  Raises:
    BadRequest: anything else, an empty prompt, or an id outside the vocabulary or equal to
      `pad_id` (the model's padding, which it never reads as a token).
  """
  prompt = body.get("prompt")
  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
    prompt = [prompt]
  if not isinstance(prompt, list) or not prompt:
    raise BadRequest(f'"prompt" must be a string, a list of strings, or token ids; got {_short(prompt)}', "prompt")
  out = []
  for i, p in enumerate(prompt):
    if isinstance(p, str):
      if not p:
        raise BadRequest(f"prompt {i} is empty; send at least one character", "prompt")
      out.append(p)
    elif isinstance(p, list) and p and all(_is_id(t) for t in p):
      bad = [t for t in p if not 0 <= t < vocab_size]
      if bad:
        raise BadRequest(f"prompt {i} holds token id {bad[0]} outside [0, {vocab_size}) (the vocabulary)", "prompt")
      if pad_id in p:
        raise BadRequest(
          f"prompt {i} holds the padding id {pad_id}, which the model never reads; leave it out", "prompt"
        )
      out.append(p)
    else:
      raise BadRequest(
        f"prompt {i} must be a non-empty string or a non-empty list of token ids, got {_short(p)}", "prompt"
      )
  return out


def _is_id(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def max_new_tokens(requested: int | None, prompt_len: int, window: int, default: int | None) -> int:
  """Tokens to generate after a `prompt_len`-token prompt in a context of `window` tokens:
  `requested`, else `default` (None: all the room left), capped by the room.

  Raises:
    BadRequest (param "max_tokens" or "prompt"): a prompt that fills the context, or a
      `requested` beyond it (naming both lengths).
  """
  if prompt_len >= window:
    raise BadRequest(
      f"the prompt is {prompt_len} tokens long and this model's context is {window} tokens; shorten the prompt",
      "prompt",
      code="context_length_exceeded",
    )
  room = window - prompt_len
  if requested is None:
    return room if default is None else min(default, room)
  if requested > room:
    raise BadRequest(
      f"max_tokens ({requested}) and the prompt ({prompt_len} tokens) exceed this model's context "
      f"of {window} tokens; ask for at most {room}",
      "max_tokens",
      code="context_length_exceeded",
    )
  return requested
