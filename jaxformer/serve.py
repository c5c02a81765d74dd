"""`jaxformer serve`: the HTTP front end of the inference engine (Starlette on uvicorn).

Endpoints (JSON in and out; errors are `{"error": "<one line>"}` with a 4xx/5xx status):
  * `GET /health`: 200 `{"status": "ok", ...}` once the model is loaded and compiled.
  * `POST /v1/translate` (encoder-decoder): `{"text": str | [str], "beam_size"?, "max_length"?,
    "stream"?}` -> `{"translation": str | [str]}`. Greedy requests join the engine's running
    batch; beam search runs as a fixed batch (`inference.decode`) beside it.
  * `POST /v1/generate` (decoder-only): `{"prompt": str, "max_new_tokens"?, "temperature"?,
    "top_k"?, "top_p"?, "seed"?, "stream"?}` -> `{"text": str}`.
With `"stream": true` the answer is server-sent events: one `data: {"token": id, "text":
piece}` line per token, then `data: [DONE]` (or `data: {"error": ...}` on failure).

One engine thread steps the batch; requests cross to it through `EngineWorker.submit`. A
client that disconnects or outlives `request_timeout` has its request cancelled, which frees
its slot and pages at the next step. SIGTERM stops accepting, lets in-flight requests
finish (uvicorn's graceful shutdown), then stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jaxformer.inference.engine import Engine, Request
from jaxformer.inference.search import EXTRA_TOKENS
from jaxformer.tasks import get_task


class BadRequest(ValueError):
  """A client mistake: answered 400 with its one-line message."""


class EngineWorker:
  """Runs `engine.step()` on its own thread while any request is running or waiting."""

  def __init__(self, engine: Engine, max_queue: int):
    self.engine, self.max_queue = engine, max_queue
    self.cond = threading.Condition()
    self.stopping = False
    self.thread = threading.Thread(target=self._loop, name="jaxformer-engine", daemon=True)
    self.thread.start()

  def _loop(self) -> None:
    while True:
      with self.cond:
        while not self.engine.busy and not self.stopping:
          self.cond.wait()
        if self.stopping and not self.engine.busy:
          return
      # The step runs without the lock, so the event loop's `submit` never waits for a step.
      # The engine's queue is a deque (thread-safe appends) that only this thread pops.
      try:
        self.engine.step()
      except Exception as e:  # noqa: BLE001  (fail the requests, keep serving)
        self.engine.fail_all(f"decoding failed: {type(e).__name__}: {e}")

  def submit(self, requests: list[Request]) -> None:
    """Queues `requests`; raises QueueFull when the waiting queue has no room for them."""
    if len(requests) > self.max_queue:
      raise BadRequest(f"{len(requests)} texts in one request; send at most {self.max_queue} (the queue's size)")
    with self.cond:
      if len(self.engine.waiting) + len(requests) > self.max_queue:
        raise QueueFull(f"the queue is full ({self.max_queue} waiting requests); retry later")
      for r in requests:
        self.engine.submit(r)
      self.cond.notify()

  def stop(self) -> None:
    """Asks the engine thread to finish and waits for it."""
    with self.cond:
      self.stopping = True
      self.cond.notify()
    self.thread.join()


class QueueFull(RuntimeError):
  """Answered 503 with a Retry-After header."""


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


class Server:
  """The Starlette app over one restored model (`inference.restore.Restored`).

  Args:
    restored: the model, tokenizers and params (possibly int8, see `params_transform`).
    engine: the continuous-batching engine over those params.
    max_queue: waiting requests at most; more answer 503.
    request_timeout: seconds a request may take before it is cancelled (504).
    decode_beam: `(texts, beam_size) -> translations` for beam requests.
  """

  def __init__(self, restored, engine: Engine, *, max_queue: int = 64, request_timeout: float = 120.0,
               decode_beam=None):
    self.restored, self.engine = restored, engine
    self.task = get_task(restored.config)
    self.max_queue, self.request_timeout = max_queue, request_timeout
    self.decode_beam = decode_beam
    self.worker: EngineWorker | None = None
    self.app = Starlette(routes=[Route("/health", self.health, methods=["GET"]),
                                 Route("/v1/translate", self.translate, methods=["POST"]),
                                 Route("/v1/generate", self.generate, methods=["POST"])],
                         lifespan=self._lifespan)

  @contextlib.asynccontextmanager
  async def _lifespan(self, app):
    self.worker = EngineWorker(self.engine, self.max_queue)
    # Compile prefill for every input width (page multiples) and generate before answering /health.
    page = self.engine.pages.page_size
    for width in range(page, self.engine.max_input_len + page, page):
      n = min(width, self.engine.max_input_len)
      await run_in_threadpool(self._run_blocking, Request([4] * n, 2))
    yield
    self.worker.stop()

  def _run_blocking(self, request: Request) -> None:
    done = threading.Event()
    request.on_token = lambda r, t: done.set() if t is None else None
    self.worker.submit([request])
    done.wait()

  async def health(self, http: HttpRequest) -> JSONResponse:
    """GET /health: `{"status": "ok", "model", "step"}` plus the engine's counters."""
    return JSONResponse({"status": "ok", "model": self.restored.config.model.kind, "step": self.restored.step,
                         **self.engine.stats()})

  async def _body(self, http: HttpRequest) -> dict:
    try:
      body = await http.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
      raise BadRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
      raise BadRequest("the body must be a JSON object")
    return body

  async def translate(self, http: HttpRequest):
    """POST /translate: `{"text": str | [str]}` -> translations (400 on a bad body)."""
    return await self._answer(http, self._translate)

  async def generate(self, http: HttpRequest):
    """POST /generate: `{"prompt": str}` -> the continuation (400 on a bad body)."""
    return await self._answer(http, self._generate)

  async def _answer(self, http: HttpRequest, handler):
    try:
      return await handler(http, await self._body(http))
    except BadRequest as e:
      return JSONResponse({"error": str(e)}, status_code=400)
    except QueueFull as e:
      return JSONResponse({"error": str(e)}, status_code=503, headers={"Retry-After": "1"})
    except TimeoutError:
      return JSONResponse({"error": f"the request took over {self.request_timeout:g} s and was cancelled"},
                          status_code=504)

  def _check_kind(self, wants_translation: bool) -> None:
    if self.task.generates == wants_translation:
      other = "/v1/generate" if wants_translation else "/v1/translate"
      raise BadRequest(f"this server holds a model of kind {self.restored.config.model.kind}; use {other}")

  def _encode(self, tokenizer, text: str, extra: list[int]) -> list[int]:
    ids = tokenizer.encode(text) + extra
    if len(ids) > self.engine.max_input_len:
      raise BadRequest(f"the input is {len(ids)} tokens long; this model takes at most {self.engine.max_input_len}")
    return ids

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
    eos = self.restored.config.model.eos_id
    sources = [self._encode(self.restored.source_tokenizer, t, [eos]) for t in texts]
    limit = self.restored.config.model.max_length
    lengths = [min(max_length or len(s) + EXTRA_TOKENS, limit) for s in sources]
    if beam > 1:
      if max_length is not None:
        raise BadRequest('"max_length" applies to greedy decoding; beam search uses source length + 50')
      hyps = await run_in_threadpool(self.decode_beam, texts, beam)
      return JSONResponse({"translation": hyps if isinstance(text, list) else hyps[0]})
    requests = [Request(s, n) for s, n in zip(sources, lengths)]
    if stream:
      return self._stream(http, requests[0])
    await self._wait(http, requests)
    hyps = [self.restored.tokenizer.decode(r.tokens) for r in requests]
    return JSONResponse({"translation": hyps if isinstance(text, list) else hyps[0]})

  async def _generate(self, http: HttpRequest, body: dict):
    self._check_kind(False)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
      raise BadRequest('"prompt" must be a non-empty string')
    ids = self._encode(self.restored.tokenizer, prompt, [])
    if not ids:
      raise BadRequest(f"the prompt {prompt!r} encodes to no tokens")
    window = min(self.restored.config.data.max_length, self.restored.config.model.max_length)
    if len(ids) >= window:
      raise BadRequest(f"the prompt is {len(ids)} tokens long and fills the model's context of {window}; shorten it")
    new = _field(body, "max_new_tokens", int, min(64, window - len(ids)), 1)
    if len(ids) + new > window:
      raise BadRequest(f"prompt ({len(ids)} tokens) + max_new_tokens ({new}) exceeds the model's context of "
                       f"{window} tokens; shorten one of them")
    request = Request(ids, new, temperature=_field(body, "temperature", float, None),
                      top_k=_field(body, "top_k", int, None), top_p=_field(body, "top_p", float, None),
                      seed=_field(body, "seed", int, 0), eos_id=-1)
    try:
      self.engine.validate(request)
    except ValueError as e:
      raise BadRequest(str(e)) from None
    if _field(body, "stream", bool, False):
      return self._stream(http, request, prompt_ids=ids)
    await self._wait(http, [request])
    return JSONResponse({"text": self._text(ids, request.tokens)})

  def _text(self, prompt_ids: list[int], tokens: list[int]) -> str:
    # Decoded behind the prompt, so a continuation keeps its leading space (as `generate` does).
    tok = self.restored.tokenizer
    return tok.decode(prompt_ids + tokens)[len(tok.decode(prompt_ids)):]

  def _attach(self, requests: list[Request]) -> asyncio.Queue:
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    for r in requests:
      r.on_token = lambda req, tok: loop.call_soon_threadsafe(queue.put_nowait, (req, tok))
    self.worker.submit(requests)
    return queue

  async def _wait(self, http: HttpRequest, requests: list[Request]) -> None:
    """Waits for `requests`; cancels them if the client goes away (CancelledError) or the
    timeout passes (TimeoutError), which frees their slots and pages at the next step.

    Raises:
      QueueFull: the engine failed a request (out of pages, or a decoding error).
    """
    queue = self._attach(requests)
    deadline = asyncio.get_running_loop().time() + self.request_timeout
    try:
      while not all(r.done for r in requests):
        try:
          await asyncio.wait_for(queue.get(), timeout=0.2)
        except TimeoutError:
          if await http.is_disconnected():
            raise asyncio.CancelledError from None
          if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError from None
    finally:
      for r in requests:
        r.cancelled = not r.done
    errors = [r.error for r in requests if r.error]
    if errors:
      raise QueueFull(errors[0])

  def _stream(self, http: HttpRequest, request: Request, prompt_ids: list[int] | None = None) -> StreamingResponse:
    queue = self._attach([request])
    prefix = prompt_ids or []

    async def events():
      sent = ""
      try:
        while True:
          _, token = await asyncio.wait_for(queue.get(), timeout=self.request_timeout)
          if token is None:
            if request.error:
              yield f"data: {json.dumps({'error': request.error})}\n\n"
            yield "data: [DONE]\n\n"
            return
          text = self._text(prefix, request.tokens) if prompt_ids is not None else \
              self.restored.tokenizer.decode(request.tokens)
          piece, sent = text[len(sent):], text
          yield f"data: {json.dumps({'token': token, 'text': piece})}\n\n"
      finally:
        request.cancelled = not request.done
    return StreamingResponse(events(), media_type="text/event-stream")


def serve(restored, *, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8, max_queue: int = 64,
          page_size: int = 16, num_pages: int | None = None, request_timeout: float = 120.0,
          batching: str = "continuous") -> None:
  """Builds the engine over `restored` (`batching`: "continuous" or "static", see
  `inference.engine`) and serves it with uvicorn until SIGTERM/SIGINT (which drain in-flight
  requests first)."""
  import uvicorn  # noqa: PLC0415  (only the serve command needs it)

  from jaxformer import evaluate  # noqa: PLC0415
  from jaxformer.inference.decode import SearchOptions  # noqa: PLC0415
  cfg = restored.config
  engine = Engine(restored.model, restored.params, max_batch=max_batch, page_size=page_size, num_pages=num_pages,
                  max_input_len=min(cfg.data.max_length, cfg.model.max_length), batching=batching)

  def decode_beam(texts, beam):
    return evaluate.translate(restored, texts, max_batch, SearchOptions(beam_size=beam))[0]
  server = Server(restored, engine, max_queue=max_queue, request_timeout=request_timeout, decode_beam=decode_beam)
  uvicorn.run(server.app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=request_timeout)
