"""Tests of jaxformer.inference.engine (continuous batching over a paged KV cache) and
inference.pages: every request's output equals decoding it alone with the fixed-batch
`inference.decode` (greedy and seeded sampling), whatever arrives when and whatever else is
running; pages grow with the live tokens and all come back; a short pool makes requests
wait, or fails the newest one with a clear message without touching the others; a
cancelled request frees its slot and pages; bad requests are refused in one line."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep

from jaxformer.config import ModelConfig
from jaxformer.inference.decode import greedy_decode, sample_decode
from jaxformer.inference.engine import Engine, Request
from jaxformer.inference.pages import PageAllocator
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.models.transformer import EncoderDecoder

VOCAB, MAX_LEN, PAGE = 37, 16, 4  # max_length 16 = 4 pages of 4 tokens per row
NO_EOS = -1  # an eos_id no token equals
WIDTH = 8  # longest input in these tests: engine prefills of 4 or 8 columns
SAMPLING = (0.8, 5, 0.9)  # temperature, top_k, top_p of the sampled requests
SLOTS, SMALL_POOL = 3, 6  # max_batch, and a pool of 5 usable pages (page 0 is the null page)
COMMON = {
  "vocab_size": VOCAB,
  "d_model": 16,
  "d_ff": 24,
  "num_encoder_layers": 1,
  "num_decoder_layers": 2,
  "dropout_rate": 0.0,
  "max_length": MAX_LEN,
  "tie_embeddings": False,
}
KINDS = {
  "encoder_decoder": (EncoderDecoder, {"num_heads": 2}),
  "decoder_only": (DecoderOnly, {"num_heads": 4, "num_kv_heads": 2, "position": "rope", "pre_norm": True}),
}


@functools.cache
def _model(kind):
  """(model, params, alone) for a `KINDS` entry. Random params scaled so greedy outputs vary
  (embeddings and output projection N(0, 1), cross-attention N(0, 0.3^2), the rest N(0, 0.1^2),
  norm scales 1 + that); the output columns of PAD, 1, BOS and EOS are zeroed so no row
  emits them by chance (tests that stop at EOS use a stand-in token).

  alone(inputs list, length, eos_id=NO_EOS, seed=None) -> the first `length` tokens
  `inference.decode` gives for that input decoded by itself (batch 1), cut after EOS: greedy,
  or `sample_decode` with `SAMPLING` and `jax.random.key(seed)`."""
  cls, options = KINDS[kind]
  model = cls(ModelConfig(**COMMON, **options))
  ones = jnp.ones((1, 5), jnp.int32)
  args = (ones, ones) if model.ENCODES_SOURCE else (ones,)
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: model.init(k, *args), jax.random.key(0)))["params"]
  rng = np.random.default_rng(1)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    std = 1.0 if "embedding" in name or "output_proj" in name else 0.3 if "cross_attention" in name else 0.1
    x = std * rng.standard_normal(s.shape) + name.endswith("['scale']")
    if "output_proj" in name:
      x[..., :4] = 0.0
    return jnp.asarray(x, jnp.float32)

  params = jax.tree_util.tree_map_with_path(fill, shapes)
  # One compile per kind: inputs PAD padded to WIDTH, all MAX_LEN tokens decoded with no EOS
  # (a stop at EOS only replaces the later tokens by PAD, so the output is cut after it here).
  # A decoder-only row's cache fills after max_length - len(prompt) + 1 tokens; later ones are
  # never compared (`_new_tokens`).
  greedy = jax.jit(lambda p, x: greedy_decode(model, p, x, MAX_LEN, NO_EOS))
  sample = jax.jit(lambda p, x, key: sample_decode(model, p, x, MAX_LEN, key, *SAMPLING, NO_EOS))

  def alone(inputs, length, eos_id=NO_EOS, seed=None):
    x = np.zeros((1, WIDTH), np.int32)
    x[0, : len(inputs)] = inputs
    out = greedy(params, x) if seed is None else sample(params, x, jax.random.key(seed))
    out = [int(t) for t in np.asarray(out)[0, :length]]
    return out[: out.index(eos_id) + 1] if eos_id in out else out

  return model, params, alone


def _inputs(seed, lengths):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(4, VOCAB, n)] for n in lengths]


def _new_tokens(model, inputs, wanted):
  """`wanted` capped at what the engine gives a decoder-only row: it stops once the row's cache
  (prompt included) holds max_length tokens."""
  return wanted if model.ENCODES_SOURCE else min(wanted, MAX_LEN - len(inputs) + 1)


def _check_pages(engine):
  """Each running slot holds exactly the pages of its cached tokens (and of its source), and
  the pools hold nothing else."""
  running = [s for s, r in enumerate(engine.slots) if r is not None]
  for s in running:
    assert engine.pages.used[s] == engine.pages.pages_for(int(engine.lengths[s])), s
    if engine.model.ENCODES_SOURCE:
      assert engine.source_pages.used[s] == engine.source_pages.pages_for(len(engine.slots[s].inputs)), s
  assert engine.pages.pages_in_use == sum(int(engine.pages.used[s]) for s in running)
  assert engine.source_pages.pages_in_use == sum(int(engine.source_pages.used[s]) for s in running)


@pytest.mark.parametrize("kind", sweep(KINDS, {"decoder_only"}))
def test_staggered_requests_equal_each_decoded_alone(kind):
  """Seven requests of 2..8 input tokens (one sampled, one stopping at a stand-in EOS) on 3
  slots, submitted in three waves between steps: every output equals the request decoded
  alone; pages track the live tokens and all return to the pools."""
  model, params, alone = _model(kind)
  engine = Engine(model, params, max_batch=SLOTS, page_size=PAGE)
  inputs = _inputs(2, (8, 2, 5, 7, 3, 6, 4))
  wanted = [12, 16, 5, 9, 14, 16, 8]
  lengths = [_new_tokens(model, x, n) for x, n in zip(inputs, wanted)]
  free = [alone(x, n) for x, n in zip(inputs, lengths)]
  assert len({tuple(f) for f in free}) == len(free) and sum(len(set(f)) >= 3 for f in free) >= 3  # varied outputs
  # A stand-in EOS for request 3: a token it emits mid-way, so it stops before its limit.
  eos = free[3][len(free[3]) // 2]
  expected = [
    alone(x, n, eos if i == 3 else NO_EOS, 7 if i == 1 else None) for i, (x, n) in enumerate(zip(inputs, lengths))
  ]
  assert len(expected[3]) < lengths[3] and expected[3][-1] == eos
  assert expected[1] != free[1]  # the sampled request differs from greedy

  streamed = {}

  def on_token(request, token):
    streamed.setdefault(request.id, []).append(token)

  requests = [
    Request(x, n, eos_id=eos if i == 3 else NO_EOS, on_token=on_token) for i, (x, n) in enumerate(zip(inputs, lengths))
  ]
  t, k, p = SAMPLING
  requests[1] = Request(
    inputs[1], lengths[1], temperature=t, top_k=k, top_p=p, seed=7, eos_id=NO_EOS, on_token=on_token
  )
  waves = [requests[:2], requests[2:5], requests[5:]]
  live_pages = []
  for wave in waves:
    for r in wave:
      engine.submit(r)
    for _ in range(3):
      engine.step()
      _check_pages(engine)
      live_pages.append(engine.pages.pages_in_use)
  assert engine.waiting and all(r is not None for r in engine.slots)  # more requests than slots
  while engine.busy:
    engine.step()
    _check_pages(engine)
    live_pages.append(engine.pages.pages_in_use)
  for i, r in enumerate(requests):
    assert r.done and r.error is None
    assert r.tokens == expected[i], f"request {i}"
    assert streamed[r.id] == [*r.tokens, None]  # every token streamed, then the end
  assert engine.pages.pages_in_use == 0 and engine.source_pages.pages_in_use == 0
  assert engine.stats() == {"pages_in_use": 0, "running": 0, "waiting": 0}
  per_row = MAX_LEN // PAGE
  assert max(live_pages) < 3 * per_row  # never the max_batch * max_length of a dense cache
  assert len(set(live_pages)) >= 4  # it grows and shrinks with the live tokens


def _run_watching_admission(engine):
  """Steps `engine` until idle, checking the pages after every step; returns whether a
  waiting request was held back although a slot was free (so: for lack of pages)."""
  held_back = False
  while engine.busy:
    head = engine.waiting[0] if engine.waiting and None in engine.slots else None
    engine.step()
    _check_pages(engine)
    held_back |= head is not None and head in engine.waiting
  return held_back


def test_tight_pool_makes_requests_wait_and_all_finish_exactly():
  """Five usable pages for three slots and requests of 7 or 8 tokens (2 pages) in all: the
  third prompt (2 pages) waits in the queue beside a free slot until a running request frees
  its pages, and every request finishes with its output decoded alone."""
  model, params, alone = _model("decoder_only")
  engine = Engine(model, params, max_batch=SLOTS, page_size=PAGE, num_pages=SMALL_POOL)
  inputs = _inputs(3, (6, 5, 8, 3, 2, 4))
  lengths = [3, 4, 1, 5, 6, 5]
  requests = [engine.submit(Request(x, n, eos_id=NO_EOS)) for x, n in zip(inputs, lengths)]
  assert _run_watching_admission(engine)
  for i, (r, x, n) in enumerate(zip(requests, inputs, lengths)):
    assert r.error is None and r.tokens == alone(x, n), f"request {i}"
  assert engine.pages.pages_in_use == 0


def test_requests_that_each_fit_the_pool_all_finish():
  """Five usable pages, three slots, six requests of at most 3 pages each: every request fits
  the pool by itself, so all finish exactly: when every running row waits for a page, the
  newest is preempted and later resumes where it stopped."""
  model, params, alone = _model("decoder_only")
  engine = Engine(model, params, max_batch=SLOTS, page_size=PAGE, num_pages=SMALL_POOL)
  inputs = _inputs(3, (6, 3, 5, 2, 7, 4))
  lengths = [5, 9, 6, 7, 4, 8]
  assert all(engine.pages.pages_for(len(x) + n - 1) <= 3 for x, n in zip(inputs, lengths))
  requests = [engine.submit(Request(x, n, eos_id=NO_EOS)) for x, n in zip(inputs, lengths)]
  _run_watching_admission(engine)
  assert engine.pages.pages_in_use == 0
  for i, (r, x, n) in enumerate(zip(requests, inputs, lengths)):
    assert r.error is None, f"request {i}: {r.error}"
    assert r.tokens == alone(x, n), f"request {i}"


def test_rows_outgrowing_the_pool_together_preempt_the_newest_and_all_finish():
  """Two requests that each grow to 4 pages share 5: when both wait for a page the newer one
  is preempted (its pages freed, back at the head of the queue) and resumes after the older
  one finishes; every output, streamed tokens included, equals decoding alone."""
  model, params, alone = _model("decoder_only")
  engine = Engine(model, params, max_batch=SLOTS, page_size=PAGE, num_pages=SMALL_POOL)
  short_in, old_in, new_in, later_in = _inputs(4, (2, 3, 4, 5))
  streamed = []
  short = engine.submit(Request(short_in, 2, eos_id=NO_EOS))
  old = engine.submit(Request(old_in, 14, eos_id=NO_EOS))  # 3 + 14 - 1 = 16 tokens: 4 pages
  new = engine.submit(
    Request(
      new_in,
      13,
      eos_id=NO_EOS,  # 4 + 13 - 1 = 16 tokens: 4 pages
      on_token=lambda r, t: streamed.append(t),
    )
  )
  preempted = False
  while engine.busy:
    engine.step()
    preempted |= new in engine.waiting and len(new.tokens) > 0
  assert preempted
  assert new.error is None and new.tokens == alone(new_in, 13) and streamed == new.tokens + [None]
  assert short.error is None and short.tokens == alone(short_in, 2)
  assert old.error is None and old.tokens == alone(old_in, 14)
  assert engine.pages.pages_in_use == 0
  later = engine.run([Request(later_in, 12, eos_id=NO_EOS)])[0]
  assert later.error is None and later.tokens == alone(later_in, 12)


def test_a_lone_request_outgrowing_the_pool_fails_with_a_page_error():
  """Three usable pages, one request that needs four: it fails alone (nothing to wait for)."""
  model, params, alone = _model("decoder_only")
  engine = Engine(model, params, max_batch=2, page_size=PAGE, num_pages=4)
  (x,) = _inputs(5, (3,))
  r = engine.run([Request(x, 14, eos_id=NO_EOS)])[0]
  assert "out of KV-cache pages" in r.error
  assert len(r.tokens) == 3 * PAGE - len(x) + 1 and r.tokens == alone(x, 14)[: len(r.tokens)]
  assert engine.pages.pages_in_use == 0


def test_an_input_larger_than_the_pool_is_refused_at_submit():
  """One usable page (4 tokens) and a 5-token prompt: submit refuses it in one line (it could
  never be admitted), and the small request behind it is served."""
  model, params, alone = _model("decoder_only")
  engine = Engine(model, params, max_batch=2, page_size=PAGE, num_pages=2)
  with pytest.raises(ValueError, match="needs 2 KV-cache pages but the pool has 1"):
    engine.submit(Request(_inputs(7, (5,))[0], 3, eos_id=NO_EOS))
  small = engine.run([Request([5, 6], 3, eos_id=NO_EOS)])[0]
  assert small.error is None and small.tokens == alone([5, 6], 3)


def test_cancelled_request_frees_its_slot_and_pages_at_the_next_step():
  model, params, alone = _model("encoder_decoder")
  engine = Engine(model, params, max_batch=SLOTS, page_size=PAGE)
  a_in, b_in, c_in, e_in = _inputs(6, (8, 5, 3, 6))
  ends = []
  a = engine.submit(Request(a_in, 16, eos_id=NO_EOS, on_token=lambda r, t: ends.append(r.id) if t is None else None))
  b = engine.submit(Request(b_in, 16, eos_id=NO_EOS))
  e = engine.submit(Request(e_in, 12, eos_id=NO_EOS))
  c = engine.submit(Request(c_in, 10, eos_id=NO_EOS))  # waits for a slot
  for _ in range(6):
    engine.step()
  slot = engine.slots.index(a)
  assert engine.pages.used[slot] == 2 and engine.source_pages.used[slot] == 2 and engine.waiting[0] is c
  a.cancelled = True
  engine.step()
  assert a.done and a.error == "cancelled" and ends == [a.id]
  assert engine.slots[slot] is c and len(a.tokens) == 7  # c took the freed slot; a got no more tokens
  assert a.tokens == alone(a_in, 16)[:7]
  _check_pages(engine)
  engine.run([])
  assert b.tokens == alone(b_in, 16) and c.tokens == alone(c_in, 10) and e.tokens == alone(e_in, 12)
  assert engine.pages.pages_in_use == 0 and engine.source_pages.pages_in_use == 0
  # A request cancelled while still waiting never runs.
  d = engine.submit(Request(a_in, 4, eos_id=NO_EOS))
  d.cancelled = True
  engine.run([])
  assert d.done and d.tokens == [] and engine.pages.pages_in_use == 0


@pytest.mark.parametrize(
  "request_kwargs, message",
  [
    ({"inputs": []}, "the input is empty"),
    ({"inputs": [5] * 17}, "the input has 17 tokens; this model takes at most 16"),
    ({"max_new_tokens": 0}, "max new tokens must be an integer >= 1, got 0"),
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
  ],
)
def test_bad_requests_raise_one_line_value_errors(request_kwargs, message):
  engine = _validation_engine()
  request = Request(**{"inputs": [5, 6], "max_new_tokens": 4, **request_kwargs})
  with pytest.raises(ValueError, match=message) as info:
    engine.submit(request)
  assert "\n" not in str(info.value) and not engine.waiting


def test_a_seed_jax_cannot_take_is_refused_at_submit():
  with pytest.raises(ValueError, match="seed"):
    _validation_engine().submit(Request([5, 6], 4, seed=2**63))


@functools.cache
def _validation_engine():
  model, params, _ = _model("decoder_only")
  return Engine(model, params, max_batch=1, page_size=PAGE)


def test_bad_engine_and_pool_sizes_raise():
  model, params, _ = _model("decoder_only")
  with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
    Engine(model, params, max_batch=0)
  with pytest.raises(ValueError, match="at least 2 pages"):
    PageAllocator(1, 4, 2, 4)


def test_page_allocator_bookkeeping():
  pages = PageAllocator(6, 4, 2, 3)
  assert pages.reserve(0, 5) and list(pages.table[0]) == [1, 2, 0] and pages.pages_in_use == 2
  assert pages.reserve(0, 8) and pages.used[0] == 2  # already covered: nothing taken
  assert pages.reserve(1, 9) and list(pages.table[1]) == [3, 4, 5] and pages.pages_in_use == 5
  assert not pages.reserve(0, 9) and pages.used[0] == 2  # pool empty: nothing taken
  pages.release(1)
  assert list(pages.table[1]) == [0, 0, 0] and pages.pages_in_use == 2
  assert not pages.reserve(0, 13) and pages.used[0] == 2  # longer than the slot's table
  assert pages.reserve(0, 12) and pages.table[0, 2] != 0 and pages.pages_in_use == 3
  pages.release(0)
  assert pages.pages_in_use == 0 and sorted(pages.free) == [1, 2, 3, 4, 5]


def test_static_batching_starts_the_next_batch_only_when_the_running_one_has_finished():
  """Static batching on 3 slots: four requests queued, a fifth submitted after two steps. The
  first three run as one batch; the fourth and fifth wait (beside free slots once the shorter
  ones finish) and start together, at the step after the longest of the first batch ends (a
  request of n tokens runs n - 1 steps: prefill gives its first token in its first step); every
  output equals the request decoded alone."""
  model, params, alone = _model("encoder_decoder")
  engine = Engine(model, params, max_batch=SLOTS, page_size=PAGE, batching="static")
  inputs = _inputs(4, (5, 3, 8, 6, 2))
  lengths = [2, 9, 5, 4, 6]
  requests = [engine.submit(Request(x, n, eos_id=NO_EOS)) for x, n in zip(inputs[:4], lengths[:4])]
  started, finished, step = {}, {}, 0
  while engine.busy:
    if step == 2:
      requests.append(engine.submit(Request(inputs[4], lengths[4], eos_id=NO_EOS)))
    engine.step()
    step += 1
    _check_pages(engine)
    for i, r in enumerate(requests):
      if r.tokens:
        started.setdefault(i, step)
      if r.done:
        finished.setdefault(i, step)
  assert started == {0: 1, 1: 1, 2: 1, 3: 9, 4: 9}
  assert finished == {0: 1, 1: 8, 2: 4, 3: 11, 4: 13}
  for i, (r, x, n) in enumerate(zip(requests, inputs, lengths)):
    assert r.error is None and r.tokens == alone(x, n), f"request {i}"
  assert engine.pages.pages_in_use == 0 and engine.source_pages.pages_in_use == 0
  with pytest.raises(ValueError, match="batching must be one of continuous, static, got 'dynamic'"):
    Engine(model, params, max_batch=SLOTS, page_size=PAGE, batching="dynamic")


@pytest.mark.slow
def test_a_prompt_filling_the_context_is_admitted_and_stops_at_max_length():
  """A prompt of model.max_length tokens (its pages fill the slot's table) is admitted and
  gives one token; a shorter one runs until the context is full."""
  model, params, alone = _model("decoder_only")
  limit = model.config.max_length
  engine = Engine(model, params, max_batch=2, page_size=PAGE)
  full, short = _inputs(8, (limit, limit - 4))
  a, b = engine.run([Request(full, 3, eos_id=NO_EOS), Request(short, 10, eos_id=NO_EOS)])

  def reference(prompt, n):
    return [int(t) for t in np.asarray(greedy_decode(model, params, jnp.asarray([prompt]), n, NO_EOS))[0]]

  assert a.error is None and a.tokens == reference(full, 1)
  assert b.error is None and b.tokens == reference(short, 5)
  assert engine.pages.pages_in_use == 0
