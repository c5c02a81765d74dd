"""A tiny model served over the OpenAI routes for tests/test_openai_*.py: a word-level Hugging
Face tokenizer with a chat template, a random decoder-only (or encoder-decoder) model over it,
and `Running`, a `serve.Server` under uvicorn on a free loopback port in this process (with the
API key `KEY`); plus helpers for raw streams and reference log-probabilities."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import jax
import numpy as np
import pytest

from jaxformer import sharding as sh
from jaxformer.config import config_from_dict
from jaxformer.inference.engine import Engine
from jaxformer.inference.restore import Restored
from jaxformer.serve import Server
from jaxformer.tasks import get_task

KEY = "test-key-123"
NAME = "tiny-chat"
WINDOW = 48
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS = (
  SPECIALS
  + (
    "hello there general kenobi you are a bold one ! ? the cat dog sees runs big small red blue "
    "and or not yes no two three four five six bird fish goat cow"
  ).split()
)
ID = {w: i for i, w in enumerate(WORDS)}
TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {{ eos_token }} {% endfor %}"
  "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
PROMPTS = ["the cat sees", "hello there", "a big red dog and a small blue bird"]


def tokenizer_folder(folder):
  """tokenizer.json (word level, whitespace split, <s> prepended) and tokenizer_config.json with TEMPLATE."""
  import tokenizers
  from tokenizers import models, pre_tokenizers, processors

  tok = tokenizers.Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(SPECIALS)
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", ID["<s>"])])
  folder.mkdir(parents=True)
  (folder / "tokenizer.json").write_text(tok.to_str())
  (folder / "tokenizer_config.json").write_text(
    json.dumps(
      {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "chat_template": TEMPLATE,
      }
    )
  )
  return folder


def restored_model(folder, kind="decoder_only"):
  """A random model of `kind` over the tokenizer in `folder` (pad 0, bos 1, eos 2). Embeddings
  and the output projection N(0, 1), the rest N(0, 0.1^2) (norm scales 1 + that), so greedy
  answers vary; the output columns of the special tokens are zero, so they are rarely chosen."""
  import flax.linen as nn

  from jaxformer.data.tokenizer_hf import HFTokenizer

  layers = {"num_decoder_layers": 2} if kind == "decoder_only" else {"num_encoder_layers": 1, "num_decoder_layers": 1}
  config = config_from_dict(
    {
      "model": {
        "kind": kind,
        "vocab_size": len(WORDS),
        "d_model": 32,
        "num_heads": 2,
        "d_ff": 64,
        **layers,
        "max_length": WINDOW,
        "pre_norm": True,
        "position": "rope",
        "dropout_rate": 0.0,
        "tie_embeddings": False,
        "pad_id": 0,
        "bos_id": 1,
        "eos_id": 2,
      },
      "data": {"tokenizer": "hf", "tokenizer_model": str(folder), "max_length": WINDOW, "buckets": [16, WINDOW]},
      "mesh": {"data": 1},
    }
  )
  model = get_task(config).make_model()
  ones = jax.numpy.ones((1, 4), jax.numpy.int32)
  args = (ones, ones) if model.ENCODES_SOURCE else (ones,)
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: model.init(k, *args), jax.random.key(0)))["params"]
  rng = np.random.default_rng(7)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    std = 1.0 if "embed" in name or "output" in name else 0.1
    x = std * rng.standard_normal(s.shape) + name.endswith("['scale']")
    if "output" in name and x.ndim == 2:
      x[:, : len(SPECIALS)] = 0.0
    return jax.numpy.asarray(x, jax.numpy.float32)

  params = jax.tree_util.tree_map_with_path(fill, shapes)
  return Restored(
    config,
    HFTokenizer.load(folder),
    model,
    sh.make_mesh(config.mesh, jax.devices()[:1]),
    params,
    0,
    sh.LOGICAL_RULES,
    config_workdir=str(folder.parent / NAME),
  )


class Running:
  """A `Server` under uvicorn on a free loopback port, on a thread of this process."""

  def __init__(self, restored, **options):
    import uvicorn

    self.restored = restored
    self.engine = Engine(restored.model, restored.params, max_batch=8, page_size=16, max_input_len=WINDOW)
    self.server = Server(restored, self.engine, api_key=KEY, **options)
    self.sock = socket.socket()
    self.sock.bind(("127.0.0.1", 0))
    self.port = self.sock.getsockname()[1]
    self.uvicorn = uvicorn.Server(uvicorn.Config(self.server.app, log_level="warning"))
    self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)
    self.thread.start()
    deadline = time.monotonic() + 300
    while not self.uvicorn.started:
      assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
      time.sleep(0.05)
    self.base_url = f"http://127.0.0.1:{self.port}/v1"

  def stop(self):
    self.uvicorn.should_exit = True
    self.thread.join(60)
    self.sock.close()

  def request(self, method, path, body=None, headers=None, key=KEY, timeout=60.0):
    """(status, parsed JSON body or text, headers); `body` a dict/list (sent as JSON) or raw bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
    try:
      data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
      sent = {
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {key}"} if key else {}),
        **(headers or {}),
      }
      conn.request(method, path, data, sent)
      response = conn.getresponse()
      raw = response.read()
      try:
        return response.status, json.loads(raw), response.headers
      except ValueError:
        return response.status, raw.decode(errors="replace"), response.headers
    finally:
      conn.close()

  def client(self, key=KEY, **kwargs):
    import openai

    return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=120, **kwargs)


def events(response):
  """The `data:` payloads of a server-sent-events response ("[DONE]" kept as is)."""
  events = []
  for line in response:
    line = line.decode().strip()
    if line.startswith("data: "):
      payload = line[len("data: ") :]
      events.append(payload if payload == "[DONE]" else json.loads(payload))
  return events


def stream_raw(served, path, body):
  conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
  try:
    conn.request(
      "POST",
      path,
      json.dumps({**body, "stream": True}),
      {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    return events(response)
  finally:
    conn.close()


def log_softmax(served, ids):
  """float64 `[len(ids), vocab]` log-softmax of `jaxformer.logits` for one sequence of ids."""
  from jaxformer import logits

  x = logits(served.restored, [ids])[0].astype(np.float64)
  return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def greedy_ids(served, ids, count):
  """`count` greedy tokens after `ids` from full forward passes (padding excluded), then all the ids."""
  ids = list(ids)
  for _ in range(count):
    row = log_softmax(served, ids)[-1]
    row[served.restored.config.model.pad_id] = -np.inf
    ids.append(int(np.argmax(row)))
  return ids


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """A server of `restored_model` on 127.0.0.1 for the test module, stopped at its end."""
  running = Running(restored_model(tokenizer_folder(tmp_path_factory.mktemp("openai") / "tok")))
  try:
    yield running
  finally:
    running.stop()
