"""`jaxformer serve` end to end: a tiny translation model and a tiny causal LM are trained once
through the CLI, served by real `jaxformer serve` processes, and spoken to over HTTP with the
standard library. Greedy answers equal `jaxformer translate` (alone and under concurrent load);
lists, streaming (server-sent events), beam search, seeded generation; one-line 400s, 503 on a
full queue; a client that leaves mid-stream frees its slot; SIGTERM drains the request in
flight. The engine-side queue limit is also checked in-process (`serve.EngineWorker`)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import pytest
import yaml
from conftest import COMPILE_FLAGS
from openai_served import events as sse_events
from test_cli import ROOT
from test_engine import NO_EOS, PAGE, SLOTS, SMALL_POOL, _model
from test_own_data import _reverse, _sentences

from jaxformer.inference import restore as inference_restore
from jaxformer.inference.engine import Engine, Request
from jaxformer.serve import EngineWorker, QueueFull
from jaxformer.tasks import evaluate

ONE_DEVICE = "runtime.num_cpu_devices=1"
# model.max_length 96 leaves each sentence its own cap, source length + 50 (the paper, section 6.1),
# in the server and in `translate` alike, whatever its batch-mates.
TRANSLATION = [
  "model.vocab_size=96",
  "model.d_model=32",
  "model.num_heads=2",
  "model.d_ff=48",
  "model.num_encoder_layers=1",
  "model.num_decoder_layers=1",
  "model.max_length=96",
  "model.dropout_rate=0",
  "data.max_length=32",
  "data.buckets=[16,32]",
  "data.tokenizer=bpe",
  "optim.schedule=constant",
  "optim.learning_rate=0.003",
  "train.num_steps=200",
  "train.log_every=200",
  "train.eval_every=1000",
  "train.checkpoint_every=200",
  "train.batch_size=8",
  ONE_DEVICE,
]
LANGUAGE_MODEL = [
  "model.vocab_size=96",
  "model.d_model=32",
  "model.num_heads=2",
  "model.d_ff=48",
  "model.num_decoder_layers=1",
  "model.max_length=16",
  "data.max_length=16",
  "data.tokenizer=bpe",
  "train.num_steps=2",
  "train.log_every=2",
  "train.eval_every=1000",
  "train.checkpoint_every=2",
  "train.batch_size=8",
  "train.steps_per_call=1",
  ONE_DEVICE,
]
SENTENCES = ["cat dog", "bird fish horse", "goat", "cow sheep duck frog", "horse cat bird dog fish", "sheep"]
LOOPING = "cow sheep duck frog"  # the trained model repeats a word here: an answer of many tokens
LONG = "horse cat bird dog fish sheep goat cow duck frog horse cat"  # a much longer source
NEVER = 95  # a token the trained model does not emit: EOS moved there never comes


def _env():
  env = dict(os.environ)
  env["XLA_FLAGS"] = COMPILE_FLAGS  # fast compiles; the device count comes from ONE_DEVICE
  return env


def _cli(*args, stdin=subprocess.DEVNULL):
  return subprocess.Popen(
    [sys.executable, "-m", "jaxformer", *args],
    cwd=ROOT,
    env=_env(),
    text=True,
    stdin=stdin,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
  )


def _finish(proc):
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  return out


class Served:
  """A `jaxformer serve` process on a free loopback port; `request` speaks HTTP/1.1 to it."""

  def __init__(self, workdir, log, *flags):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.port = s.getsockname()[1]
    self.log = log
    with open(log, "w") as out:
      self.proc = subprocess.Popen(
        [
          sys.executable,
          "-m",
          "jaxformer",
          "serve",
          "--workdir",
          str(workdir),
          "--host",
          "127.0.0.1",
          "--port",
          str(self.port),
          *flags,
          ONE_DEVICE,
        ],
        cwd=ROOT,
        env=_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
      )

  def wait_ready(self, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise AssertionError(f"the server exited with {self.proc.returncode}:\n{Path(self.log).read_text()[-3000:]}")
      try:
        if self.request("GET", "/health", timeout=5)[0] == 200:
          return self
      except OSError:
        pass
      time.sleep(0.2)
    raise AssertionError(f"no 200 from /health in {timeout} s:\n{Path(self.log).read_text()[-3000:]}")

  def connection(self, timeout=60.0):
    return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

  def request(self, method, path, body=None, timeout=60.0):
    """(status, parsed JSON body, headers); `body` a dict (sent as JSON) or raw bytes."""
    conn = self.connection(timeout)
    try:
      data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
      conn.request(method, path, data, {"Content-Type": "application/json"})
      response = conn.getresponse()
      return response.status, json.loads(response.read()), response.headers
    finally:
      conn.close()

  def post(self, path, body):
    status, answer, _ = self.request("POST", path, body)
    assert status == 200, answer
    return answer

  def stop(self):
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait(30)


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
  """(translation workdir, causal LM workdir), both trained at once on a small word corpus."""
  root = tmp_path_factory.mktemp("serve")
  train = _sentences(400)
  (root / "train.xx").write_text("".join(s + "\n" for s in train))
  (root / "train.yy").write_text("".join(_reverse(s) + "\n" for s in train))
  (root / "docs.txt").write_text("\n\n".join("\n".join(_sentences(3, i)) for i in range(150)) + "\n")
  data = [f"data.data_dir={root}/cache", "data.dataset=files"]
  mt = _cli(
    "train",
    "--config",
    "configs/tiny.yaml",
    "--workdir",
    str(root / "mt"),
    *TRANSLATION,
    *data,
    f"data.train_files={root}/train.xx,{root}/train.yy",
    "data.source_lang=xx",
    "data.target_lang=yy",
  )
  lm = _cli(
    "train",
    "--config",
    "configs/shakespeare_char.yaml",
    "--workdir",
    str(root / "lm"),
    *LANGUAGE_MODEL,
    *data,
    f"data.train_files={root}/docs.txt",
  )
  _finish(mt)
  _finish(lm)
  return root / "mt", root / "lm"


@pytest.fixture(scope="module")
def launched(workdirs, tmp_path_factory):
  """The translation server, the LM server and `jaxformer translate` of SENTENCES, all started
  at once (they compile side by side); the servers are killed at the end of the module."""
  logs = tmp_path_factory.mktemp("logs")
  (logs / "sentences.txt").write_text("".join(t + "\n" for t in SENTENCES))
  with open(logs / "sentences.txt") as sentences:
    translate = _cli("translate", "--workdir", str(workdirs[0]), ONE_DEVICE, stdin=sentences)
  started = {
    "mt": Served(workdirs[0], logs / "mt.log"),
    "lm": Served(workdirs[1], logs / "lm.log"),
    "translate": translate,
  }
  try:
    yield started
  finally:
    for name in ("mt", "lm"):
      started[name].stop()
    translate.kill()
    translate.wait(30)


@pytest.mark.slow
def test_int8_weights_and_a_draft_model_on_the_trained_workdir(workdirs, reference):
  """The restore path of `--quantize int8` and `--draft-workdir`: int8 weights translate (mostly
  as float32 does, on this tiny model); the target as its own draft gives its greedy output with
  every proposal accepted; a draft with another tokenizer is refused in one line."""
  mt, lm = workdirs
  config = inference_restore.workdir_config(mt, [ONE_DEVICE])
  plain = inference_restore.restore(mt, config)
  int8 = inference_restore.restore(mt, config, quantize="int8")
  assert int8.quantized == "int8" and any(type(x).__name__ == "QuantizedArray" for x in _leaves_and_nodes(int8.params))
  floats, _ = evaluate.translate(plain, SENTENCES, 8)
  assert floats == [reference[s] for s in SENTENCES]
  quantized, _ = evaluate.translate(int8, SENTENCES, 8)
  assert sum(a == b for a, b in zip(floats, quantized)) >= len(SENTENCES) // 2
  draft = inference_restore.restore_draft(mt, plain, [ONE_DEVICE], num_tokens=3)
  speculative, speed = evaluate.translate(plain, SENTENCES, 8, draft=draft)
  assert speculative == floats and speed["draft_acceptance"] == 1.0
  with pytest.raises(ValueError, match="a draft must share the target's tokenizer"):
    inference_restore.restore_draft(lm, plain, [ONE_DEVICE])


def _leaves_and_nodes(tree):
  return jax.tree.leaves(tree, is_leaf=lambda x: type(x).__name__ == "QuantizedArray")


@pytest.fixture(scope="module")
def servers(launched):
  """(translation server, LM server), answering /health."""
  return launched["mt"].wait_ready(), launched["lm"].wait_ready()


@pytest.fixture(scope="module")
def reference(launched):
  """{sentence: `jaxformer translate` (greedy) of it} on the same workdir as the server."""
  lines = _finish(launched["translate"]).splitlines()
  assert len(lines) == len(SENTENCES) and sum(bool(line) for line in lines) >= 3  # mostly non-empty answers
  return dict(zip(SENTENCES, lines))


def _health(server):
  status, health, _ = server.request("GET", "/health")
  assert status == 200 and health["status"] == "ok"
  return health


@pytest.mark.slow
def test_greedy_translations_equal_the_translate_command(servers, reference):
  mt, _ = servers
  health = _health(mt)
  assert health["model"] == "encoder_decoder" and health["step"] == 200
  for text in SENTENCES:
    assert mt.post("/v1/translate", {"text": text}) == {"translation": reference[text]}, text
  # A list answers a list, in order.
  assert mt.post("/v1/translate", {"text": SENTENCES}) == {"translation": [reference[t] for t in SENTENCES]}


@pytest.mark.slow
def test_each_sentence_is_capped_at_its_own_length(workdirs, tmp_path):
  """The paper's "input length + 50" (section 6.1) is per sentence. With a model that never emits
  EOS (the trained one, its `model.eos_id` moved to a token it does not produce), LOOPING gets
  exactly its own source length + 50 tokens, the same alone, beside the much longer LONG
  (`translate` of a batch) and over HTTP."""
  from jaxformer.data.pipeline import sentence_ids

  mt = tmp_path / "mt"
  shutil.copytree(workdirs[0], mt)
  settings = yaml.safe_load((mt / "config.yaml").read_text())
  settings["model"]["eos_id"] = NEVER
  (mt / "config.yaml").write_text(yaml.safe_dump(settings))
  served = Served(mt, tmp_path / "serve.log")  # compiles while the library decodes
  try:
    restored = inference_restore.restore(mt, inference_restore.workdir_config(mt, [ONE_DEVICE]))
    batches, _ = evaluate.decode_sources(restored, [LOOPING, LONG], 8)
    row = next(b["tokens"][i] for b in batches for i, index in enumerate(b["index"]) if index == 0)
    (plain,), _ = sentence_ids(restored.source_tokenizer, [LOOPING])
    assert NEVER not in row and int((row != restored.config.model.pad_id).sum()) == len(plain) + 1 + 50
    assert len(sentence_ids(restored.source_tokenizer, [LONG])[0][0]) > len(plain) + 5  # a much wider batch
    alone, _ = evaluate.translate(restored, [LOOPING], 8)
    beside, _ = evaluate.translate(restored, [LOOPING, LONG], 8)
    assert alone[0] == beside[0] == served.wait_ready().post("/v1/translate", {"text": LOOPING})["translation"]
  finally:
    served.stop()


@pytest.mark.slow
def test_concurrent_requests_get_the_same_answers(servers, reference):
  """Twelve single sentences and two lists from six threads at once: every answer is exact,
  and the slots and pages are all free afterwards."""
  mt, _ = servers
  jobs = [{"text": t} for t in SENTENCES * 2] + [{"text": SENTENCES[::-1]}, {"text": SENTENCES[2:]}]
  with ThreadPoolExecutor(6) as pool:
    answers = list(pool.map(lambda body: mt.post("/v1/translate", body), jobs))
  for body, answer in zip(jobs, answers):
    texts = body["text"]
    expected = [reference[t] for t in texts] if isinstance(texts, list) else reference[texts]
    assert answer == {"translation": expected}, body
  health = _health(mt)
  assert health["running"] == 0 and health["waiting"] == 0 and health["pages_in_use"] == 0


@pytest.mark.slow
def test_streamed_translation_pieces_add_up_to_the_answer(servers, reference):
  mt, _ = servers
  conn = mt.connection()
  conn.request("POST", "/v1/translate", json.dumps({"text": LOOPING, "stream": True}))
  response = conn.getresponse()
  assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
  events = sse_events(response)
  conn.close()
  assert events[-1] == "[DONE]" and len(events) >= 3
  tokens = events[:-1]
  assert all(isinstance(e["token"], int) and isinstance(e["text"], str) for e in tokens)
  assert "".join(e["text"] for e in tokens) == reference[LOOPING]
  assert tokens[-1]["token"] == 3 or len(tokens) == 32  # EOS or the model's max_length


@pytest.mark.slow
def test_beam_search_answers_strings(servers):
  mt, _ = servers
  one = mt.post("/v1/translate", {"text": "bird fish horse", "beam_size": 4})["translation"]
  many = mt.post("/v1/translate", {"text": SENTENCES[:3], "beam_size": 4})["translation"]
  assert isinstance(one, str) and isinstance(many, list) and len(many) == 3 and all(isinstance(h, str) for h in many)
  assert many[1] == one  # the same sentence alone or in a batch


@pytest.mark.slow
@pytest.mark.parametrize(
  "path, body, message",
  [
    ("/v1/translate", {"text": ""}, "empty sentence"),
    ("/v1/translate", {"text": "   "}, "empty sentence"),
    ("/v1/translate", {"text": []}, '"text" must be a non-empty string or a non-empty list of strings'),
    ("/v1/translate", {"text": 5}, '"text" must be a non-empty string'),
    ("/v1/translate", {"text": " ".join(["horse"] * 40)}, "this model takes at most 32"),
    ("/v1/translate", {"text": "cat", "beam_size": "4"}, '"beam_size" must be int, got "4"'),
    ("/v1/translate", {"text": "cat", "beam_size": 0}, '"beam_size" must be >= 1'),
    ("/v1/translate", {"text": "cat", "stream": "yes"}, '"stream" must be bool'),
    ("/v1/translate", {"text": ["cat"], "stream": True}, '"stream" needs one "text" string'),
    ("/v1/translate", b"{not json", "the body is not valid JSON"),
    ("/v1/translate", [1, 2], "the body must be a JSON object"),
    ("/v1/generate", {"prompt": "cat"}, "use /v1/translate"),
  ],
)
def test_bad_translation_requests_answer_400(servers, path, body, message):
  mt, _ = servers
  status, answer, _ = mt.request("POST", path, body)
  assert status == 400 and list(answer) == ["error"]
  assert message in answer["error"] and "\n" not in answer["error"]


@pytest.mark.slow
def test_a_full_queue_answers_503(servers):
  """64 sentences fill the default queue of 64 waiting requests (8 run, 56 wait); another
  request for 9 while they are in flight answers 503 with Retry-After, and nothing of it is
  queued. More texts than the queue holds in one request can never fit: 400."""
  mt, _ = servers
  status, answer, _ = mt.request("POST", "/v1/translate", {"text": ["cat"] * 65})
  assert status == 400 and "send at most 64" in answer["error"]
  with ThreadPoolExecutor(1) as pool:
    first = pool.submit(mt.request, "POST", "/v1/translate", {"text": ["the cat sees a dog"] * 64})
    while not first.done() and _health(mt)["waiting"] == 0:  # the 64 are queued first
      time.sleep(0.005)
    refused = None
    while refused is None and not first.done():
      status, answer, headers = mt.request("POST", "/v1/translate", {"text": ["cat"] * 9})
      if status == 503:
        refused = (answer, headers)
    assert first.result()[0] == 200
  assert refused is not None, "the queue never filled"
  assert refused[0] == {"error": "the queue is full (64 waiting requests); retry later"}
  assert refused[1]["Retry-After"] == "1"
  assert _health(mt)["waiting"] == 0


@pytest.mark.slow
def test_a_client_leaving_mid_stream_frees_its_slot(servers):
  mt, _ = servers
  conn = mt.connection()
  conn.request("POST", "/v1/translate", json.dumps({"text": LOOPING, "stream": True}))
  response = conn.getresponse()
  assert response.status == 200 and response.readline().startswith(b"data: {")
  conn.sock.shutdown(socket.SHUT_RDWR)
  conn.close()
  deadline = time.monotonic() + 30
  while (health := _health(mt))["running"] or health["pages_in_use"]:
    assert time.monotonic() < deadline, health
    time.sleep(0.1)
  assert health["waiting"] == 0
  assert mt.post("/v1/translate", {"text": "goat"})["translation"] is not None  # still serving


@pytest.mark.slow
def test_generation_with_a_seed_is_reproducible(servers):
  _, lm = servers
  assert _health(lm)["model"] == "decoder_only"
  body = {"prompt": "cat dog", "max_new_tokens": 8, "temperature": 1.5, "seed": 11}
  first = lm.post("/v1/generate", body)["text"]
  assert isinstance(first, str) and first
  assert lm.post("/v1/generate", body) == {"text": first}
  conn = lm.connection()
  conn.request("POST", "/v1/generate", json.dumps({**body, "stream": True}))
  events = sse_events(conn.getresponse())
  conn.close()
  assert events[-1] == "[DONE]" and len(events) == 9  # 8 tokens (no EOS stop), then DONE
  assert "".join(e["text"] for e in events[:-1]) == first
  greedy = {"prompt": "cat dog", "max_new_tokens": 8}
  assert lm.post("/v1/generate", greedy) == lm.post("/v1/generate", {**greedy, "seed": 5})  # greedy ignores seeds


@pytest.mark.slow
@pytest.mark.parametrize(
  "body, message",
  [
    ({"prompt": ""}, '"prompt" must be a non-empty string'),
    ({"prompt": "cat", "max_new_tokens": 100}, "exceeds the model's context of 16 tokens"),
    ({"prompt": "cat", "max_new_tokens": 0}, '"max_new_tokens" must be >= 1'),
    ({"prompt": "cat", "temperature": 0}, "temperature must be > 0"),
    ({"prompt": "cat", "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"prompt": "cat", "top_k": 2.5}, '"top_k" must be int'),
    ({"prompt": "cat", "seed": "1"}, '"seed" must be int'),
    ({"prompt": "cat", "seed": 2**63}, "seed must be an integer in [0, 2**32)"),
  ],
)
def test_bad_generation_requests_answer_400(servers, body, message):
  _, lm = servers
  status, answer, _ = lm.request("POST", "/v1/generate", body)
  assert status == 400 and message in answer["error"] and "\n" not in answer["error"]
  status, answer, _ = lm.request("POST", "/v1/translate", {"text": "cat"})
  assert status == 400 and "use /v1/generate" in answer["error"]


@pytest.mark.slow
def test_sigterm_lets_the_request_in_flight_finish(servers, reference):
  """SIGTERM arrives while a streamed answer is being read: the answer completes, then the
  process exits. uvicorn re-raises the captured SIGTERM after its graceful shutdown, so the
  process ends by that signal (returncode -15; a shell sees 143, as for `train`). This test
  stops the translation server, so it comes last."""
  mt, _ = servers
  conn = mt.connection()
  conn.request("POST", "/v1/translate", json.dumps({"text": LOOPING, "stream": True}))
  response = conn.getresponse()
  assert response.status == 200
  first = response.readline()
  mt.proc.send_signal(signal.SIGTERM)
  sent = time.monotonic()
  events = sse_events([first, *response])
  conn.close()
  assert events[-1] == "[DONE]" and "".join(e["text"] for e in events[:-1]) == reference[LOOPING]
  assert mt.proc.wait(30) == -signal.SIGTERM and time.monotonic() - sent < 30
  with pytest.raises(OSError):  # nothing listens any more
    mt.request("GET", "/health", timeout=5)


def test_engine_worker_refuses_requests_beyond_the_queue():
  """`EngineWorker.submit` raises QueueFull when the waiting queue has no room (the worker is
  held off stepping by holding its lock), and serves the queued request once released."""
  model, params, alone = _model("decoder_only")
  worker = EngineWorker(Engine(model, params, max_batch=SLOTS, page_size=PAGE, num_pages=SMALL_POOL), max_queue=2)
  done = threading.Event()
  try:
    with worker.cond:  # re-entrant: submit takes it again on this thread
      first = Request([5, 6, 7], 4, eos_id=NO_EOS, on_token=lambda r, t: done.set() if t is None else None)
      worker.submit([first])
      with pytest.raises(QueueFull, match=r"the queue is full \(2 waiting requests\); retry later"):
        worker.submit([Request([5], 2), Request([6], 2)])
      assert list(worker.engine.waiting) == [first]
    assert done.wait(60) and first.tokens == alone([5, 6, 7], 4)
  finally:
    worker.stop()


def test_a_bad_seed_fails_only_its_own_request():
  model, params, alone = _model("decoder_only")
  worker = EngineWorker(Engine(model, params, max_batch=SLOTS, page_size=PAGE, num_pages=SMALL_POOL), max_queue=8)
  done = threading.Event()
  try:
    with worker.cond:
      good = Request([5, 6, 7], 4, eos_id=NO_EOS, on_token=lambda r, t: done.set() if t is None else None)
      worker.submit([good])
      with contextlib.suppress(ValueError):  # refusing the bad seed up front would be a fix
        worker.submit([Request([8, 9], 4, seed=2**63)])
    assert done.wait(60)
    assert good.error is None and good.tokens == alone([5, 6, 7], 4)
  finally:
    worker.stop()
