"""The Starlette app of `jaxformer serve` over one restored model, and `serve`, which runs it on uvicorn.

Routes: `GET /health` (200 once the model is loaded and compiled), `GET /metrics`
(`serve.metrics`), our own `/v1/translate` and `/v1/generate` (`serve.routes`), and the OpenAI
ones (`serve.openai_routes`). With an API key every `/v1/*` route needs it (`serve.auth`). A
body over `max_request_bytes` answers 413; a client mistake 4xx with a one-line message.

One engine thread steps the batch; requests cross to it through `EngineWorker.submit`. A
client that disconnects or outlives `request_timeout` has its request cancelled, which frees
its slot and pages at the next step. SIGTERM stops accepting, lets in-flight requests
finish (uvicorn's graceful shutdown), then stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from jaxformer.data.pipeline import plain_ids
from jaxformer.inference.engine import Engine, Request
from jaxformer.serve.auth import ApiKeyMiddleware, open_warning
from jaxformer.serve.errors import ApiError, BadRequest, QueueFull
from jaxformer.serve.metrics import Metrics, MetricsMiddleware
from jaxformer.serve.openai_routes import OpenAIRoutes
from jaxformer.serve.routes import OwnRoutes
from jaxformer.serve.worker import EngineWorker
from jaxformer.tasks import get_task

MAX_REQUEST_BYTES = 1 << 20  # 1 MiB


class Server:
  """The Starlette app (`app`) over one restored model (`inference.restore.Restored`).

  Args:
    restored: the model, tokenizers and params (possibly int8, see `params_transform`).
    engine: the continuous-batching engine over those params.
    max_queue: waiting requests at most; more answer 503.
    request_timeout: seconds a request may take before it is cancelled (504).
    decode_beam: `(texts, beam_size) -> translations` for beam requests.
    api_key: the key every `/v1/*` request must bring as `Authorization: Bearer KEY` (None: open).
    max_request_bytes: the largest request body; larger ones answer 413.
    model_name: the model's id in the OpenAI routes (default: the workdir's name).
  """

  def __init__(
    self,
    restored,
    engine: Engine,
    *,
    max_queue: int = 64,
    request_timeout: float = 120.0,
    decode_beam=None,
    api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    model_name: str | None = None,
  ):
    self.restored, self.engine = restored, engine
    self.task = get_task(restored.config)
    self.max_queue, self.request_timeout, self.max_request_bytes = max_queue, request_timeout, max_request_bytes
    self.decode_beam = decode_beam
    self.model_name = model_name or Path(restored.config_workdir or "jaxformer").name
    self.window = min(restored.config.data.max_length, restored.config.model.max_length)
    self.started = int(time.time())
    self.worker: EngineWorker | None = None
    routes = [Route("/health", self.health, methods=["GET"]), *OwnRoutes(self).routes(), *OpenAIRoutes(self).routes()]
    self.metrics = Metrics(engine, [r.path for r in routes] + ["/metrics"])
    routes.append(Route("/metrics", self.metrics.endpoint, methods=["GET"]))
    self.app = Starlette(
      routes=routes,
      lifespan=self._lifespan,
      middleware=[Middleware(MetricsMiddleware, metrics=self.metrics), Middleware(ApiKeyMiddleware, api_key=api_key)],
      exception_handlers={HTTPException: self._http_error},
    )

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

  async def _http_error(self, http: HttpRequest, e: HTTPException) -> JSONResponse:
    message = {
      404: f"no route {http.url.path}; the routes are /health, /metrics, /v1/models, /v1/completions, "
      "/v1/chat/completions, /v1/translate and /v1/generate",
      405: f"{http.method} is not allowed on {http.url.path}",
    }.get(e.status_code, e.detail)
    return ApiError(message, status=e.status_code, headers=e.headers).response()

  async def health(self, http: HttpRequest) -> JSONResponse:
    """GET /health: `{"status": "ok", "model", "step"}` plus the engine's counters."""
    return JSONResponse(
      {"status": "ok", "model": self.restored.config.model.kind, "step": self.restored.step, **self.engine.stats()}
    )

  async def answer(self, http: HttpRequest, handler, own_route: bool = False):
    """`handler(http, body)`'s response, or the error response of what it raised (our own
    routes' `{"error": str}` bodies when `own_route`, else OpenAI-style ones)."""
    try:
      return await handler(http, await self.read_json(http))
    except ApiError as e:
      return e.response(own_route)
    except TimeoutError:
      error = ApiError(
        f"the request took over {self.request_timeout:g} s and was cancelled", status=504, code="timeout"
      )
      return error.response(own_route)

  async def read_json(self, http: HttpRequest) -> dict:
    """The request's body: a JSON object of at most `max_request_bytes` bytes of UTF-8.

    Raises:
      ApiError: 413 for a larger body (read no further than the limit).
      BadRequest: a body that is not UTF-8, not JSON or not an object.
    """
    limit, declared = self.max_request_bytes, http.headers.get("content-length", "")
    too_large = ApiError(
      f"the request body is over {limit} bytes (the server's --max-request-bytes); send less",
      status=413,
      code="request_too_large",
    )
    if declared.isdigit() and int(declared) > limit:  # uvicorn refuses a malformed Content-Length itself
      raise too_large
    raw = bytearray()
    async for chunk in http.stream():
      raw += chunk
      if len(raw) > limit:
        raise too_large
    try:
      body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise BadRequest(
        f"the body is not valid JSON: byte {raw[e.start]:#04x} at offset {e.start} is not UTF-8"
      ) from None
    except json.JSONDecodeError as e:
      raise BadRequest(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
      raise BadRequest("the body is not valid JSON here: it nests too deeply") from None
    if not isinstance(body, dict):
      raise BadRequest("the body must be a JSON object")
    return body

  def encode(self, tokenizer, text: str, param: str, plain: bool = False) -> list[int]:
    """Ids of `text`; `plain`: without the special tokens the tokenizer's post-processor adds
    (`data.pipeline.plain_ids`). Raises BadRequest naming `param` for text the tokenizer cannot take."""
    try:
      text.encode("utf-8")
      return plain_ids(tokenizer, [text])[0] if plain else tokenizer.encode(text)
    except UnicodeEncodeError:
      raise BadRequest(f'"{param}" holds an unpaired surrogate (\\ud800-\\udfff); send valid Unicode', param) from None
    except ValueError as e:
      raise BadRequest(f'"{param}" cannot be encoded: {e}', param) from None

  def source_ids(self, text: str, param: str) -> list[int]:
    """A translation model's input ids for the sentence `text` (the source tokenizer's ids, then
    the model's EOS), for `/v1/translate` and the chat route alike.

    Raises:
      BadRequest (naming `param`): text the tokenizer cannot take, or longer than the engine's inputs.
    """
    ids = self.encode(self.restored.source_tokenizer, text, param, plain=True) + [self.restored.config.model.eos_id]
    if len(ids) > self.engine.max_input_len:
      raise BadRequest(
        f"the input is {len(ids)} tokens long; this model takes at most {self.engine.max_input_len}",
        param,
        code="context_length_exceeded",
      )
    return ids

  def attach(self, requests: list[Request]) -> asyncio.Queue:
    """Submits `requests` to the engine thread; their tokens (and a None at each end) arrive as
    `(request, token)` on the returned queue. Counts them in the metrics.

    Raises:
      QueueFull: no room in the queue. BadRequest: a request the engine refuses.
    """
    loop, queue, submitted = asyncio.get_running_loop(), asyncio.Queue(), time.monotonic()

    def on_token(request, token):
      self.metrics.on_token(request, token, submitted)
      loop.call_soon_threadsafe(queue.put_nowait, (request, token))

    for r in requests:
      r.on_token = on_token
    try:
      self.worker.submit(requests)
    except ApiError:
      raise
    except ValueError as e:
      raise BadRequest(str(e)) from None
    return queue

  async def wait(self, http: HttpRequest, requests: list[Request], queue: asyncio.Queue) -> None:
    """Waits for `requests` (attached with `queue`); cancels them if the client goes away
    (CancelledError) or the timeout passes (TimeoutError), which frees their slots and pages
    at the next step.

    Raises:
      QueueFull: the engine failed a request (out of pages, or a decoding error).
    """
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


def serve(
  restored,
  *,
  host: str = "127.0.0.1",
  port: int = 8000,
  max_batch: int = 8,
  max_queue: int = 64,
  page_size: int = 16,
  num_pages: int | None = None,
  request_timeout: float = 120.0,
  batching: str = "continuous",
  api_key: str | None = None,
  max_request_bytes: int = MAX_REQUEST_BYTES,
  model_name: str | None = None,
) -> None:
  """Builds the engine over `restored` (`batching`: "continuous" or "static", see
  `inference.engine`) and serves it with uvicorn until SIGTERM/SIGINT (which drain in-flight
  requests first). `api_key`, `max_request_bytes` and `model_name` as in `Server`; serving on
  a non-loopback `host` without a key prints a one-line warning."""
  import uvicorn  # noqa: PLC0415  (only the serve command needs it)

  from jaxformer.inference.options import SearchOptions  # noqa: PLC0415
  from jaxformer.tasks import evaluate  # noqa: PLC0415

  cfg = restored.config
  engine = Engine(
    restored.model,
    restored.params,
    max_batch=max_batch,
    page_size=page_size,
    num_pages=num_pages,
    max_input_len=min(cfg.data.max_length, cfg.model.max_length),
    batching=batching,
  )

  def decode_beam(texts, beam):
    return evaluate.translate(restored, texts, max_batch, SearchOptions(beam_size=beam))[0]

  server = Server(
    restored,
    engine,
    max_queue=max_queue,
    request_timeout=request_timeout,
    decode_beam=decode_beam,
    api_key=api_key,
    max_request_bytes=max_request_bytes,
    model_name=model_name,
  )
  warning = open_warning(host, api_key)
  if warning:
    print(warning, file=sys.stderr, flush=True)
  uvicorn.run(server.app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=request_timeout)
