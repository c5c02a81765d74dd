#!/usr/bin/env python
"""Serving load benchmark: continuous against static batching of the same engine, in one run.

For each mode in turn (`--modes`, default continuous then static) the real server is started
as a subprocess with the same settings but `--batching`:

  python -m jaxformer serve --workdir W --port P --batching X --max-batch N --max-queue Q [overrides]

and, once /health answers and a few warm-up sentences (one per length band, so every prefill
width is compiled) have been translated, a bounded pool of `--clients` client threads
(stdlib http.client, streaming requests) sends test-split source sentences of the run's
dataset (test2016 for multi30k) drawn at random, arriving as a Poisson process of `--rate`
requests/s: `--requests` arrivals or the ones within `--duration` seconds, whichever are
fewer. The seed fixes the arrival times and the sentences, so both modes get the same load.

Times are measured from each request's scheduled arrival (a request waiting for a free client
counts as waiting, so an overloaded server is not hidden): latency to the `[DONE]` event, time
to first token (TTFT) to the first token event. A request fails on a non-200 answer, an error
event, a broken connection or when it passes `--timeout` seconds. Per mode: completed/failed,
sentences/s and generated tokens/s (EOS included) over the run's wall time (first arrival to
last answer), latency and TTFT p50/p99, and the server's peak queue and mean busy slots
(/health polled every 0.25 s); then continuous/static ratios and whether both modes gave the
same translations (they must: rows decode independently of the batch).

  PYTHONPATH=. nice -n 5 python benchmarks/bench_serve.py --workdir runs/main_check --rate 15 > /tmp/bench_serve.txt

Through the OpenAI routes: `--routes own,openai` drives each mode's server with the same
schedule once per route, in that order. `own` is the server's own route, `openai` the OpenAI
route that serves the same model: for a translation model `/v1/translate` and
`/v1/chat/completions` (the source as the one user message; greedy, capped at source length
+ 50 like `/v1/translate`; `/v1/completions` refuses translation models), for a decoder-only
model `/v1/generate` and `/v1/completions` (`temperature` 0, `--max-new-tokens` from both; the
prompts are the lines of the run's test text, or validation text where it has no test split,
short enough to leave room for them). Both are spoken to with the same stdlib client, so they
differ only in the routes' work and what they send. OpenAI streams ask for
`stream_options.include_usage`, whose `completion_tokens` gives the generated tokens; their
TTFT is the first chunk with text. Per route: the table and continuous/static ratios, and
whether the routes gave the same texts.

`--overhead-rounds R` then measures the OpenAI layer's cost on the first mode's server, one
request at a time: each round sends the schedule's first `--overhead-requests` texts through
both routes, plain and streamed, the route order alternating from round to round; per kind,
the median time per request of each route, their ratio, and the median of the paired (same
text, same round) openai/own ratios and differences.

`--rounds N` (N > 1) starts every mode's server at once (an idle one waits without using the
CPU) and drives each (mode, route) N times with the same schedule, the order reversed from
round to round, so that a busy spell on a shared machine falls on all of them; the tables give
the medians over rounds (completed and failed summed, the highest peak queue), and the
first/second mode ratios of each round are printed and kept in the JSON.

  PYTHONPATH=. python benchmarks/bench_serve.py --workdir W --routes own,openai --overhead-rounds 6

Prints a markdown table (one per route when there are several, then the overhead table); the
last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxformer.data.sources import make_source
from jaxformer.data.sources.base import PAIRS, TEXT
from jaxformer.inference.restore import workdir_config
from jaxformer.tasks import get_task

ROOT = Path(__file__).resolve().parent.parent


def source_sentences(workdir: str, max_chars: int = 10**9) -> list[str]:
  """The source side of the run's test split (non-empty lines); for a model that generates
  (decoder-only), the non-empty lines of at most `max_chars` characters of its test text
  (validation where the source has no test split)."""
  config = workdir_config(workdir)
  if not get_task(config).generates:
    return [src for src, _ in make_source(config.data, PAIRS).examples("test") if src.strip()]
  source = make_source(config.data, TEXT)
  split = "test" if "test" in source.splits() else "validation"
  lines = (line.strip() for doc in source.examples(split) for line in doc.splitlines())
  return [line for line in lines if line and len(line) <= max_chars]


def arrivals(sentences: list[str], rate: float, count: int, duration: float, seed: int) -> list[tuple[float, str]]:
  """(seconds after the start, sentence) of a Poisson process of `rate` per second: at most
  `count` arrivals, all before `duration`."""
  rng, t, out = random.Random(seed), 0.0, []
  while len(out) < count:
    t += rng.expovariate(rate)
    if t >= duration:
      break
    out.append((t, sentences[rng.randrange(len(sentences))]))
  return out


def warmup_sentences(sentences: list[str], count: int = 8) -> list[str]:
  """`count` sentences spread over the character lengths, the longest included."""
  ordered = sorted(set(sentences), key=len)
  return [ordered[round(i * (len(ordered) - 1) / (count - 1))] for i in range(count)]


class ServerProcess:
  """`jaxformer serve` on a free loopback port, its output in a temp log (deleted by `stop`)."""

  def __init__(self, args, mode: str):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.port = s.getsockname()[1]
    self.log = Path(tempfile.mkdtemp(prefix="bench_serve_")) / f"{mode}.log"
    command = [
      sys.executable,
      "-m",
      "jaxformer",
      "serve",
      "--workdir",
      args.workdir,
      "--port",
      str(self.port),
      "--batching",
      mode,
      "--max-batch",
      str(args.max_batch),
      "--max-queue",
      str(args.max_queue),
      "--request-timeout",
      str(args.timeout),
      *args.overrides,
    ]
    with open(self.log, "w") as out:
      self.proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

  def stop(self) -> None:
    """SIGTERM (the server drains and exits), SIGKILL after 30 s; deletes the log."""
    self.proc.terminate()
    try:
      self.proc.wait(30)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
    shutil.rmtree(self.log.parent, ignore_errors=True)

  def get(self, path: str, timeout: float = 5.0) -> tuple[int, dict]:
    """(HTTP status, JSON body) of GET `path` on the server."""
    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
    try:
      conn.request("GET", path)
      response = conn.getresponse()
      return response.status, json.loads(response.read())
    finally:
      conn.close()

  def wait_ready(self, timeout: float) -> None:
    """Raises RuntimeError (with the log's tail) if the server exits or /health stays silent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        break
      try:
        if self.get("/health")[0] == 200:
          return
      except OSError:
        pass
      time.sleep(0.5)
    raise RuntimeError(f"the server did not become ready:\n{self.log.read_text()[-3000:]}")


class Api:
  """How one route is asked for a workload text and how its answer reads: `own` (/v1/translate
  or /v1/generate) or `openai` (/v1/chat/completions or /v1/completions), by the model's kind."""

  def __init__(self, route: str, generates: bool, max_new_tokens: int, model: str | None = None):
    self.route, self.generates, self.max_new, self.model = route, generates, max_new_tokens, model
    self.openai = route == "openai"
    self.path = {
      (False, False): "/v1/translate",
      (False, True): "/v1/chat/completions",
      (True, False): "/v1/generate",
      (True, True): "/v1/completions",
    }[generates, self.openai]

  def body(self, text: str, stream: bool) -> dict:
    """The JSON body asking for `text`'s translation or greedy continuation."""
    if not self.openai:
      if self.generates:
        return {"prompt": text, "max_new_tokens": self.max_new, "stream": stream}
      return {"text": text, "stream": stream}
    body = {"model": self.model, "stream": stream}
    if self.generates:
      body.update(prompt=text, max_tokens=self.max_new, temperature=0)
    else:
      body["messages"] = [{"role": "user", "content": text}]
    if stream:
      body["stream_options"] = {"include_usage": True}
    return body

  def text(self, answer: dict) -> str:
    """The text of a plain (not streamed) answer."""
    if not self.openai:
      return answer["text" if self.generates else "translation"]
    choice = answer["choices"][0]
    return choice["text"] if self.generates else choice["message"]["content"]

  def read(self, event: dict, result: dict) -> bool:
    """Adds a stream event's text (and tokens) to `result`; whether it is the first token's."""
    if not self.openai:
      result["tokens"] += 1
      result["text"] += event["text"]
      return True
    if event.get("usage"):
      result["tokens"] = event["usage"]["completion_tokens"]
    first = False
    for choice in event.get("choices", []):
      piece = choice["text"] if self.generates else (choice.get("delta") or {}).get("content") or ""
      result["text"] += piece
      first |= bool(piece or choice.get("finish_reason"))
    return first


def post(port: int, api: Api, text: str, arrival: float, timeout: float, stream: bool = True) -> dict:
  """One request for `text` through `api`, streamed or plain; times in seconds from `arrival` (a
  `time.monotonic()` value): `latency` to the `[DONE]` event (plain: the whole answer read), `ttft`
  to the first token's event."""
  deadline, result = arrival + timeout, {"ok": False, "tokens": 0, "text": ""}
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(deadline - time.monotonic(), 0.1))
  try:
    conn.request("POST", api.path, json.dumps(api.body(text, stream)), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
      result["error"] = f"HTTP {response.status}"
      return result
    if not stream:
      result.update(text=api.text(json.loads(response.read())), ok=True, latency=time.monotonic() - arrival)
      return result
    for line in response:
      if time.monotonic() > deadline:
        result["error"] = "timeout"
        return result
      line = line.decode().strip()
      if not line.startswith("data: "):
        continue
      payload = line[len("data: ") :]
      if payload == "[DONE]":
        result.update(ok="error" not in result, latency=time.monotonic() - arrival)
        return result
      event = json.loads(payload)
      if "error" in event:
        result["error"] = event["error"] if isinstance(event["error"], str) else event["error"].get("message")
        continue
      if api.read(event, result):
        result.setdefault("ttft", time.monotonic() - arrival)
    result["error"] = "the stream ended without [DONE]"
  except (OSError, http.client.HTTPException) as e:
    result["error"] = "timeout" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
  finally:
    conn.close()
    result["end"] = time.monotonic()
  return result


def drive(server: ServerProcess, api: Api, schedule: list[tuple[float, str]], clients: int, timeout: float) -> dict:
  """Sends `schedule` through `clients` threads; returns the mode's figures and translations."""
  polled, stop = [], threading.Event()

  def poll():
    while not stop.wait(0.25):
      try:
        polled.append(server.get("/health")[1])
      except OSError:
        pass

  poller = threading.Thread(target=poll, daemon=True)
  start = time.monotonic() + 0.5
  poller.start()
  with ThreadPoolExecutor(clients) as pool:
    futures = []
    for t, text in schedule:
      time.sleep(max(start + t - time.monotonic(), 0.0))
      futures.append(pool.submit(post, server.port, api, text, start + t, timeout))
    results = [f.result() for f in futures]
  wall = max(r["end"] for r in results) - (start + schedule[0][0])
  stop.set()
  poller.join()
  done = [r for r in results if r["ok"]]
  errors: dict[str, int] = {}
  for r in results:
    if not r["ok"]:
      errors[r.get("error", "?")] = errors.get(r.get("error", "?"), 0) + 1

  def pct(key, q):
    return float(np.percentile([r[key] for r in done], q)) if done else float("nan")

  return {
    "completed": len(done),
    "failed": len(results) - len(done),
    "errors": errors,
    "wall_s": wall,
    "sentences_per_s": len(done) / wall,
    "tokens_per_s": sum(r["tokens"] for r in done) / wall,
    "latency_p50_s": pct("latency", 50),
    "latency_p99_s": pct("latency", 99),
    "ttft_p50_s": pct("ttft", 50),
    "ttft_p99_s": pct("ttft", 99),
    "peak_waiting": max((h["waiting"] for h in polled), default=0),
    "mean_running": float(np.mean([h["running"] for h in polled])) if polled else 0.0,
    "translations": [r["text"] if r["ok"] else None for r in results],
  }


RATIO_ROWS = [
  ("sentences/s", "sentences_per_s"),
  ("latency p50", "latency_p50_s"),
  ("latency p99", "latency_p99_s"),
  ("TTFT p50", "ttft_p50_s"),
]


def round_ratios(by_mode: dict[str, list[dict]], key: str) -> list[float]:
  """The first mode's `key` over the second's, round by round (two modes)."""
  first, second = by_mode.values()
  return [a[key] / b[key] if b[key] else float("nan") for a, b in zip(first, second)]


ROWS = [
  ("completed", "completed", "{:d}"),
  ("failed", "failed", "{:d}"),
  ("sentences/s", "sentences_per_s", "{:.2f}"),
  ("generated tokens/s", "tokens_per_s", "{:.1f}"),
  ("latency p50 (s)", "latency_p50_s", "{:.2f}"),
  ("latency p99 (s)", "latency_p99_s", "{:.2f}"),
  ("TTFT p50 (s)", "ttft_p50_s", "{:.3f}"),
  ("TTFT p99 (s)", "ttft_p99_s", "{:.3f}"),
  ("peak queue (waiting)", "peak_waiting", "{:d}"),
  ("mean busy slots", "mean_running", "{:.1f}"),
]


def table(figures: dict[str, dict]) -> str:
  """A Markdown table of the figures per batching mode (and their ratio for two modes)."""
  modes = list(figures)
  ratio = len(modes) == 2
  head = "| | " + " | ".join(modes) + (f" | {modes[0]}/{modes[1]} |" if ratio else " |")
  lines = [head, "|---" * (len(modes) + 1 + ratio) + "|"]
  for label, key, fmt in ROWS:
    values = [figures[m][key] for m in modes]
    cells = [fmt.format(v) for v in values]
    if ratio:
      cells.append(f"{values[0] / values[1]:.2f}" if values[1] else "-")
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def overhead(port: int, apis: dict[str, Api], texts: list[str], rounds: int, timeout: float) -> dict:
  """Times `texts` one request at a time through `apis["own"]` and `apis["openai"]`, plain and
  streamed, for `rounds` rounds (the route order alternating by round); per kind the medians,
  their ratio, and the medians of the paired openai/own ratios and differences."""
  for text in texts[:2]:  # untimed: every path once
    for api in apis.values():
      for stream in (False, True):
        post(port, api, text, time.monotonic(), timeout, stream)
  rows: dict[bool, list[tuple[int, float, float]]] = {False: [], True: []}
  failed = differ = 0
  for k in range(rounds):
    order = ("own", "openai") if k % 2 == 0 else ("openai", "own")
    for text in texts:
      for stream in (False, True):
        got = {route: post(port, apis[route], text, time.monotonic(), timeout, stream) for route in order}
        if not all(r["ok"] for r in got.values()):
          failed += 1
          continue
        differ += got["own"]["text"] != got["openai"]["text"]
        rows[stream].append((k, got["own"]["latency"], got["openai"]["latency"]))
  out: dict = {"rounds": rounds, "texts": len(texts), "failed_pairs": failed, "differing_texts": differ}
  for stream, found in rows.items():
    if not found:
      continue
    k, own, openai = (np.array(c) for c in zip(*found))
    out["streamed" if stream else "plain"] = {
      "pairs": len(found),
      "own_median_ms": float(np.median(own)) * 1e3,
      "openai_median_ms": float(np.median(openai)) * 1e3,
      "ratio_of_medians": float(np.median(openai) / np.median(own)),
      "paired_ratio_median": float(np.median(openai / own)),
      "paired_diff_median_ms": float(np.median(openai - own)) * 1e3,
      "round_ratios": [
        float(np.median(openai[k == r]) / np.median(own[k == r])) for r in range(rounds) if (k == r).any()
      ],
    }
  return out


def overhead_table(figures: dict, apis: dict[str, Api]) -> str:
  """A Markdown table of `overhead`'s figures."""
  own, openai = apis["own"].path, apis["openai"].path
  lines = [
    f"| one request at a time | `{own}` median (ms) | `{openai}` median (ms) | ratio of medians | "
    "paired ratio, median | paired difference, median (ms) | per-round ratios |",
    "|---" * 7 + "|",
  ]
  for kind in ("plain", "streamed"):
    if kind in figures:
      f = figures[kind]
      lines.append(
        f"| {kind} ({f['pairs']} pairs) | {f['own_median_ms']:.1f} | {f['openai_median_ms']:.1f} | "
        f"{f['ratio_of_medians']:.3f} | {f['paired_ratio_median']:.3f} | {f['paired_diff_median_ms']:.2f} | "
        + " ".join(f"{r:.2f}" for r in f["round_ratios"])
        + " |"
      )
  return "\n".join(lines)


def launch(args, modes: list[str], apis: dict[str, Api], sentences: list[str]) -> dict[str, ServerProcess]:
  """A server per mode, started at once; returned when each is ready and warm through every
  api (all stopped if one fails)."""
  servers = {mode: ServerProcess(args, mode) for mode in modes}
  try:
    for server in servers.values():
      server.wait_ready(args.ready_timeout)
      if "openai" in apis:
        apis["openai"].model = server.get("/v1/models")[1]["data"][0]["id"]
      for api in apis.values():
        for text in warmup_sentences(sentences):
          warm = post(server.port, api, text, time.monotonic(), args.ready_timeout)
          if not warm["ok"]:
            raise RuntimeError(f"warm-up request to {api.path} failed: {warm.get('error')}")
  except BaseException:
    for server in servers.values():
      server.stop()
    raise
  return servers


def merge(runs: list[dict]) -> dict:
  """One mode's figures over rounds: the medians (peak queue: the highest; completed, failed
  and errors: summed; the first round's texts, and whether every round gave them)."""
  if len(runs) == 1:
    return runs[0]
  out = {}
  for key, value in runs[0].items():
    values = [r[key] for r in runs]
    if key in ("completed", "failed"):
      out[key] = sum(values)
    elif key == "peak_waiting":
      out[key] = max(values)
    elif key == "errors":
      out[key] = {e: sum(v.get(e, 0) for v in values) for e in dict.fromkeys(e for v in values for e in v)}
    elif key == "translations":
      out[key] = value
      out["same_across_rounds"] = all(
        a == b for r in runs[1:] for a, b in zip(value, r[key]) if a is not None and b is not None
      )
    else:
      out[key] = float(np.median(values))
  return out


def same_texts(figures: dict[str, dict]) -> bool | None:
  """Whether two runs gave the same texts for every request both completed (None unless two)."""
  both = [m["translations"] for m in figures.values()]
  return None if len(both) != 2 else all(a == b for a, b in zip(*both) if a is not None and b is not None)


def main() -> None:
  """Runs the benchmark (see the module docstring)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--workdir",
    required=True,
    help="a trained run (its newest checkpoint is served): a translation model, or a decoder-only one",
  )
  p.add_argument("--modes", default="continuous,static", help="batching modes, run in this order")
  p.add_argument(
    "--routes",
    default="own",
    help="routes to load, in this order: own (/v1/translate or /v1/generate) "
    "and/or openai (/v1/chat/completions or /v1/completions)",
  )
  p.add_argument("--rate", type=float, default=15.0, help="mean arrivals per second (Poisson)")
  p.add_argument("--requests", type=int, default=200, help="arrivals at most")
  p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals at most")
  p.add_argument("--clients", type=int, default=32, help="concurrent client threads (in-flight requests at most)")
  p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
  p.add_argument("--max-queue", type=int, default=64, help="the server's --max-queue")
  p.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take from its arrival")
  p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /health")
  p.add_argument("--seed", type=int, default=0, help="seed of the arrival times and sentences")
  p.add_argument(
    "--rounds",
    type=int,
    default=1,
    help="loads per mode and route; above 1 every mode's server runs "
    "at once and the loads alternate, the order reversed by round, and the tables give medians",
  )
  p.add_argument("--max-new-tokens", type=int, default=32, help="decoder-only models: tokens generated per prompt")
  p.add_argument(
    "--overhead-rounds",
    type=int,
    default=0,
    help="rounds of one-at-a-time requests through own and openai on the first mode's server (0: none)",
  )
  p.add_argument("--overhead-requests", type=int, default=16, help="texts per overhead round: the schedule's first N")
  p.add_argument("overrides", nargs="*", help="passed to `jaxformer serve`, e.g. runtime.num_cpu_devices=1")
  args = p.parse_args()
  routes = args.routes.split(",")
  if not routes or set(routes) - {"own", "openai"} or len(set(routes)) != len(routes):
    p.error(f"--routes takes own and/or openai, got {args.routes!r}")
  if args.rounds < 1:
    p.error(f"--rounds must be >= 1, got {args.rounds}")
  config = workdir_config(args.workdir)
  generates = get_task(config).generates
  used = list(dict.fromkeys(routes + (["own", "openai"] if args.overhead_rounds else [])))
  sentences = source_sentences(args.workdir, config.model.max_length - args.max_new_tokens - 2)
  schedule = arrivals(sentences, args.rate, args.requests, args.duration, args.seed)
  print(
    f"{len(schedule)} arrivals over {schedule[-1][0]:.1f} s (rate {args.rate}/s, {len(sentences)} test "
    f"sentences), {args.clients} clients, max_batch {args.max_batch}",
    flush=True,
  )
  modes = args.modes.split(",")
  apis = {route: Api(route, generates, args.max_new_tokens) for route in used}
  runs: dict[str, dict[str, list[dict]]] = {route: {mode: [] for mode in modes} for route in routes}
  over = None

  def measure(servers: dict[str, ServerProcess], pairs: list[tuple[str, str]], heading: str = "") -> None:
    for mode, route in pairs:
      runs[route][mode].append(drive(servers[mode], apis[route], schedule, args.clients, args.timeout))
      label = (mode if routes == ["own"] else f"{mode} {route}") + heading
      print(
        f"{label}: " + json.dumps({k: v for k, v in runs[route][mode][-1].items() if k != "translations"}), flush=True
      )

  def measure_overhead(server: ServerProcess, mode: str) -> dict:
    texts = [text for _, text in schedule[: args.overhead_requests]]
    figures = overhead(server.port, apis, texts, args.overhead_rounds, args.timeout)
    print(f"overhead ({mode}): " + json.dumps(figures), flush=True)
    return figures

  if args.rounds == 1:  # one server at a time
    for mode in modes:
      servers = launch(args, [mode], apis, sentences)
      try:
        measure(servers, [(mode, route) for route in routes])
        if args.overhead_rounds and over is None:
          over = measure_overhead(servers[mode], mode)
      finally:
        servers[mode].stop()
  else:  # every server up at once (an idle one waits without using the CPU), the order reversed by round
    servers = launch(args, modes, apis, sentences)
    try:
      pairs = [(mode, route) for mode in modes for route in routes]
      for k in range(args.rounds):
        measure(servers, pairs if k % 2 == 0 else pairs[::-1], f" round {k + 1}")
      if args.overhead_rounds:
        over = measure_overhead(servers[modes[0]], modes[0])
    finally:
      for server in servers.values():
        server.stop()
  figures = {route: {mode: merge(runs[route][mode]) for mode in modes} for route in routes}
  for route in routes:
    if routes != ["own"]:
      print(f"\n{route}: `{apis[route].path}`\n")
    print(table(figures[route]))
    if args.rounds > 1 and len(modes) == 2:
      print(
        f"\nmedians of {args.rounds} rounds; {modes[0]}/{modes[1]} by round: "
        + "; ".join(
          f"{label} " + " ".join(f"{r:.2f}" for r in round_ratios(runs[route], key)) for label, key in RATIO_ROWS
        )
      )
  if over is not None:
    print(f"\nOpenAI layer overhead, {args.modes.split(',')[0]} server\n\n{overhead_table(over, apis)}\n")

  def summarise(figs: dict[str, dict]) -> dict:
    modes = list(figs)
    out = {
      "same_translations": same_texts(figs),
      "modes": {m: {k: v for k, v in f.items() if k != "translations"} for m, f in figs.items()},
    }
    if len(modes) == 2:
      out["ratio"] = {
        key: figs[modes[0]][key] / figs[modes[1]][key] if figs[modes[1]][key] else None
        for _, key, _ in ROWS
        if key.endswith(("_s", "_per_s"))
      }
    return out

  def summarise_route(route: str) -> dict:
    out = {"path": apis[route].path, **summarise(figures[route])}
    if args.rounds > 1 and len(modes) == 2:
      out["round_ratios"] = {key: round_ratios(runs[route], key) for _, key in RATIO_ROWS}
      out["median_round_ratio"] = {key: float(np.median(v)) for key, v in out["round_ratios"].items()}
    return out

  summary = {
    "rate": args.rate,
    "arrivals": len(schedule),
    "clients": args.clients,
    "max_batch": args.max_batch,
    "seed": args.seed,
    **summarise(figures[routes[0]]),
  }
  if args.rounds > 1:
    summary["rounds"] = args.rounds
  if routes != ["own"]:
    summary["routes"] = {route: summarise_route(route) for route in routes}
    if len(routes) == 2:
      summary["same_across_routes"] = all(same_texts({r: figures[r][m] for r in routes}) for m in figures[routes[0]])
  if over is not None:
    summary["overhead"] = over
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
