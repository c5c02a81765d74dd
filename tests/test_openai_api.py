"""The OpenAI-compatible routes of `jaxformer serve` spoken to by the real `openai` client and by
lm-evaluation-harness, on one random decoder-only model with a chat-template tokenizer
(`openai_served`), served on 127.0.0.1 in this process and shared by the module.

Checked against independent computations: greedy answers equal `inference.generate.generate`
with top_k 1 (what `jaxformer generate --top-k 1` prints); streamed pieces join to the plain
answers; log-probabilities (echoed prompt included) equal the log-softmax of `jaxformer.logits`
(1e-4); the chat template's ids for a 3-message chat are written out by hand; lm-eval's
per-choice log-likelihoods equal sums of those log-softmax values. Slow: 64 concurrent streaming
clients, and chat on a translation model.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")

from openai_served import (  # noqa: E402
  ID,
  KEY,
  NAME,
  PROMPTS,
  WINDOW,
  Running,
  greedy_ids,
  log_softmax,
  restored_model,
  served,  # noqa: F401  (the fixture)
  stream_raw,
  tokenizer_folder,
)

C, CHAT = "/v1/completions", "/v1/chat/completions"


def test_models_and_greedy_completions_equal_generate(served):
  """Greedy completions (temperature 0) of three prompts, alone and as one list, equal
  `generate(..., top_k=1)` (`jaxformer generate --top-k 1`); usage counts the tokens."""
  from jaxformer.inference.generate import generate

  client = served.client()
  assert [m.id for m in client.models.list().data] == [NAME]
  assert client.models.retrieve(NAME).id == NAME
  expected = [generate(served.restored, p, 10, top_k=1)[0] for p in PROMPTS]
  assert len(set(expected)) == 3 and all(len(set(e.split())) >= 3 for e in expected)  # varied answers
  for prompt, text in zip(PROMPTS, expected):
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    assert out.object == "text_completion" and out.model == NAME and out.id.startswith("cmpl-")
    assert [c.text for c in out.choices] == [text] and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(served.restored.tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 10 and out.usage.total_tokens == out.usage.prompt_tokens + 10
  many = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=10, temperature=0)
  assert [c.index for c in many.choices] == [0, 1, 2] and [c.text for c in many.choices] == expected
  ids = served.restored.tokenizer.encode(PROMPTS[0])  # a prompt of token ids answers the same
  assert client.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0).choices[0].text == expected[0]


def test_n_samples_are_seeded_and_streams_join_to_them(served):
  client = served.client()
  body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2}
  first = client.completions.create(**body)
  texts = [c.text for c in first.choices]
  assert [c.index for c in first.choices] == [0, 1] and texts[0] != texts[1]  # two different samples
  assert [c.text for c in client.completions.create(**body).choices] == texts  # the same seed, the same samples
  assert first.usage.prompt_tokens == len(served.restored.tokenizer.encode(PROMPTS[1]))  # the prompt counts once
  assert first.usage.completion_tokens == 24
  other = client.completions.create(**{**body, "seed": 6})
  assert [c.text for c in other.choices] != texts
  pieces = {0: "", 1: ""}
  for chunk in client.completions.create(**body, stream=True):
    for c in chunk.choices:
      pieces[c.index] += c.text
  assert [pieces[0], pieces[1]] == texts
  greedy = client.completions.create(**{**body, "temperature": 0})
  assert greedy.choices[0].text == greedy.choices[1].text


def test_stop_strings_end_the_request_in_the_engine(served):
  """A stop string that the greedy answer contains: the answer ends before it with finish
  reason "stop", fewer tokens were generated, and the stream says the same."""
  client = served.client()
  full = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0).choices[0].text
  stop = " " + full.split()[3]
  expected = full[: full.index(stop)]
  for value in (stop, [" zzz", stop]):
    out = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=value)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 12
  chunks = list(
    client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=stop, stream=True)
  )
  assert "".join(c.choices[0].text for c in chunks) == expected and chunks[-1].choices[0].finish_reason == "stop"
  chat = client.chat.completions.create(
    model=NAME, messages=[{"role": "user", "content": "hello there"}], max_tokens=12, temperature=0
  )
  content = chat.choices[0].message.content
  word = " " + content.split()[2]
  stopped = client.chat.completions.create(
    model=NAME, messages=[{"role": "user", "content": "hello there"}], max_tokens=12, temperature=0, stop=word
  )
  assert stopped.choices[0].message.content == content[: content.index(word)]
  assert stopped.choices[0].finish_reason == "stop"


def test_echo_logprobs_equal_the_modelslog_softmax(served):
  """`echo` + `logprobs=5`: the prompt's tokens then the generated ones, each with its
  log-probability and best alternatives equal to the log-softmax of `jaxformer.logits` (1e-4);
  `tokens` join to `text` and `text_offset` points into it."""
  client = served.client()
  prompt = PROMPTS[2]
  out = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=5)
  choice = out.choices[0]
  prompt_ids = served.restored.tokenizer.encode(prompt)
  ids = greedy_ids(served, prompt_ids, 5)
  ref = log_softmax(served, ids)
  lp = choice.logprobs
  assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  assert choice.text.startswith(prompt) and "".join(lp.tokens) == choice.text
  for t in range(1, len(ids)):
    assert lp.token_logprobs[t] == pytest.approx(ref[t - 1, ids[t]], abs=1e-4), t
    best = np.sort(ref[t - 1])[::-1][:5]
    assert max(lp.top_logprobs[t].values()) == pytest.approx(best[0], abs=1e-4)
    assert all(
      np.min(np.abs(best - v)) < 1e-4 or v == pytest.approx(ref[t - 1, ids[t]], abs=1e-4)
      for v in lp.top_logprobs[t].values()
    )
  for token, offset in zip(lp.tokens, lp.text_offset):
    assert choice.text[offset : offset + len(token)] == token
  # Without echo: only the generated tokens, offsets from the completion's start.
  plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, logprobs=0).choices[0]
  assert plain.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[len(prompt_ids) :], abs=1e-5)
  assert plain.logprobs.text_offset[0] == 0 and "".join(plain.logprobs.tokens) == plain.text
  # Chat log-probabilities: one entry per generated token, the same values.
  messages = [{"role": "user", "content": "the cat sees"}]
  chat = client.chat.completions.create(
    model=NAME, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
  )
  from jaxformer.serve.chat import chat_ids, parse_messages

  chat_ref_ids = greedy_ids(served, chat_ids(parse_messages(messages), served.restored.tokenizer), 4)
  chat_ref = log_softmax(served, chat_ref_ids)
  content = chat.choices[0].logprobs.content
  start = len(chat_ref_ids) - 4
  assert len(content) == 4 and all(len(c.top_logprobs) in (2, 3) for c in content)
  for j, c in enumerate(content):
    assert c.logprob == pytest.approx(chat_ref[start + j - 1, chat_ref_ids[start + j]], abs=1e-4)
    assert c.bytes == list(c.token.encode())


def test_chat_renders_the_template_and_answers_as_a_completion_of_its_ids(served):
  """A 3-message chat's ids, written out by hand from the template; the chat answer is the
  completion of exactly those ids (greedy), and usage counts them."""
  from jaxformer.serve.chat import chat_ids, parse_messages, plain_chat

  messages = [
    {"role": "system", "content": "you are a bold one"},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "general kenobi"},
  ]
  words = [
    "<s>",
    "<|system|>",
    "you",
    "are",
    "a",
    "bold",
    "one",
    "</s>",
    "<|user|>",
    "hello",
    "there",
    "</s>",
    "<|assistant|>",
    "general",
    "kenobi",
    "</s>",
    "<|assistant|>",
  ]
  expected = [ID[w] for w in words]
  assert chat_ids(parse_messages(messages), served.restored.tokenizer) == expected
  client = served.client()
  answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
  assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
  assert answer.choices[0].message.role == "assistant" and answer.usage.prompt_tokens == len(expected)
  completion = client.completions.create(model=NAME, prompt=expected, max_tokens=6, temperature=0).choices[0]
  assert (
    answer.choices[0].message.content == completion.text.lstrip(" ")
    or answer.choices[0].message.content == completion.text
  )
  assert answer.choices[0].finish_reason == "length" and len(completion.text.split()) >= 2
  # Text parts are joined; the plain template (a tokenizer without one) is "role: content" lines.
  parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
  assert chat_ids(parse_messages(parts), served.restored.tokenizer) == expected
  assert plain_chat(parse_messages(messages)) == (
    "system: you are a bold one\nuser: hello there\nassistant: general kenobi\nassistant:"
  )


def test_streams_carry_one_id_and_join_to_the_plain_answers(served):
  client = served.client()
  body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 9, "temperature": 0}
  plain = client.completions.create(**body).choices[0].text
  events = stream_raw(served, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
  assert events[-1] == "[DONE]" and len(events) >= 4
  chunks = events[:-1]
  assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
  assert all(c["object"] == "text_completion" for c in chunks)
  assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == plain
  assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
  assert chunks[-2]["choices"][0]["finish_reason"] == "length"
  messages = [{"role": "user", "content": "hello there"}]
  chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=9, temperature=0)
  events = stream_raw(
    served, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 9, "temperature": 0}
  )
  chunks = events[:-1]
  assert events[-1] == "[DONE]" and len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
  assert all(c["object"] == "chat.completion.chunk" for c in chunks)
  assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
  assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == chat.choices[0].message.content
  assert chunks[-1]["choices"][0]["finish_reason"] == "length"
  streamed = client.chat.completions.create(model=NAME, messages=messages, max_tokens=9, temperature=0, stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
  echo = "".join(c.choices[0].text for c in client.completions.create(**body, echo=True, stream=True))
  assert echo == PROMPTS[0] + plain


@pytest.mark.slow
def test_64_concurrent_streaming_clients_all_complete(served):
  """64 `AsyncOpenAI` clients stream 16-token completions at once (8 batch slots, 56 waiting):
  every stream completes with its 16 tokens; p50/p99 latency is printed."""

  async def one(i):
    client = openai.AsyncOpenAI(base_url=served.base_url, api_key=KEY, max_retries=0, timeout=300)
    started, text, finish = time.monotonic(), "", None
    stream = await client.completions.create(
      model=NAME, prompt=PROMPTS[i % 3], max_tokens=16, temperature=0.8, seed=i, stream=True
    )
    async for chunk in stream:
      for c in chunk.choices:
        text, finish = text + c.text, c.finish_reason or finish
    await client.close()
    return time.monotonic() - started, text, finish

  async def run():
    return await asyncio.gather(*(one(i) for i in range(64)))

  started = time.monotonic()
  results = asyncio.run(run())
  wall = time.monotonic() - started
  latencies = np.array([r[0] for r in results])
  assert all(r[2] in ("length", "stop") and r[1] for r in results)
  p50, p99 = np.percentile(latencies, 50), np.percentile(latencies, 99)
  print(f"\n64 concurrent streaming clients: p50 {p50:.2f} s, p99 {p99:.2f} s, wall {wall:.2f} s")
  health = served.request("GET", "/health")[1]
  assert health["running"] == 0 and health["waiting"] == 0 and health["pages_in_use"] == 0


def test_lm_eval_local_completions_log_likelihoods_equal_ours(served, monkeypatch, tmp_path):
  """lm-evaluation-harness's `local-completions` model scores a shipped multiple-choice JSONL
  (its `json` dataset loader, nothing downloaded) through /v1/completions (echo + logprobs, token
  ids in batches of 4): each choice's log-likelihood equals the sum of the log-softmax of
  `jaxformer.logits` over the choice's tokens."""
  pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[eval]'")
  for name, value in (
    ("OPENAI_API_KEY", KEY),
    ("HF_DATASETS_OFFLINE", "1"),
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_CACHE", str(tmp_path / "datasets")),
  ):
    monkeypatch.setenv(name, value)
  from lm_eval import simple_evaluate
  from lm_eval.tasks import TaskManager

  data = Path(__file__).parent / "data" / "tiny_multiple_choice.jsonl"
  task = {
    "task": "jaxformer_tiny_mc",
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": str(data)}},
    "test_split": "test",
    "output_type": "multiple_choice",
    "doc_to_text": "{{question}}",
    "doc_to_choice": "{{choices}}",
    "doc_to_target": "{{answer}}",
    "metric_list": [{"metric": "acc"}],
  }
  folder = served.restored.config.data.tokenizer_model
  results = simple_evaluate(
    model="local-completions",
    tasks=[task],
    task_manager=TaskManager(include_defaults=False),
    model_args={
      "base_url": f"{served.base_url}/completions",
      "model": NAME,
      "tokenizer": folder,
      "tokenizer_backend": "huggingface",
      "max_length": WINDOW,
      "batch_size": 4,
      "max_retries": 1,
    },
    log_samples=True,
  )
  tok = served.restored.tokenizer
  samples = results["samples"]["jaxformer_tiny_mc"]
  assert len(samples) == 6 and 0.0 <= results["results"]["jaxformer_tiny_mc"]["acc,none"] <= 1.0
  for sample in samples:
    question, choices = sample["doc"]["question"], sample["doc"]["choices"]
    scored = [resp[0] for resp in sample["filtered_resps"]]
    assert len(scored) == len(choices)
    for choice, ll in zip(choices, scored):
      context, whole = tok.encode_plain(question), tok.encode_plain(f"{question} {choice}")
      ref = log_softmax(served, whole)
      ours = sum(ref[t - 1, whole[t]] for t in range(len(context), len(whole)))
      assert ll == pytest.approx(ours, abs=1e-4), (question, choice)


@pytest.mark.slow
def test_chat_on_a_translation_model_translates_the_last_user_message(tmp_path):
  """A random encoder-decoder served alone: chat answers (greedy by default) are the
  /v1/translate answers for the last user message, streamed or not; completions are refused."""
  running = Running(restored_model(tokenizer_folder(tmp_path / "tok"), "encoder_decoder"))
  try:
    client = running.client()
    messages = [
      {"role": "system", "content": "translate"},
      {"role": "user", "content": "the cat sees a dog"},
      {"role": "assistant", "content": "yes"},
      {"role": "user", "content": "a big red bird"},
    ]
    expected = running.request("POST", "/v1/translate", {"text": "a big red bird"})[1]["translation"]
    answer = client.chat.completions.create(model=NAME, messages=messages)
    assert answer.choices[0].message.content == expected and expected
    # a translation source: its plain ids (no specials from the tokenizer's post-processor) + EOS
    assert answer.usage.prompt_tokens == len(running.restored.tokenizer.encode_plain("a big red bird")) + 1
    streamed = client.chat.completions.create(model=NAME, messages=messages, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    scored = client.chat.completions.create(model=NAME, messages=messages, logprobs=True, top_logprobs=1)
    content = scored.choices[0].logprobs.content
    assert "".join(c.token for c in content) == expected and len(content) == scored.usage.completion_tokens
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    code, error, _ = running.request("POST", C, {"prompt": "a big red bird"})
    assert code == 400 and "/v1/chat/completions or /v1/translate" in error["error"]["message"]
    code, error, _ = running.request("POST", CHAT, {"messages": [{"role": "system", "content": "x"}]})
    assert code == 400 and "last user message" in error["error"]["message"]
  finally:
    running.stop()
