"""A decoding request to `inference.engine.Engine` and the log-probabilities it records.

What a request may also ask for (the OpenAI routes of `jaxformer.serve` map onto these):
`logprobs` records each generated token's log-probability under the model's distribution
(the raw logits' log-softmax, before temperature or filtering) with up to `MAX_LOGPROBS` most
probable alternatives; `prompt_logprobs` does the same for the prompt's tokens (decoder-only:
one teacher-forced pass at admission); `choice` folds a number into the sampling key, so the
n samples of one seeded request differ; `stop(request)` ends a request with finish reason
"stop" when it returns True after a token (e.g. a stop string found in the decoded text).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import NamedTuple

from jaxformer.inference.sampling import sampling_values

_ids = itertools.count()
MAX_LOGPROBS = 5  # most probable alternatives a request may ask for per token (the OpenAI API's limit)


class TokenLogprob(NamedTuple):
  """One token's log-probability and the `k` most probable tokens there: `top` holds
  `(token id, log-probability)` pairs, most probable first."""

  logprob: float
  top: tuple[tuple[int, float], ...]


@dataclasses.dataclass
class Request:
  """One decoding request and its progress.

  `inputs`: token ids without padding (the source with EOS for translation, the prompt for a
  language model); `max_new_tokens`: generated tokens at most (EOS included); sampling when
  `temperature`, `top_k` or `top_p` is set, else greedy; `eos_id`: the end token (None: the
  model's `model.eos_id`, set by `Engine.submit`; -1: never stop at EOS).
  `on_token(request, token)` is called from the engine's thread for every token, and once
  more with token None when the request ends (`error` set if it failed).

  `logprobs`, `prompt_logprobs`, `choice`, `stop`: see the module docstring; they fill
  `token_logprobs` (a `TokenLogprob` per generated token) and `prompt_token_logprobs` (one per
  input token, None for the first). `finish_reason`: "stop" (EOS or `stop`) or "length".
  """

  inputs: list[int]
  max_new_tokens: int
  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0
  eos_id: int | None = None
  on_token: Callable[[Request, int | None], None] | None = None
  logprobs: int | None = None
  prompt_logprobs: bool = False
  choice: int = 0
  stop: Callable[[Request], bool] | None = None
  id: int = dataclasses.field(default_factory=lambda: next(_ids))
  tokens: list[int] = dataclasses.field(default_factory=list)
  token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
  prompt_token_logprobs: list[TokenLogprob | None] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  done: bool = False
  cancelled: bool = False
  error: str | None = None

  @property
  def sampling(self) -> bool:
    """Whether any of `temperature`, `top_k`, `top_p` is set (sampling rather than greedy)."""
    return self.temperature is not None or self.top_k is not None or self.top_p is not None

  def options(self) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) with the unset ones at their 'off' values."""
    return sampling_values(self.temperature, self.top_k, self.top_p)


def token_logprob(chosen, row: int, k: int) -> TokenLogprob:
  """Row `row` of `Engine._logprobs`-shaped host arrays (..., token log-probabilities, top values, top
  ids; the first axis indexed by `row`) with its `k` best alternatives."""
  token, values, ids = chosen[-3][row], chosen[-2][row], chosen[-1][row]
  return TokenLogprob(float(token), tuple((int(i), float(v)) for i, v in zip(ids[:k], values[:k])))
