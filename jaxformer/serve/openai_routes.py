"""The OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions` and `POST
/v1/chat/completions`, each a thin mapping of the request onto engine requests (one per prompt
and choice) and of their tokens back onto the OpenAI answer.

  * completions (decoder-only models): `prompt` (text or token ids, one or a list), `max_tokens`
    (default 16), the sampling fields of `openai_params`, `echo` and `logprobs` (<= 5; with
    `echo`, for the prompt's tokens too).
  * chat: `messages` rendered by `serve.chat` (the tokenizer's chat template, or the plain
    template); on a translation model the last user message is translated. `max_tokens`
    defaults to the room left in the context (a translation: source length + 50).
  * `"stream": true`: server-sent events, one chunk per piece of text, all with the answer's
    `id` and `created`, then `data: [DONE]`; `stream_options.include_usage` adds a last chunk
    with the usage.
Sampling, stopping (EOS, stop strings through `Request.stop`, lengths) and log-probabilities
are the engine's; this module only checks fields, encodes and formats.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jaxformer.inference.request import Request
from jaxformer.inference.search import EXTRA_TOKENS
from jaxformer.serve import chat
from jaxformer.serve.errors import ApiError, BadRequest, error_body
from jaxformer.serve.openai_params import Options, get, max_new_tokens, options, prompts
from jaxformer.serve.openai_responses import DONE, Answer, Job, event
from jaxformer.serve.text import Continuation

COMPLETION_TOKENS = 16  # the OpenAI API's default max_tokens for completions


class OpenAIRoutes:
  """The OpenAI routes of one `serve.app.Server` (its model, engine worker, limits and metrics)."""

  def __init__(self, server):
    self.server = server
    self.translation = server.task.translates
    self.tokenizer = server.restored.tokenizer

  def routes(self) -> list[Route]:
    """The Starlette routes."""
    return [
      Route("/v1/models", self.models, methods=["GET"]),
      Route("/v1/models/{name:path}", self.model, methods=["GET"]),
      Route("/v1/completions", self.completions, methods=["POST"]),
      Route("/v1/chat/completions", self.chat, methods=["POST"]),
    ]

  def _card(self) -> dict:
    return {
      "id": self.server.model_name,
      "object": "model",
      "created": self.server.started,
      "owned_by": "jaxformer",
      "max_model_len": self.server.window,
    }

  async def models(self, http: HttpRequest) -> JSONResponse:
    """GET /v1/models: the one served model."""
    return JSONResponse({"object": "list", "data": [self._card()]})

  async def model(self, http: HttpRequest) -> JSONResponse:
    """GET /v1/models/{name}: the served model, or 404."""
    try:
      self._check_model({"model": http.path_params["name"]})
    except ApiError as e:
      return e.response()
    return JSONResponse(self._card())

  async def completions(self, http: HttpRequest):
    """POST /v1/completions (see the module docstring)."""
    return await self.server.answer(http, self._completions)

  async def chat(self, http: HttpRequest):
    """POST /v1/chat/completions (see the module docstring)."""
    return await self.server.answer(http, self._chat)

  def _check_model(self, body: dict) -> None:
    name = get(body, "model", str)
    if name is not None and name != self.server.model_name:
      raise ApiError(
        f"the model {name!r} does not exist; this server serves {self.server.model_name!r} (GET /v1/models)",
        status=404,
        param="model",
        code="model_not_found",
      )

  async def _completions(self, http: HttpRequest, body: dict):
    self._check_model(body)
    if self.translation:
      raise BadRequest(
        f"this server holds a translation model (model.kind={self.server.restored.config.model.kind}); "
        "use /v1/chat/completions or /v1/translate",
        code="unsupported_model_kind",
      )
    opts = options(body, chat=False, max_queue=self.server.max_queue)
    model = self.server.restored.config.model
    texts = prompts(body, model.vocab_size, model.pad_id)
    self._check_count(len(texts) * opts.n)
    jobs, inputs = [], []
    for text in texts:
      ids = self.server.encode(self.tokenizer, text, "prompt") if isinstance(text, str) else text
      new = max_new_tokens(opts.max_tokens, len(ids), self.server.window, COMPLETION_TOKENS)
      echo = (text if isinstance(text, str) else self.tokenizer.decode(ids)) if opts.echo else None
      inputs.append(ids)
      jobs += [self._job(len(jobs) + c, ids, new, opts, c, echo) for c in range(opts.n)]
    return await self._run(http, jobs, inputs, opts, Answer(self.server.model_name, chat=False))

  async def _chat(self, http: HttpRequest, body: dict):
    self._check_model(body)
    messages = chat.parse_messages(body.get("messages"))
    opts = options(body, chat=True, translation=self.translation, max_queue=self.server.max_queue)
    self._check_count(opts.n)
    if self.translation:
      ids = self.server.source_ids(chat.source_text(messages), "messages")
      limit = self.server.restored.config.model.max_length
      if opts.max_tokens is not None and opts.max_tokens > limit:
        raise BadRequest(
          f"max_tokens ({opts.max_tokens}) is beyond this model's output length of {limit} tokens",
          "max_tokens",
          code="context_length_exceeded",
        )
      new = opts.max_tokens or min(len(ids) + EXTRA_TOKENS, limit)
    else:
      ids = chat.chat_ids(messages, self.tokenizer)
      if not ids:
        raise BadRequest("the messages encode to no tokens; send some text", "messages")
      new = max_new_tokens(opts.max_tokens, len(ids), self.server.window, None)
    jobs = [self._job(c, ids, new, opts, c, None) for c in range(opts.n)]
    return await self._run(http, jobs, [ids], opts, Answer(self.server.model_name, chat=True))

  def _check_count(self, count: int) -> None:
    if count > self.server.max_queue:
      raise BadRequest(
        f"{count} completions (prompts x n) in one request; ask for at most {self.server.max_queue} "
        "(the server's --max-queue)",
        "n",
      )

  def _job(self, index: int, ids: list[int], new: int, opts: Options, choice: int, echo: str | None) -> Job:
    before = [] if self.translation else ids  # what the output's text follows (a translation stands alone)
    text = Continuation(self.tokenizer, before, opts.stop)
    request = Request(
      ids,
      new,
      **opts.engine_fields(),
      logprobs=opts.logprobs,
      prompt_logprobs=echo is not None and opts.logprobs is not None,
      choice=choice,
      stop=text.stopped if opts.stop else None,
    )
    return Job(index, before, echo, request, text)

  async def _run(self, http: HttpRequest, jobs: list[Job], inputs: list[list[int]], opts: Options, answer: Answer):
    requests = [j.request for j in jobs]
    if opts.stream:
      return self._stream(jobs, inputs, opts, answer, self.server.attach(requests))
    await self.server.wait(http, requests, self.server.attach(requests))
    return JSONResponse(answer.whole(jobs, self.tokenizer, opts.logprobs, inputs))

  def _stream(
    self, jobs: list[Job], inputs: list[list[int]], opts: Options, answer: Answer, queue: asyncio.Queue
  ) -> StreamingResponse:
    by_id = {j.request.id: j for j in jobs}

    async def events():
      try:
        for job in jobs:
          if answer.chat:
            yield answer.chunk(job.index, role=True)
        pending = len(jobs)
        while pending:
          try:
            request, token = await asyncio.wait_for(queue.get(), timeout=self.server.request_timeout)
          except TimeoutError:
            yield event(
              error_body(
                f"the request took over {self.server.request_timeout:g} s and was cancelled",
                "timeout_error",
                code="timeout",
              )
            )
            break
          pending -= token is None
          if request.error:
            yield event(error_body(request.error, "server_error", code="engine_error"))
            break
          chunk = self._chunk(by_id[request.id], token is None, opts, answer)
          if chunk:
            yield chunk
        else:
          if opts.include_usage:
            yield answer.usage_chunk(jobs, inputs)
        yield DONE
      finally:
        for j in jobs:
          j.request.cancelled = not j.request.done

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

  def _chunk(self, job: Job, done: bool, opts: Options, answer: Answer) -> str | None:
    """The stream event for `job`'s news (None when there is none to send yet)."""
    r = job.request
    piece = ""
    if job.echo is not None and not job.echo_sent:
      piece, job.echo_sent = job.echo, True
    piece += job.text.release(r.tokens, done)
    logprobs = None
    if opts.logprobs is not None:
      _, cut = job.text.final(r.tokens) if done else (None, False)
      limit = len(job.echo or "") + job.text.sent if cut else None
      logprobs = answer.logprobs(job, self.tokenizer, opts.logprobs, limit)
    finish = r.finish_reason if done else None
    if not piece and not finish and not _has_tokens(logprobs):
      return None
    return answer.chunk(job.index, piece if piece or not answer.chat else None, logprobs, finish)


def _has_tokens(logprobs: dict[str, Any] | None) -> bool:
  return bool(logprobs and (logprobs.get("tokens") or logprobs.get("content")))
