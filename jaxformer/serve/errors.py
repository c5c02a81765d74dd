"""The answers a client mistake gets: an exception per kind, and the OpenAI-style error body.

Every error of the OpenAI routes (and the 401, 404, 405 and 413 of any route) is
`{"error": {"message", "type", "param", "code"}}`: `message` one line naming the problem and
the fix, `param` the request field at fault (or null). Our own routes (`/v1/translate`,
`/v1/generate`) keep their `{"error": "<one line>"}` bodies.
"""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
  """A request the server cannot serve, answered with `status` and an OpenAI-style body.

  Args:
    message: one line naming the problem and the fix.
    status: the HTTP status (4xx for client mistakes).
    param: the request field at fault, if any.
    code: a short machine-readable code (OpenAI's `code`), if any.
    kind: OpenAI's error `type` (default: by status).
    headers: extra response headers (e.g. Retry-After).
  """

  def __init__(
    self,
    message: str,
    *,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    kind: str | None = None,
    headers: dict[str, str] | None = None,
  ):
    super().__init__(message)
    self.message, self.status, self.param, self.code = message, status, param, code
    self.kind = kind or _KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")
    self.headers = headers or {}

  def response(self, own_route: bool = False) -> JSONResponse:
    """The JSON response: OpenAI-style, or `{"error": message}` for our own routes."""
    body = {"error": self.message} if own_route else error_body(self.message, self.kind, self.param, self.code)
    return JSONResponse(body, status_code=self.status, headers=self.headers)


_KINDS = {
  401: "authentication_error",
  404: "not_found_error",
  413: "request_too_large",
  503: "overloaded_error",
  504: "timeout_error",
}


class BadRequest(ApiError, ValueError):
  """A client mistake in the request's content: 400 (or `status`)."""

  def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None):
    super().__init__(message, status=status, param=param, code=code)


class QueueFull(ApiError, RuntimeError):
  """The waiting queue has no room (or the engine failed the request): 503 with Retry-After."""

  def __init__(self, message: str):
    super().__init__(message, status=503, code="queue_full", headers={"Retry-After": "1"})


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
  """`{"error": {"message", "type", "param", "code"}}`, the body of every OpenAI-style error."""
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}
