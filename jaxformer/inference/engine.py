"""The inference engine: continuous batching over a paged KV cache.

A fixed number of batch slots (`max_batch`) share one paged cache (`inference.cache.
paged_cache`). Requests wait in a queue; at every `step` the engine

  1. admits waiting requests into free slots: `prefill` runs the request alone (batch 1)
     and writes its keys/values straight into the pages the slot was given, so inserting it
     into the running batch is only setting the slot's row of the page table and lengths;
  2. gives each running row a new page when its next token starts one (a row that finds
     the pool empty waits a step; if every row waits, the newest request is preempted: its
     pages are freed and it goes back to the head of the queue, to resume later by
     prefilling its input and the tokens it had fed; a request that outgrows the pool on
     its own fails with a clear error);
  3. runs one `generate` step for the whole batch (idle and waiting rows feed PAD, which
     the cache ignores) and streams each row's token to its request;
  4. retires finished requests (EOS, their `stop` test, their token limit, or the model's
     max_length) and cancelled ones, freeing their slots and pages.

With `batching="static"` (for comparison in benchmarks) step 1 admits requests only when no
request is running: a batch fills from the queue, runs until all its requests have finished,
then the next one starts; everything else is the same.

Each row is decoded independently of the others: greedy rows take the argmax, sampling
rows draw token i with `fold_in(row key, i)`, the row key coming from the request's seed
and input ids (`search.source_row_keys`), so a request's output is the same alone or
in any batch, as with the fixed-batch `inference.decode`. What a request may ask for (log-probabilities,
stop tests, several samples) is in `inference.request`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.inference import cache as kv
from jaxformer.inference import topk
from jaxformer.inference.pages import PageAllocator
from jaxformer.inference.quantize import decoding_params
from jaxformer.inference.request import MAX_LOGPROBS, Request, token_logprob
from jaxformer.inference.sampling import check_sampling, check_seed, sample_tokens, source_row_keys

BATCHING = ("continuous", "static")


class Engine:
  """Continuous (or static) batching (see the module docstring) of one model on one params tree.

  Args:
    model, params: a model with `prefill`/`extend` methods and its params.
    max_batch: batch slots (rows decoded together per step).
    page_size: tokens per KV-cache page.
    num_pages: pages per pool (self-attention; the encoder-decoder has a second pool of
      the same size for the sources); default: enough for every slot at `max_length`.
    max_input_len: longest request input, tokens (sources / prompts); default max_length.
    batching: "continuous" (admit into any free slot at every step) or "static" (admit only
      when the whole running batch has finished).

  Raises:
    ValueError: bad sizes or batching (one line).
  """

  def __init__(
    self,
    model,
    params,
    *,
    max_batch: int = 8,
    page_size: int = 16,
    num_pages: int | None = None,
    max_input_len: int | None = None,
    batching: str = "continuous",
  ):
    if max_batch < 1:
      raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if batching not in BATCHING:
      raise ValueError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
    self.batching = batching
    self.model, self.params = model, params
    self.max_length = model.config.max_length
    self.max_input_len = max_input_len or self.max_length
    per_row = -(-self.max_length // page_size)
    src_per_row = -(-self.max_input_len // page_size)
    num_pages = num_pages or max_batch * max(per_row, src_per_row) + 1
    self.pages = PageAllocator(num_pages, page_size, max_batch, per_row)
    self.source_pages = PageAllocator(num_pages, page_size, max_batch, src_per_row)
    cache = kv.paged_cache(model, decoding_params(params), max_batch, num_pages, page_size, per_row, src_per_row)
    self.layers, self._state = cache.layers, cache.state
    self.slots: list[Request | None] = [None] * max_batch
    self.lengths = np.zeros((max_batch,), np.int32)  # tokens cached per slot
    self.source_lengths = np.zeros((max_batch,), np.int32)
    self.next_token = np.zeros((max_batch,), np.int32)  # token each running slot feeds next
    self.row_keys = jax.random.split(jax.random.key(0), max_batch)
    self.waiting: deque[Request] = deque()
    self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
    self._generate = jax.jit(self._generate_fn, donate_argnums=(1,))
    self._score_prompt = jax.jit(self._score_prompt_fn)
    self._step_rows([])  # an idle step: the cache takes the placement jit gives it, so prefill compiles once

  # ---------------------------------------------------------------- jitted functions

  def _cache(self, layers, lengths, source_lengths, table, source_table) -> kv.KVCache:
    return kv.KVCache(
      layers,
      self._state.replace(
        lengths=lengths, source_lengths=source_lengths, page_table=table, source_page_table=source_table
      ),
    )

  def _choose(self, logits, keys, index, sampling, temperature, top_k, top_p):
    """(tokens int32 `[rows]`, their log-probabilities `[rows]`, the top alternatives' log-probabilities
    float32 `[rows, k]` and ids int32 `[rows, k]`) of float `[rows, vocab]` logits; k = MAX_LOGPROBS
    (or the vocabulary, if smaller)."""
    chosen = kv.no_pad(logits, self.model.config.pad_id)
    greedy = topk.argmax(chosen)
    tokens = jax.lax.cond(
      jnp.any(sampling),
      lambda: jnp.where(sampling, sample_tokens(chosen, keys, index, temperature, top_k, top_p), greedy),
      lambda: greedy,
    )
    return (tokens, *self._logprobs(logits, tokens))

  def _logprobs(self, logits, tokens):
    """(log-softmax of float `[rows, vocab]` logits at int `[rows]` tokens, then the top k's
    log-probabilities and ids): the model's own distribution, before any sampling filter."""
    logits = logits.astype(jnp.float32)
    token = jnp.take_along_axis(logits, tokens[:, None], axis=1)[:, 0] - jax.nn.logsumexp(logits, axis=1)
    return (token, *topk.top_k_log_probs(logits, min(MAX_LOGPROBS, logits.shape[1])))

  def _prefill_fn(self, params, layers, inputs, resume, table, source_table, rng, sampling, options):
    params = decoding_params(params)  # int8 weights stay int8 between calls (`inference.quantize`)
    zeros = jnp.zeros((1,), jnp.int32)
    cache = self._cache(layers, zeros, zeros, table, source_table)
    logits, cache = kv.prefill(self.model, params, cache, inputs)
    if resume.shape[1]:  # a preempted request: feed back the tokens it had fed before
      cache = kv.extend(self.model, params, cache, resume)[1]
    keys = source_row_keys(rng, inputs, self.model.config.pad_id)
    chosen = self._choose(logits, keys, zeros, sampling, *options)
    return chosen, cache.layers, cache.state.lengths, cache.state.source_lengths, keys

  def _generate_fn(
    self,
    params,
    layers,
    tokens,
    lengths,
    source_lengths,
    table,
    source_table,
    keys,
    index,
    sampling,
    temperature,
    top_k,
    top_p,
  ):
    cache = self._cache(layers, lengths, source_lengths, table, source_table)
    logits, cache = kv.step(self.model, decoding_params(params), cache, tokens)
    return self._choose(logits, keys, index, sampling, temperature, top_k, top_p), cache.layers

  def _score_prompt_fn(self, params, inputs):
    """A decoder-only prompt `[1, width]` (padded at the end) teacher-forced: the log-probability
    of each token after the first given the ones before, `[1, width - 1]`, and the top
    alternatives there (`_logprobs`)."""
    inputs = jnp.maximum(inputs, 0)  # a model without a pad id (-1) reads its padding as token 0: causal, unseen
    logits = self.model.apply({"params": decoding_params(params)}, inputs)[0, :-1]
    return self._logprobs(logits, inputs[0, 1:])

  # ---------------------------------------------------------------- requests

  def validate(self, request: Request) -> None:
    """Raises ValueError (one line) for a request this engine cannot serve."""
    if not request.inputs:
      raise ValueError("the input is empty")
    if len(request.inputs) > self.max_input_len:
      raise ValueError(f"the input has {len(request.inputs)} tokens; this model takes at most {self.max_input_len}")
    if not isinstance(request.max_new_tokens, int) or request.max_new_tokens < 1:
      raise ValueError(f"max new tokens must be an integer >= 1, got {request.max_new_tokens!r}")
    if request.sampling:
      check_sampling(*request.options())
    check_seed(request.seed)
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
      raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {request.logprobs!r}")
    if request.prompt_logprobs and self.model.ENCODES_SOURCE:
      raise ValueError("prompt log-probabilities need a decoder-only model; this one encodes a source")
    usable = self.pages.num_pages - 1
    own = self.pages.pages_for(min(1 + (1 if self.model.ENCODES_SOURCE else len(request.inputs)), self.max_length))
    source = self.source_pages.pages_for(len(request.inputs)) if self.model.ENCODES_SOURCE else 0
    if max(own, source) > usable:
      raise ValueError(
        f"the input needs {max(own, source)} KV-cache pages but the pool has {usable}; "
        "start the server with more --num-pages"
      )

  def submit(self, request: Request) -> Request:
    """Queues `request` (validated first; `eos_id` None becomes the model's). Raises ValueError for a bad request."""
    self.validate(request)
    if request.eos_id is None:
      request.eos_id = self.model.config.eos_id
    self.waiting.append(request)
    return request

  @property
  def busy(self) -> bool:
    """Whether any request is waiting or running."""
    return bool(self.waiting) or any(r is not None for r in self.slots)

  def _emit(self, request: Request, token: int | None) -> None:
    if request.on_token is not None:
      request.on_token(request, token)

  def _retire(self, slot: int, error: str | None = None) -> None:
    request = self.slots[slot]
    self.slots[slot] = None
    self.pages.release(slot)
    self.source_pages.release(slot)
    self.lengths[slot] = self.source_lengths[slot] = 0
    request.done, request.error = True, error
    self._emit(request, None)

  def _accept(self, slot: int, chosen: tuple, row: int) -> None:
    """Records row `row` of `chosen` (the jitted `_choose`'s host arrays) as the next output of
    the request in `slot`; retires it when done."""
    request = self.slots[slot]
    token = int(chosen[0][row])
    request.tokens.append(token)
    if request.logprobs is not None:
      request.token_logprobs.append(token_logprob(chosen, row, request.logprobs))
    self._emit(request, token)
    self.next_token[slot] = token
    if token == request.eos_id or (request.stop is not None and request.stop(request)):
      request.finish_reason = "stop"
    elif len(request.tokens) >= request.max_new_tokens or self.lengths[slot] >= self.max_length:
      request.finish_reason = "length"
    if request.finish_reason:
      self._retire(slot)

  def _padded(self, tokens: list[int]) -> np.ndarray:
    """int32 `[1, width]` with `tokens` then padding; widths are page multiples (few shapes to compile)."""
    out = np.full((1, self.pages.pages_for(len(tokens)) * self.pages.page_size), self.model.config.pad_id, np.int32)
    out[0, : len(tokens)] = tokens
    return out

  def _admit(self) -> None:
    if self.batching == "static" and any(r is not None for r in self.slots):
      return  # static batching: the next batch starts once every request of the running one has finished
    while self.waiting and None in self.slots:
      request = self.waiting[0]
      if request.cancelled:
        self.waiting.popleft()
        request.done = True
        self._emit(request, None)
        continue
      slot = self.slots.index(None)
      n, fed = len(request.inputs), request.tokens[:-1]  # a preempted request resumes after `fed`
      cached = (1 if self.model.ENCODES_SOURCE else n) + len(fed)
      source_ok = self.source_pages.reserve(slot, n) if self.model.ENCODES_SOURCE else True
      if not source_ok or not self.pages.reserve(slot, min(cached + 1, self.max_length)):  # + its next token
        self.pages.release(slot)
        self.source_pages.release(slot)
        return  # the pool is full: wait for running requests to free pages
      self.waiting.popleft()
      self.slots[slot] = request
      t, k, p = request.options()
      rng = jax.random.key(request.seed)
      chosen, self.layers, lengths, source_lengths, keys = self._prefill(
        self.params,
        self.layers,
        self._padded(request.inputs),
        self._padded(fed) if fed else np.zeros((1, 0), np.int32),
        self.pages.table[slot : slot + 1],
        self.source_pages.table[slot : slot + 1],
        jax.random.fold_in(rng, request.choice) if request.choice else rng,
        jnp.asarray([request.sampling]),
        (jnp.float32(t), jnp.int32(k), jnp.float32(p)),
      )
      self.lengths[slot], self.source_lengths[slot] = int(lengths[0]), int(source_lengths[0])
      self.row_keys = self.row_keys.at[slot].set(keys[0])
      if request.prompt_logprobs and not request.prompt_token_logprobs:
        scored = [np.asarray(x) for x in self._score_prompt(self.params, self._padded(request.inputs))]
        request.prompt_token_logprobs = [None] + [token_logprob(scored, i, request.logprobs or 0) for i in range(n - 1)]
      if request.tokens:  # resumed: its next token is the one it had not fed yet
        self.next_token[slot] = request.tokens[-1]
      else:
        self._accept(slot, [np.asarray(x) for x in chosen], 0)

  def _preempt(self, slot: int) -> None:
    """Frees the pages of the request in `slot` and puts it back at the head of the queue; it
    resumes where it stopped (its inputs and fed tokens are prefilled again)."""
    request = self.slots[slot]
    self.slots[slot] = None
    self.pages.release(slot)
    self.source_pages.release(slot)
    self.lengths[slot] = self.source_lengths[slot] = 0
    self.waiting.appendleft(request)

  def step(self) -> None:
    """Admits waiting requests, then decodes one token for every running request."""
    for slot, request in enumerate(self.slots):
      if request is not None and request.cancelled:
        self._retire(slot, "cancelled")
    self._admit()
    running = [s for s, r in enumerate(self.slots) if r is not None]
    ready = [s for s in running if self.pages.reserve(s, int(self.lengths[s]) + 1)]
    while running and not ready:  # every row waits for a page: preempt the newest, so the oldest goes on
      newest = max(running, key=lambda s: self.slots[s].id)
      if len(running) == 1:
        self._retire(
          newest,
          f"out of KV-cache pages: the request outgrew the pool ({self.pages.num_pages} pages "
          f"of {self.pages.page_size} tokens); start the server with more --num-pages",
        )
        return
      self._preempt(newest)
      running.remove(newest)
      ready = [s for s in running if self.pages.reserve(s, int(self.lengths[s]) + 1)]
    if not ready:
      return
    self._step_rows(ready)

  def _step_rows(self, ready: list[int]) -> None:
    """One `generate` step in which the slots `ready` feed their next token (the rest PAD)."""
    rows = np.zeros((len(self.slots),), bool)
    rows[ready] = True
    tokens = np.where(rows, self.next_token, self.model.config.pad_id).astype(np.int32)
    index = np.asarray([len(r.tokens) if r is not None else 0 for r in self.slots], np.int32)
    opts = [r.options() if r is not None else (1.0, 0, 1.0) for r in self.slots]
    sampling = np.asarray([r is not None and r.sampling for r in self.slots])
    chosen, self.layers = self._generate(
      self.params,
      self.layers,
      tokens,
      self.lengths,
      self.source_lengths,
      self.pages.table,
      self.source_pages.table,
      self.row_keys,
      index,
      sampling,
      np.asarray([o[0] for o in opts], np.float32),
      np.asarray([o[1] for o in opts], np.int32),
      np.asarray([o[2] for o in opts], np.float32),
    )
    chosen = [np.asarray(x) for x in chosen]
    self.lengths[ready] += 1
    for slot in ready:
      self._accept(slot, chosen, slot)

  def fail_all(self, error: str) -> None:
    """Ends every running and waiting request with `error` (after an unexpected failure)."""
    for slot, request in enumerate(self.slots):
      if request is not None:
        self._retire(slot, error)
    while self.waiting:
      request = self.waiting.popleft()
      request.done, request.error = True, error
      self._emit(request, None)

  def run(self, requests: list[Request]) -> list[Request]:
    """Submits `requests` and steps until all are done (a convenience for tests and benchmarks)."""
    for r in requests:
      self.submit(r)
    while self.busy:
      self.step()
    return requests

  def stats(self) -> dict[str, Any]:
    """Pages in use, running and waiting requests (for /health and benchmarks)."""
    return {
      "pages_in_use": self.pages.pages_in_use + self.source_pages.pages_in_use,
      "running": sum(r is not None for r in self.slots),
      "waiting": len(self.waiting),
    }

  @property
  def pages_free(self) -> int:
    """Pages free in the pools this model uses (the source pool only for an encoder-decoder)."""
    return len(self.pages.free) + (len(self.source_pages.free) if self.model.ENCODES_SOURCE else 0)
