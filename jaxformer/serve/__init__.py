"""`jaxformer serve`: the HTTP front end of the inference engine (Starlette on uvicorn).

  * `app`: the app (`Server`) and `serve`; `worker`: the engine's thread; `errors`: the error answers;
  * `routes`: our own `/v1/translate` and `/v1/generate`;
  * `openai_routes`, `openai_params`, `openai_responses`, `chat`, `text`: the OpenAI-compatible routes;
  * `auth`: API keys; `metrics`: `/metrics` for Prometheus.
The names below are the ones other modules and tests use.
"""

from jaxformer.serve.app import MAX_REQUEST_BYTES, Server, serve
from jaxformer.serve.errors import ApiError, BadRequest, QueueFull
from jaxformer.serve.worker import EngineWorker

__all__ = ["MAX_REQUEST_BYTES", "ApiError", "BadRequest", "EngineWorker", "QueueFull", "Server", "serve"]
