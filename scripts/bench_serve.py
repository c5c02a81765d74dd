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

  PYTHONPATH=. nice -n 5 python scripts/bench_serve.py --workdir runs/main_check --rate 15 > /tmp/bench_serve.txt

Prints a markdown table; the last stdout line is one JSON object.
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
from jaxformer.data.sources.base import PAIRS
from jaxformer.inference.restore import workdir_config

ROOT = Path(__file__).resolve().parent.parent


def source_sentences(workdir: str) -> list[str]:
  """The source side of the run's test split (non-empty lines)."""
  config = workdir_config(workdir)
  return [src for src, _ in make_source(config.data, PAIRS).examples("test") if src.strip()]


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
    command = [sys.executable, "-m", "jaxformer", "serve", "--workdir", args.workdir, "--port", str(self.port),
               "--batching", mode, "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
               "--request-timeout", str(args.timeout), *args.overrides]
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


def translate_streaming(port: int, text: str, arrival: float, timeout: float) -> dict:
  """One streamed /v1/translate; times in seconds from `arrival` (a `time.monotonic()` value)."""
  deadline, result = arrival + timeout, {"ok": False, "tokens": 0, "text": ""}
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(deadline - time.monotonic(), 0.1))
  try:
    conn.request("POST", "/v1/translate", json.dumps({"text": text, "stream": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
      result["error"] = f"HTTP {response.status}"
      return result
    for line in response:
      if time.monotonic() > deadline:
        result["error"] = "timeout"
        return result
      line = line.decode().strip()
      if not line.startswith("data: "):
        continue
      payload = line[len("data: "):]
      if payload == "[DONE]":
        result.update(ok="error" not in result, latency=time.monotonic() - arrival)
        return result
      event = json.loads(payload)
      if "error" in event:
        result["error"] = event["error"]
        continue
      result.setdefault("ttft", time.monotonic() - arrival)
      result["tokens"] += 1
      result["text"] += event["text"]
    result["error"] = "the stream ended without [DONE]"
  except (OSError, http.client.HTTPException) as e:
    result["error"] = "timeout" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
  finally:
    conn.close()
    result["end"] = time.monotonic()
  return result


def drive(server: ServerProcess, schedule: list[tuple[float, str]], clients: int, timeout: float) -> dict:
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
      futures.append(pool.submit(translate_streaming, server.port, text, start + t, timeout))
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
  return {"completed": len(done), "failed": len(results) - len(done), "errors": errors, "wall_s": wall,
          "sentences_per_s": len(done) / wall, "tokens_per_s": sum(r["tokens"] for r in done) / wall,
          "latency_p50_s": pct("latency", 50), "latency_p99_s": pct("latency", 99),
          "ttft_p50_s": pct("ttft", 50), "ttft_p99_s": pct("ttft", 99),
          "peak_waiting": max((h["waiting"] for h in polled), default=0),
          "mean_running": float(np.mean([h["running"] for h in polled])) if polled else 0.0,
          "translations": [r["text"] if r["ok"] else None for r in results]}


ROWS = [("completed", "completed", "{:d}"), ("failed", "failed", "{:d}"), ("sentences/s", "sentences_per_s", "{:.2f}"),
        ("generated tokens/s", "tokens_per_s", "{:.1f}"), ("latency p50 (s)", "latency_p50_s", "{:.2f}"),
        ("latency p99 (s)", "latency_p99_s", "{:.2f}"), ("TTFT p50 (s)", "ttft_p50_s", "{:.3f}"),
        ("TTFT p99 (s)", "ttft_p99_s", "{:.3f}"), ("peak queue (waiting)", "peak_waiting", "{:d}"),
        ("mean busy slots", "mean_running", "{:.1f}")]


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


def main() -> None:
  """Runs the benchmark (see the module docstring)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, help="a trained translation run (its newest checkpoint is served)")
  p.add_argument("--modes", default="continuous,static", help="batching modes, run in this order")
  p.add_argument("--rate", type=float, default=15.0, help="mean arrivals per second (Poisson)")
  p.add_argument("--requests", type=int, default=200, help="arrivals at most")
  p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals at most")
  p.add_argument("--clients", type=int, default=32, help="concurrent client threads (in-flight requests at most)")
  p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
  p.add_argument("--max-queue", type=int, default=64, help="the server's --max-queue")
  p.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take from its arrival")
  p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /health")
  p.add_argument("--seed", type=int, default=0, help="seed of the arrival times and sentences")
  p.add_argument("overrides", nargs="*", help="passed to `jaxformer serve`, e.g. runtime.num_cpu_devices=1")
  args = p.parse_args()
  sentences = source_sentences(args.workdir)
  schedule = arrivals(sentences, args.rate, args.requests, args.duration, args.seed)
  print(f"{len(schedule)} arrivals over {schedule[-1][0]:.1f} s (rate {args.rate}/s, {len(sentences)} test "
        f"sentences), {args.clients} clients, max_batch {args.max_batch}", flush=True)
  figures = {}
  for mode in args.modes.split(","):
    server = ServerProcess(args, mode)
    try:
      server.wait_ready(args.ready_timeout)
      for text in warmup_sentences(sentences):
        warm = translate_streaming(server.port, text, time.monotonic(), args.ready_timeout)
        if not warm["ok"]:
          raise RuntimeError(f"warm-up request failed: {warm.get('error')}")
      figures[mode] = drive(server, schedule, args.clients, args.timeout)
    finally:
      server.stop()
    print(f"{mode}: " + json.dumps({k: v for k, v in figures[mode].items() if k != "translations"}), flush=True)
  print(table(figures))
  both = [m["translations"] for m in figures.values()]
  same = None if len(both) != 2 else all(a == b for a, b in zip(*both) if a is not None and b is not None)
  modes = list(figures)
  summary = {"rate": args.rate, "arrivals": len(schedule), "clients": args.clients, "max_batch": args.max_batch,
             "seed": args.seed, "same_translations": same,
             "modes": {m: {k: v for k, v in f.items() if k != "translations"} for m, f in figures.items()}}
  if len(modes) == 2:
    summary["ratio"] = {key: figures[modes[0]][key] / figures[modes[1]][key] if figures[modes[1]][key] else None
                        for _, key, _ in ROWS if key.endswith(("_s", "_per_s"))}
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
