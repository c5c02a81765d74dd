"""API keys: with a key set (`--api-key KEY` or the `JAXFORMER_API_KEY` environment variable),
every `/v1/*` route needs `Authorization: Bearer KEY` and answers 401 otherwise; `/health` and
`/metrics` stay open. Serving on a non-loopback address without a key prints a warning."""

from __future__ import annotations

import hmac
import ipaddress
import os

from starlette.datastructures import Headers

from jaxformer.serve.errors import ApiError

ENV_KEY = "JAXFORMER_API_KEY"
PROTECTED = "/v1/"


def resolve_api_key(flag: str | None) -> str | None:
  """The key to require: `flag` (--api-key), else $JAXFORMER_API_KEY, else None (no key; empty counts as none)."""
  return flag or os.environ.get(ENV_KEY) or None


def open_warning(host: str, api_key: str | None) -> str | None:
  """A one-line warning when `host` is reachable beyond this machine and no key is set, else None."""
  if api_key:
    return None
  try:
    loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    loopback = host == "localhost"
  if loopback:
    return None
  return (
    f"warning: serving on {host} without an API key: anyone who can reach it can use the model; "
    f"pass --api-key KEY or set {ENV_KEY}"
  )


class ApiKeyMiddleware:
  """ASGI middleware answering 401 (OpenAI-style body) to `/v1/*` requests without
  `Authorization: Bearer <api_key>`; passes everything through when `api_key` is None."""

  def __init__(self, app, api_key: str | None):
    self.app, self.key = app, (api_key or "").encode()

  async def __call__(self, scope, receive, send):
    """The ASGI entry point."""
    if self.key and scope["type"] == "http" and scope["path"].startswith(PROTECTED):
      scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
      if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
        message = (
          "missing API key: send the header 'Authorization: Bearer KEY'"
          if not token
          else "invalid API key: send the key the server was started with (--api-key or JAXFORMER_API_KEY)"
        )
        error = ApiError(message, status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)
        return
    await self.app(scope, receive, send)
