"""Client mistakes and operations on the OpenAI routes of `jaxformer serve` (`openai_served`'s
model on 127.0.0.1, shared by the module): the API key (401, 401, 200; /health open), the serve
flags and the open-address warning, over 90 kinds of bad request each answered 4xx with an
OpenAI-style error while the server serves on (bodies over the limit: 413), a stream dropped
mid-way, and the /metrics counters after a known sequence of requests.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")

from openai_served import ID, KEY, NAME, PROMPTS, WINDOW, served  # noqa: E402, F401  (served: the fixture)


def test_api_key_is_required_on_v1_routes_only(served):
  body = {"model": NAME, "prompt": "hello", "max_tokens": 1}
  for key, status in ((None, 401), ("wrong-key", 401), (KEY, 200)):
    code, answer, headers = served.request("POST", "/v1/completions", body, key=key)
    assert code == status, answer
    if status == 401:
      assert answer["error"]["type"] == "authentication_error" and answer["error"]["code"] == "invalid_api_key"
      assert headers["WWW-Authenticate"] == "Bearer"
  assert served.request("GET", "/v1/models", key=None)[0] == 401
  assert served.request("GET", "/health", key=None)[0] == 200
  assert served.request("GET", "/metrics", key=None)[0] == 200
  with pytest.raises(openai.AuthenticationError):
    served.client(key="wrong-key").models.list()


def test_serve_flags_and_the_open_address_warning(monkeypatch):
  from jaxformer.cli import _parser
  from jaxformer.serve.auth import open_warning, resolve_api_key

  args = _parser().parse_args(
    ["serve", "--workdir", "w", "--api-key", "k", "--max-request-bytes", "2048", "--model-name", "m"]
  )
  assert (args.api_key, args.max_request_bytes, args.model_name) == ("k", 2048, "m")
  assert _parser().parse_args(["serve", "--workdir", "w"]).max_request_bytes == 1 << 20
  monkeypatch.setenv("JAXFORMER_API_KEY", "from-env")
  assert resolve_api_key(None) == "from-env" and resolve_api_key("flag") == "flag"
  monkeypatch.setenv("JAXFORMER_API_KEY", "")
  assert resolve_api_key(None) is None
  for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
    assert open_warning(host, None) is None
  warning = open_warning("0.0.0.0", None)
  assert warning.startswith("warning: serving on 0.0.0.0 without an API key") and "\n" not in warning
  assert open_warning("0.0.0.0", "k") is None and open_warning("example.org", None) is not None


TOO_LONG = " ".join(["cat"] * 60)
FULL = " ".join(["cat"] * (WINDOW - 1))  # with <s>: exactly the context
MSG = [{"role": "user", "content": "hello"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"
BAD = [  # (method, path, body: dict or raw bytes, extra headers, status)
  ("POST", C, b"{not json", None, 400),
  ("POST", C, b'{"prompt": "\xff\xfe"}', None, 400),
  ("POST", C, b"[1, 2]", None, 400),
  ("POST", C, b'"hello"', None, 400),
  ("POST", C, b"null", None, 400),
  ("POST", C, b"", None, 400),
  ("POST", C, b"[" * 100000, None, 400),
  ("POST", C, b'{"prompt": "cat", "max_tokens": NaN}', None, 400),
  ("POST", C, b'{"prompt": "cat", "temperature": NaN}', None, 400),
  ("POST", C, b'{"prompt": "cat", "top_p": Infinity}', None, 400),
  ("POST", C, b'{"prompt": "\\ud800 cat"}', None, 400),
  ("POST", C, {}, None, 400),
  ("POST", C, {"prompt": ""}, None, 400),
  ("POST", C, {"prompt": []}, None, 400),
  ("POST", C, {"prompt": 5}, None, 400),
  ("POST", C, {"prompt": None}, None, 400),
  ("POST", C, {"prompt": [""]}, None, 400),
  ("POST", C, {"prompt": [["cat"]]}, None, 400),
  ("POST", C, {"prompt": [1, "cat"]}, None, 400),
  ("POST", C, {"prompt": [[]]}, None, 400),
  ("POST", C, {"prompt": [-1]}, None, 400),
  ("POST", C, {"prompt": [10**9]}, None, 400),
  ("POST", C, {"prompt": [True, 5]}, None, 400),
  ("POST", C, {"prompt": [ID["<pad>"], 12]}, None, 400),
  ("POST", C, {"prompt": {"text": "cat"}}, None, 400),
  ("POST", C, {"prompt": TOO_LONG}, None, 400),
  ("POST", C, {"prompt": FULL}, None, 400),
  ("POST", C, {"prompt": "cat", "max_tokens": 0}, None, 400),
  ("POST", C, {"prompt": "cat", "max_tokens": -5}, None, 400),
  ("POST", C, {"prompt": "cat", "max_tokens": 10**12}, None, 400),
  ("POST", C, {"prompt": "cat", "max_tokens": WINDOW}, None, 400),
  ("POST", C, {"prompt": "cat", "max_tokens": "16"}, None, 400),
  ("POST", C, {"prompt": "cat", "max_tokens": 16.5}, None, 400),
  ("POST", C, {"prompt": "cat", "max_tokens": True}, None, 400),
  ("POST", C, {"prompt": "cat", "temperature": -1}, None, 400),
  ("POST", C, {"prompt": "cat", "temperature": 3}, None, 400),
  ("POST", C, {"prompt": "cat", "temperature": 1e308}, None, 400),
  ("POST", C, {"prompt": "cat", "temperature": "hot"}, None, 400),
  ("POST", C, {"prompt": "cat", "top_p": 0}, None, 400),
  ("POST", C, {"prompt": "cat", "top_p": 1.5}, None, 400),
  ("POST", C, {"prompt": "cat", "top_p": -0.1}, None, 400),
  ("POST", C, {"prompt": "cat", "top_k": -2}, None, 400),
  ("POST", C, {"prompt": "cat", "top_k": 2.5}, None, 400),
  ("POST", C, {"prompt": "cat", "seed": -1}, None, 400),
  ("POST", C, {"prompt": "cat", "seed": 2**64}, None, 400),
  ("POST", C, {"prompt": "cat", "seed": "x"}, None, 400),
  ("POST", C, {"prompt": "cat", "n": 0}, None, 400),
  ("POST", C, {"prompt": "cat", "n": 10**6}, None, 400),
  ("POST", C, {"prompt": "cat", "n": "2"}, None, 400),
  ("POST", C, {"prompt": ["cat"] * 20, "n": 4}, None, 400),
  ("POST", C, {"prompt": "cat", "stop": 5}, None, 400),
  ("POST", C, {"prompt": "cat", "stop": [""]}, None, 400),
  ("POST", C, {"prompt": "cat", "stop": ["a", "b", "c", "d", "e"]}, None, 400),
  ("POST", C, {"prompt": "cat", "stop": [1]}, None, 400),
  ("POST", C, {"prompt": "cat", "stream": "yes"}, None, 400),
  ("POST", C, {"prompt": "cat", "stream_options": {"include_usage": True}}, None, 400),
  ("POST", C, {"prompt": "cat", "stream": True, "stream_options": "x"}, None, 400),
  ("POST", C, {"prompt": "cat", "stream": True, "stream_options": {"include_usage": "y"}}, None, 400),
  ("POST", C, {"prompt": "cat", "echo": 1}, None, 400),
  ("POST", C, {"prompt": "cat", "logprobs": 6}, None, 400),
  ("POST", C, {"prompt": "cat", "logprobs": -1}, None, 400),
  ("POST", C, {"prompt": "cat", "logprobs": True}, None, 400),
  ("POST", C, {"prompt": "cat", "best_of": 3}, None, 400),
  ("POST", C, {"prompt": "cat", "suffix": "x"}, None, 400),
  ("POST", C, {"prompt": "cat", "logit_bias": {"5": 10}}, None, 400),
  ("POST", C, {"prompt": "cat", "presence_penalty": 1}, None, 400),
  ("POST", C, {"prompt": "cat", "model": "gpt-4"}, None, 404),
  ("POST", C, {"prompt": "cat", "model": 5}, None, 400),
  ("POST", C, b'{"prompt": "cat"}', {"Content-Length": "2000000"}, 413),
  ("POST", C, b'{"prompt": "' + b"cat " * 300000 + b'"}', None, 413),
  ("POST", CHAT, {}, None, 400),
  ("POST", CHAT, {"messages": []}, None, 400),
  ("POST", CHAT, {"messages": "hello"}, None, 400),
  ("POST", CHAT, {"messages": [5]}, None, 400),
  ("POST", CHAT, {"messages": [{"role": "wizard", "content": "hello"}]}, None, 400),
  ("POST", CHAT, {"messages": [{"content": "hello"}]}, None, 400),
  ("POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, None, 400),
  ("POST", CHAT, {"messages": [{"role": "user"}]}, None, 400),
  ("POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, None, 400),
  ("POST", CHAT, {"messages": [{"role": "user", "content": TOO_LONG}]}, None, 400),
  ("POST", CHAT, b'{"messages": [{"role": "user", "content": "cat \\udc00"}]}', None, 400),
  ("POST", CHAT, {"messages": [{"role": "user", "content": "cat"}], "stop": {"a": 1}}, None, 400),
  ("POST", CHAT, {"messages": MSG, "top_logprobs": 2}, None, 400),
  ("POST", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 9}, None, 400),
  ("POST", CHAT, {"messages": MSG, "logprobs": 3}, None, 400),
  ("POST", CHAT, {"messages": MSG, "max_completion_tokens": 0}, None, 400),
  ("POST", CHAT, {"messages": MSG, "max_tokens": 10**9}, None, 400),
  ("POST", CHAT, {"messages": MSG, "temperature": -0.5}, None, 400),
  ("POST", CHAT, {"messages": MSG, "n": -1}, None, 400),
  ("POST", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, None, 400),
  ("POST", CHAT, {"messages": MSG, "model": "other"}, None, 404),
  ("GET", C, None, None, 405),
  ("POST", "/v1/models", {}, None, 405),
  ("GET", "/v1/nothing", None, None, 404),
  ("GET", "/v1/models/other-model", None, None, 404),
]


@pytest.mark.parametrize("method, path, body, headers, status", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_requests_answer_4xx_openai_errors_and_the_server_serves_on(served, method, path, body, headers, status):
  code, answer, _ = served.request(method, path, body, headers)
  assert code == status, answer
  assert isinstance(answer, dict) and list(answer) == ["error"], answer
  error = answer["error"]
  assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
  assert error["message"] and "\n" not in error["message"] and error["type"]
  assert served.request("GET", "/health")[0] == 200


def test_bad_request_kinds_are_many_and_name_their_fields(served):
  assert len(BAD) >= 60
  code, answer, _ = served.request("POST", C, {"prompt": TOO_LONG})
  assert answer["error"]["param"] == "prompt" and "61 tokens long" in answer["error"]["message"]
  assert f"context is {WINDOW} tokens" in answer["error"]["message"]
  code, answer, _ = served.request("POST", C, {"prompt": "cat", "max_tokens": 10**12})
  assert answer["error"]["param"] == "max_tokens" and answer["error"]["code"] == "context_length_exceeded"
  code, answer, _ = served.request("POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]})
  assert answer["error"]["param"] == "messages[0].role" and "system, user, assistant" in answer["error"]["message"]
  # A chunked body over the limit (no Content-Length) is refused as it arrives.
  conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
  chunks = (b"x" * 65536 for _ in range(20))
  conn.request(
    "POST", C, chunks, {"Authorization": f"Bearer {KEY}", "Transfer-Encoding": "chunked"}, encode_chunked=True
  )
  response = conn.getresponse()
  assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
  conn.close()


def test_a_stream_dropped_mid_way_frees_its_slot(served):
  conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
  conn.request(
    "POST",
    C,
    json.dumps({"prompt": "hello", "max_tokens": 40, "temperature": 0, "stream": True}),
    {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
  )
  response = conn.getresponse()
  assert response.status == 200 and response.readline().startswith(b"data: {")
  conn.sock.shutdown(socket.SHUT_RDWR)
  conn.close()
  deadline = time.monotonic() + 30
  while (health := served.request("GET", "/health")[1])["running"] or health["pages_in_use"]:
    assert time.monotonic() < deadline, health
    time.sleep(0.1)
  assert health["waiting"] == 0
  out = served.client().completions.create(model=NAME, prompt="hello", max_tokens=2, temperature=0)
  assert out.usage.completion_tokens == 2


def _metrics(served):
  from prometheus_client.parser import text_string_to_metric_families

  code, text, headers = served.request("GET", "/metrics", key=None)
  assert code == 200 and headers["Content-Type"].startswith("text/plain")
  values = {}
  for family in text_string_to_metric_families(text):
    for sample in family.samples:
      values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
  return values


def test_metrics_counters_move_by_the_requests_made(served):
  """Two completions, one streamed chat, a 400 and a 401: the request counters by route and
  status, the token counters (the answers' usage), the histograms' counts, and the engine gauges."""
  before = _metrics(served)
  client = served.client()
  usages = [client.completions.create(model=NAME, prompt=p, max_tokens=3, temperature=0).usage for p in PROMPTS[:2]]
  chunks = list(
    client.chat.completions.create(
      model=NAME, messages=MSG, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
    )
  )
  usages.append(chunks[-1].usage)
  assert served.request("POST", C, {"prompt": ""})[0] == 400
  assert served.request("POST", C, {"prompt": "cat"}, key=None)[0] == 401

  def moved(name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return _metrics(served).get(key, 0.0) - before.get(key, 0.0)

  expected = {
    ("jaxformer_requests_total", C, "200"): 2,
    ("jaxformer_requests_total", C, "400"): 1,
    ("jaxformer_requests_total", C, "401"): 1,
    ("jaxformer_requests_total", CHAT, "200"): 1,
  }
  deadline = time.monotonic() + 10  # a request is counted once its answer has gone out
  while any(moved(n, route=r, status=s) != v for (n, r, s), v in expected.items()):
    assert time.monotonic() < deadline, {k: moved(k[0], route=k[1], status=k[2]) for k in expected}
    time.sleep(0.05)
  assert moved("jaxformer_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
  assert moved("jaxformer_generated_tokens_total") == sum(u.completion_tokens for u in usages) == 10
  assert moved("jaxformer_time_to_first_token_seconds_count") == 3
  assert moved("jaxformer_request_latency_seconds_count", route=C) == 4
  assert moved("jaxformer_request_latency_seconds_count", route=CHAT) == 1
  now = _metrics(served)
  assert now[("jaxformer_queue_depth", ())] == 0 and now[("jaxformer_running_requests", ())] == 0
  assert now[("jaxformer_kv_pages_in_use", ())] == 0
  assert now[("jaxformer_kv_pages_free", ())] == served.engine.pages.num_pages - 1
