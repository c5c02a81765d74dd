"""Our own routes, JSON in and out; errors are `{"error": "<one line>"}` with a 4xx/5xx status.

  * `POST /v1/translate` (encoder-decoder): `{"text": str | [str], "beam_size"?, "max_length"?,
    "stream"?}` -> `{"translation": str | [str]}`. Greedy requests join the engine's running
    batch; beam search runs as a fixed batch (`inference.decode`) beside it.
  * `POST /v1/generate` (decoder-only): `{"prompt": str, "max_new_tokens"?, "temperature"?,
    "top_k"?, "top_p"?, "seed"?, "stream"?}` -> `{"text": str}`.
With `"stream": true` the answer is server-sent events: one `data: {"token": id, "text":
piece}` line per token, then `data: [DONE]` (or `data: {"error": ...}` on failure).
"""

from __future__ import annotations

import asyncio
import json

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jaxformer.inference.request import Request
from jaxformer.inference.search import EXTRA_TOKENS
from jaxformer.serve.errors import BadRequest
from jaxformer.serve.text import Continuation


def _field(body: dict, name: str, kind, default=None, minimum=None):
  value = body.get(name, default)
  if value is None:
    return None
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
    raise BadRequest(f'"{name}" must be {kind.__name__}, got {json.dumps(value)}')
  if minimum is not None and value < minimum:
    raise BadRequest(f'"{name}" must be >= {minimum}, got {value}')
  return value


class OwnRoutes:
  """`/v1/translate` and `/v1/generate` of one `serve.app.Server`."""

  def __init__(self, server):
    self.server = server
    self.restored = server.restored

  def routes(self) -> list[Route]:
    """The Starlette routes."""
    return [
      Route("/v1/translate", self.translate, methods=["POST"]),
      Route("/v1/generate", self.generate, methods=["POST"]),
    ]

  async def translate(self, http: HttpRequest):
    """POST /v1/translate: `{"text": str | [str]}` -> translations (400 on a bad body)."""
    return await self.server.answer(http, self._translate, own_route=True)

  async def generate(self, http: HttpRequest):
    """POST /v1/generate: `{"prompt": str}` -> the continuation (400 on a bad body)."""
    return await self.server.answer(http, self._generate, own_route=True)

  def _check_kind(self, wants_translation: bool) -> None:
    if self.server.task.translates != wants_translation:
      other = "/v1/generate" if wants_translation else "/v1/translate"
      raise BadRequest(f"this server holds a model of kind {self.restored.config.model.kind}; use {other}")

  async def _translate(self, http: HttpRequest, body: dict):
    self._check_kind(True)
    text = body.get("text")
    texts = [text] if isinstance(text, str) else text
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
      raise BadRequest('"text" must be a non-empty string or a non-empty list of strings')
    if any(not t.strip() for t in texts):
      raise BadRequest('"text" has an empty sentence; send at least one non-space character per sentence')
    beam = _field(body, "beam_size", int, 1, 1)
    stream = _field(body, "stream", bool, False)
    max_length = _field(body, "max_length", int, None, 1)
    if stream and (beam > 1 or not isinstance(text, str)):
      raise BadRequest('"stream" needs one "text" string and beam_size 1')
    sources = [self.server.source_ids(t, "text") for t in texts]
    limit = self.restored.config.model.max_length
    lengths = [min(max_length or len(s) + EXTRA_TOKENS, limit) for s in sources]
    if beam > 1:
      if max_length is not None:
        raise BadRequest('"max_length" applies to greedy decoding; beam search uses source length + 50')
      hyps = await run_in_threadpool(self.server.decode_beam, texts, beam)
      return JSONResponse({"translation": hyps if isinstance(text, list) else hyps[0]})
    requests = [Request(s, n) for s, n in zip(sources, lengths)]
    if stream:
      return self._stream(requests[0], Continuation(self.restored.tokenizer, []))
    await self.server.wait(http, requests, self.server.attach(requests))
    hyps = [self.restored.tokenizer.decode(r.tokens) for r in requests]
    return JSONResponse({"translation": hyps if isinstance(text, list) else hyps[0]})

  async def _generate(self, http: HttpRequest, body: dict):
    self._check_kind(False)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
      raise BadRequest('"prompt" must be a non-empty string')
    ids = self.server.encode(self.restored.tokenizer, prompt, "prompt")
    if not ids:
      raise BadRequest(f"the prompt {prompt!r} encodes to no tokens")
    window = self.server.window
    if len(ids) >= window:
      raise BadRequest(f"the prompt is {len(ids)} tokens long and fills the model's context of {window}; shorten it")
    new = _field(body, "max_new_tokens", int, min(64, window - len(ids)), 1)
    if len(ids) + new > window:
      raise BadRequest(
        f"prompt ({len(ids)} tokens) + max_new_tokens ({new}) exceeds the model's context of "
        f"{window} tokens; shorten one of them"
      )
    request = Request(
      ids,
      new,
      temperature=_field(body, "temperature", float, None),
      top_k=_field(body, "top_k", int, None),
      top_p=_field(body, "top_p", float, None),
      seed=_field(body, "seed", int, 0),
      eos_id=-1,
    )
    try:
      self.server.engine.validate(request)
    except ValueError as e:
      raise BadRequest(str(e)) from None
    text = Continuation(self.restored.tokenizer, ids)
    if _field(body, "stream", bool, False):
      return self._stream(request, text)
    await self.server.wait(http, [request], self.server.attach([request]))
    return JSONResponse({"text": text.text(request.tokens)})

  def _stream(self, request: Request, text: Continuation) -> StreamingResponse:
    queue = self.server.attach([request])

    async def events():
      sent = ""
      try:
        while True:
          _, token = await asyncio.wait_for(queue.get(), timeout=self.server.request_timeout)
          if token is None:
            if request.error:
              yield f"data: {json.dumps({'error': request.error})}\n\n"
            yield "data: [DONE]\n\n"
            return
          now = text.text(request.tokens)
          piece, sent = now[len(sent) :], now
          yield f"data: {json.dumps({'token': token, 'text': piece})}\n\n"
      finally:
        request.cancelled = not request.done

    return StreamingResponse(events(), media_type="text/event-stream")
