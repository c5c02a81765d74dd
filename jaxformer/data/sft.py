"""Supervised fine-tuning rows for causal LMs: their tokens, and which of them the loss counts.

A prompt/completion row (`data.prompt_field`, `data.completion_field`) is the prompt's tokens
(with the specials the tokenizer adds, e.g. Llama's BOS), the completion's, then EOS; the loss
counts the completion and the EOS. A chat row (`data.messages_field`: OpenAI-style `[{role,
content}]`) is rendered with the tokenizer's `chat_template` (Jinja, as transformers renders it);
the loss counts the assistant turns: each assistant turn's span is what rendering the chat up to
and including it adds to rendering the chat before it with `add_generation_prompt=True`, and a
token counts when its text starts inside such a span.

The prepared token stream keeps the mask in the sign (`masked_ids`): a token the loss skips is
stored as -(id + 1), so streams of plain documents (all counted) are stored as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxformer.errors import DataError


def example_text(example: str | dict) -> str:
  """The text of a document or fine-tuning row, for training a tokenizer on it: a row's prompt and
  completion, or its messages' contents, one per line."""
  if isinstance(example, str):
    return example
  if "messages" in example:
    return "\n".join(m["content"] for m in example["messages"])
  return example["prompt"] + "\n" + example["completion"]


def masked_ids(ids: Sequence[int], counted: Sequence[bool]) -> np.ndarray:
  """int32 stream values: `id` where the loss counts it, -(id + 1) where it does not."""
  ids = np.asarray(ids, np.int32)
  return np.where(np.asarray(counted, bool), ids, -ids - 1).astype(np.int32)


def unmask(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(int32 token ids, bool counted) of `masked_ids` values (any shape)."""
  counted = values >= 0
  return np.where(counted, values, -values - 1).astype(np.int32), counted


def encode_example(example: str | dict, tokenizer: Any, eos_id: int | None) -> np.ndarray:
  """The `masked_ids` of one example: a plain document (every token counted, then EOS), a
  `{"prompt", "completion"}` row or a `{"messages"}` chat (see the module docstring).

  Raises:
    DataError: a chat with a tokenizer that has no chat template, or a template that fails to render.
  """
  if isinstance(example, str):
    ids = tokenizer.encode(example) + ([] if eos_id is None else [eos_id])
    return np.asarray(ids, np.int32)
  if "messages" in example:
    ids, counted = _chat(example["messages"], tokenizer)
    return masked_ids(ids, counted)
  prompt = tokenizer.encode(example["prompt"])
  completion = _plain(tokenizer, example["completion"]) + ([] if eos_id is None else [eos_id])
  return masked_ids(prompt + completion, [False] * len(prompt) + [True] * len(completion))


def _plain(tokenizer: Any, text: str) -> list[int]:
  """Ids of `text` without the specials a Hugging Face tokenizer adds (ours add none)."""
  plain = getattr(tokenizer, "encode_plain", None)
  return plain(text) if plain is not None else tokenizer.encode(text)


def render_chat(
  template: str, messages: list[dict], tokens: dict[str, str | None], add_generation_prompt: bool = False
) -> str:
  """`messages` rendered by the Jinja chat `template` (a sandboxed environment with transformers'
  settings: trimmed blocks, `raise_exception`), with the tokenizer's special tokens as
  `bos_token`, `eos_token`, ...

  Raises:
    DataError: the template fails to render (one line with Jinja's message).
  """
  import jinja2  # noqa: PLC0415  (comes with the hf extra)
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = raise_exception
  try:
    return env.from_string(template).render(
      messages=messages,
      add_generation_prompt=add_generation_prompt,
      **{f"{k}_token": v or "" for k, v in tokens.items()},
    )
  except jinja2.exceptions.TemplateError as e:
    raise DataError(
      f"the tokenizer's chat_template failed to render a chat ({e}); fix the template in "
      "tokenizer_config.json or the row's messages"
    ) from None


def _chat(messages: list[dict], tokenizer: Any) -> tuple[list[int], list[bool]]:
  template = getattr(tokenizer, "chat_template", None)
  if not template:
    raise DataError(
      "data.messages_field needs a tokenizer with a chat_template (data.tokenizer=hf on a model "
      "whose tokenizer_config.json has one); use data.prompt_field/completion_field otherwise"
    )
  full = render_chat(template, messages, tokenizer.tokens)
  spans = []
  for i, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    before = render_chat(template, messages[:i], tokenizer.tokens, add_generation_prompt=True)
    through = render_chat(template, messages[: i + 1], tokenizer.tokens)
    if not (through.startswith(before) and full.startswith(through)):
      raise DataError(
        "the tokenizer's chat_template renders a chat's beginning differently from the whole chat, "
        "so its assistant turns cannot be found; use data.prompt_field/completion_field rows"
      )
    spans.append((len(before), len(through)))
  ids, offsets = tokenizer.encode_offsets(full)
  counted = [any(a <= start < b for a, b in spans) for start, _ in offsets]
  return ids, counted
