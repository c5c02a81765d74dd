"""`SearchOptions`: how to decode (greedy, beam or sampling search, and their settings), the one
description that evaluation, the CLI, the server and `inference.decode` share."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxformer.inference.sampling import check_sampling, check_seed, sampling_values
from jaxformer.inference.search import EXTRA_TOKENS, LENGTH_PENALTY


@dataclasses.dataclass(frozen=True)
class SearchOptions:
  """How to decode. The strategy follows from the fields.

    * `beam_size` > 1: beam search (with `length_penalty`);
    * else any of `temperature`, `top_k`, `top_p` set (not None): sampling with `seed`
      (unset ones default to 1.0, 0 = off, 1.0 = off);
    * else greedy search.

  Beam search combined with sampling options is rejected by `validate`. Output length is
  min(source length + `extra_tokens`, model max_length) (paper: + 50).
  """

  beam_size: int = 1
  length_penalty: float = LENGTH_PENALTY
  extra_tokens: int = EXTRA_TOKENS
  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0
  eos_id: int | None = None  # None: the model's (`model.eos_id`); -1: never stop at EOS

  @property
  def sampling(self) -> bool:
    """Whether any of `temperature`, `top_k`, `top_p` is set (sampling rather than greedy search)."""
    return self.temperature is not None or self.top_k is not None or self.top_p is not None

  @property
  def strategy(self) -> str:
    """The search: `beam`, `sample` or `greedy`."""
    if self.beam_size > 1:
      return "beam"
    return "sample" if self.sampling else "greedy"

  def validate(self) -> SearchOptions:
    """Returns self; raises ValueError (one line) for inconsistent or out-of-range options."""
    if not isinstance(self.beam_size, int) or self.beam_size < 1:
      raise ValueError(f"beam size must be an integer >= 1 (1 = greedy), got {self.beam_size!r}")
    if self.beam_size > 1 and self.sampling:
      raise ValueError(
        f"beam size {self.beam_size} cannot be combined with sampling "
        "(temperature/top-k/top-p); use beam size 1 to sample"
      )
    if not self.length_penalty >= 0.0:
      raise ValueError(f"length penalty must be >= 0, got {self.length_penalty}")
    if not isinstance(self.extra_tokens, int) or self.extra_tokens < 0:
      raise ValueError(f"max length (extra tokens over the source length) must be >= 0, got {self.extra_tokens!r}")
    if self.sampling:
      check_sampling(*self.sampling_args())
      check_seed(self.seed)
    return self

  def check_speculative(self) -> None:
    """Raises ValueError (one line) unless these options suit speculative decoding (a draft
    model): plain greedy search."""
    if self.strategy != "greedy":
      raise ValueError(f"speculative decoding (--draft-workdir) is greedy; drop it or the {self.strategy} options")

  def sampling_args(self) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) with the unset ones at their 'off' values."""
    return sampling_values(self.temperature, self.top_k, self.top_p)

  def summary(self) -> dict[str, Any]:
    """The options that matter for the chosen strategy (for logs / JSON results)."""
    out: dict[str, Any] = {"strategy": self.strategy, "extra_tokens": self.extra_tokens}
    if self.strategy == "beam":
      out.update(beam_size=self.beam_size, length_penalty=self.length_penalty)
    elif self.strategy == "sample":
      t, k, p = self.sampling_args()
      out.update(temperature=t, top_k=k, top_p=p, seed=self.seed)
    return out
