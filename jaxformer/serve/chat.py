"""Chat messages to model input ids, for `POST /v1/chat/completions`, by the model's kind.

  * a tokenizer with a `chat_template` (a Hugging Face tokenizer): the messages rendered by it
    with `add_generation_prompt=True` (as transformers' `apply_chat_template` does), encoded
    without the specials the tokenizer adds itself (the template writes them);
  * any other decoder-only model: the plain template `PLAIN_TEMPLATE`, one line per message,
    "<role>: <content>", then "assistant:" for the model to continue; encoded as a prompt is;
  * a translation model: the last user message is the source sentence (the others are ignored).
Roles are system, user and assistant; a content is a string or a list of text parts.
"""

from __future__ import annotations

from typing import Any

from jaxformer.data.sft import render_chat
from jaxformer.errors import DataError
from jaxformer.serve.errors import BadRequest

ROLES = ("system", "user", "assistant")
PLAIN_TEMPLATE = "{role}: {content}\n"  # per message; then PLAIN_PROMPT
PLAIN_PROMPT = "assistant:"


def parse_messages(value: Any) -> list[dict[str, str]]:
  """`messages` as `[{"role", "content"}]` with string contents (text parts joined).

  Raises:
    BadRequest: not a non-empty list of messages with a known role and text content.
  """
  if not isinstance(value, list) or not value:
    raise BadRequest('"messages" must be a non-empty list of {"role", "content"} objects', "messages")
  messages = []
  for i, m in enumerate(value):
    where = f"messages[{i}]"
    if not isinstance(m, dict):
      raise BadRequest(f'{where} must be an object with "role" and "content"', where)
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
      raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {_short(role)}", f"{where}.role")
    if isinstance(content, list):
      content = _text_parts(content, f"{where}.content")
    if not isinstance(content, str):
      raise BadRequest(
        f"{where}.content must be a string or a list of text parts, got {_short(content)}", f"{where}.content"
      )
    if not content.isascii():
      try:
        content.encode("utf-8")
      except UnicodeEncodeError:
        raise BadRequest(
          f"{where}.content holds an unpaired surrogate (\\ud800-\\udfff); send valid Unicode", f"{where}.content"
        ) from None
    messages.append({"role": role, "content": content})
  return messages


def _text_parts(parts: list, where: str) -> str:
  texts = []
  for part in parts:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
      raise BadRequest(f'{where} parts must be {{"type": "text", "text": str}}; this model reads text only', where)
    texts.append(part["text"])
  return "".join(texts)


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 40 else text[:37] + "..."


def chat_ids(messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
  """A decoder-only model's input ids for `messages` (see the module docstring).

  Raises:
    BadRequest: the chat template fails to render these messages.
  """
  template = getattr(tokenizer, "chat_template", None)
  if template:
    try:
      text = render_chat(template, messages, tokenizer.tokens, add_generation_prompt=True)
    except DataError as e:
      raise BadRequest(str(e), "messages") from None
    return tokenizer.encode_plain(text)
  return tokenizer.encode(plain_chat(messages))


def plain_chat(messages: list[dict[str, str]]) -> str:
  """`messages` in the plain template: "<role>: <content>" lines, then "assistant:"."""
  return "".join(PLAIN_TEMPLATE.format(**m) for m in messages) + PLAIN_PROMPT


def source_text(messages: list[dict[str, str]]) -> str:
  """What a translation model translates: the last user message's content.

  Raises:
    BadRequest: no user message, or an empty one.
  """
  users = [m["content"] for m in messages if m["role"] == "user"]
  if not users or not users[-1].strip():
    raise BadRequest(
      "a translation model translates the last user message; send one with non-empty content", "messages"
    )
  return users[-1]
