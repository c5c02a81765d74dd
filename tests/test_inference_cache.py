"""Tests of jaxformer.inference.cache (with layers.kv_cache): cached decoding equals the full
forward, greedy decoding, the contiguous and paged layouts, rows of different lengths,
padding fed to the cache, and idle rows."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep

from jaxformer.config import ModelConfig
from jaxformer.inference import cache as kv
from jaxformer.inference.decode import greedy_decode
from jaxformer.layers import kv_cache as kvc
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.models.transformer import BOS_ID, PAD_ID, EncoderDecoder

VOCAB = 37
SRC_LEN = 11
OUT_LEN = 12  # tokens generated per row; <= CONFIG.max_length (the cache size)
NO_EOS = -1  # an eos_id no token equals: rows never stop early

CONFIG = ModelConfig(
  vocab_size=VOCAB,
  d_model=16,
  num_heads=2,
  d_ff=24,
  num_encoder_layers=1,
  num_decoder_layers=2,
  dropout_rate=0.0,
  max_length=16,
  tie_embeddings=False,
)
MODEL = EncoderDecoder(CONFIG)


def _sources():
  """Four sources of different lengths (11, 6, 9, 3), PAD padded to SRC_LEN."""
  rng = np.random.default_rng(0)
  src = rng.integers(4, VOCAB, (4, SRC_LEN)).astype(np.int32)
  for row, n in enumerate((11, 6, 9, 3)):
    src[row, n:] = PAD_ID
  return src


@pytest.fixture(scope="module")
def params():
  """Random params (structure from eval_shape, values from numpy: no init compile).

  Random Transformers tend to emit one token forever under greedy search; to get varied
  outputs the embeddings and output projection get N(0, 1) entries (the token and position
  drive the prediction), cross-attention N(0, 0.3^2), and every other leaf N(0, 0.1^2)
  (LayerNorm scales 1 + that), which still moves the logits far more than the tolerances.
  The output columns of PAD, 1, BOS and EOS are zeroed so greedy search does not emit them
  by chance (the EOS tests use a stand-in eos_id)."""
  src = jnp.asarray(_sources())
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: MODEL.init(k, src, src), jax.random.key(0)))["params"]
  rng = np.random.default_rng(1)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    if "embedding" in name or "output_proj" in name:
      std = 1.0
    elif "['cross_attention']" in name:
      std = 0.3  # so that the source visibly steers the output
    else:
      std = 0.1
    x = std * rng.standard_normal(s.shape)
    if name.endswith("['scale']"):
      x = x + 1.0
    if "output_proj" in name:
      x[:, :4] = 0.0
    return jnp.asarray(x, jnp.float32)

  return jax.tree_util.tree_map_with_path(fill, shapes)


@pytest.fixture(scope="module")
def fns():
  encode = jax.jit(lambda p, s: MODEL.apply({"params": p}, s, method="encode"))
  full_decode = jax.jit(lambda p, e, s, d: MODEL.apply({"params": p}, e, s, d, method="decode"))
  prefill = jax.jit(lambda p, s: kv.prefill(MODEL, p, kv.contiguous_cache(MODEL, p, s.shape[0], s.shape[1]), s))
  step = jax.jit(lambda p, cache, tokens: kv.step(MODEL, p, cache, tokens))
  extend = jax.jit(lambda p, cache, tokens: kv.extend(MODEL, p, cache, tokens))
  greedy = jax.jit(lambda p, s, eos: greedy_decode(MODEL, p, s, OUT_LEN, eos))
  return dict(encode=encode, full_decode=full_decode, prefill=prefill, step=step, extend=extend, greedy=greedy)


def _naive_greedy(params, fns, src, max_len, eos_id):
  """Greedy search that recomputes the whole prefix without a cache at every step.

  The decoder input buffer has a fixed length (one compile); positions after the current
  one hold PAD, which the causal mask hides from position i anyway."""
  batch = src.shape[0]
  encoded = fns["encode"](params, jnp.asarray(src))
  dec_in = np.full((batch, OUT_LEN), PAD_ID, np.int32)
  dec_in[:, 0] = BOS_ID
  out = np.full((batch, max_len), PAD_ID, np.int32)
  finished = np.zeros(batch, bool)
  for i in range(max_len):
    logits = np.asarray(fns["full_decode"](params, encoded, jnp.asarray(src), jnp.asarray(dec_in)))
    token = np.where(finished, PAD_ID, logits[:, i].argmax(-1))
    out[:, i] = token
    finished |= token == eos_id
    if i + 1 < OUT_LEN:
      dec_in[:, i + 1] = token
  return out


@pytest.fixture(scope="module")
def free_run(params, fns):
  """Greedy outputs of the four sources with no early stop (all OUT_LEN tokens)."""
  return np.asarray(fns["greedy"](params, jnp.asarray(_sources()), NO_EOS))


def test_contiguous_cache_shapes(params):
  cache = kv.contiguous_cache(MODEL, params, 3, SRC_LEN)
  layer = cache.layers["decoder_0"]["self_attention"]
  head_dim = CONFIG.d_model // CONFIG.num_heads
  bounds = kvc.segment_bounds(CONFIG.max_length)
  for name in ("key", "value"):  # segments at the bounds, together the whole capacity
    assert [x.shape for x in layer[name]] == [(3, CONFIG.kv_heads, b - a, head_dim) for a, b in zip(bounds, bounds[1:])]
  np.testing.assert_array_equal(cache.state.lengths, [0, 0, 0])
  assert cache.state.capacity == CONFIG.max_length and not cache.state.paged
  cross = cache.layers["decoder_1"]["cross_attention"]
  assert [x.shape for x in cross["key"]] == [(3, CONFIG.kv_heads, SRC_LEN, head_dim)]
  assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(cache.layers))


def test_a_cache_of_shapes_seen_before_is_made_without_tracing_the_prefill(params, monkeypatch):
  calls = []
  original = EncoderDecoder.prefill

  def counting(self, *args, **kwargs):
    calls.append(args[0].shape)
    return original(self, *args, **kwargs)

  monkeypatch.setattr(EncoderDecoder, "prefill", counting)
  kv._cache_shapes.cache_clear()  # whatever other tests left there
  first = kv.contiguous_cache(MODEL, params, 2, SRC_LEN, capacity=7)
  again = kv.contiguous_cache(MODEL, params, 2, SRC_LEN, capacity=7)
  other = kv.contiguous_cache(MODEL, params, 2, SRC_LEN, capacity=9)
  assert calls == [(2, SRC_LEN), (2, SRC_LEN)]  # traced for capacities 7 and 9, not for 7 again
  assert jax.tree.map(jnp.shape, first) == jax.tree.map(jnp.shape, again) != jax.tree.map(jnp.shape, other)
  assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(again.layers))


def test_cached_decoding_matches_full_forward(params, fns):
  src = jnp.asarray(_sources())
  batch = src.shape[0]
  rng = np.random.default_rng(2)
  dec_in = rng.integers(4, VOCAB, (batch, OUT_LEN)).astype(np.int32)
  dec_in[:, 0] = BOS_ID

  encoded = fns["encode"](params, src)
  full = np.asarray(fns["full_decode"](params, encoded, src, jnp.asarray(dec_in)))  # [B, T, V]
  assert full.std() > 0.5 and len(np.unique(full.argmax(-1))) > 3  # non-degenerate logits

  logits, prefilled = fns["prefill"](params, src)  # encodes, feeds BOS
  np.testing.assert_array_equal(prefilled.state.lengths, [1] * batch)
  np.testing.assert_array_equal(prefilled.state.source_lengths, [11, 6, 9, 3])
  np.testing.assert_allclose(np.asarray(logits), full[:, 0], atol=1e-5, rtol=1e-5)
  cache = prefilled
  for i in range(1, OUT_LEN):
    logits, cache = fns["step"](params, cache, jnp.asarray(dec_in[:, i]))
    assert logits.shape == (batch, VOCAB)
    np.testing.assert_allclose(np.asarray(logits), full[:, i], atol=1e-5, rtol=1e-5, err_msg=f"step {i}")
  np.testing.assert_array_equal(cache.state.lengths, [OUT_LEN] * batch)

  # The rest fed as one chunk gives the same logits as one token per step.
  chunk, cache = fns["extend"](params, prefilled, jnp.asarray(dec_in[:, 1:]))
  np.testing.assert_allclose(np.asarray(chunk), full[:, 1:], atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(cache.state.lengths, [OUT_LEN] * batch)

  # The full pass over just a prefix (no later tokens present at all) gives the same logits.
  prefix = 5
  short = np.asarray(fns["full_decode"](params, encoded, src, jnp.asarray(dec_in[:, :prefix])))
  np.testing.assert_allclose(short, full[:, :prefix], atol=1e-5, rtol=1e-5)


def test_cross_attention_step_before_prefill_raises(params):
  cache = kv.contiguous_cache(MODEL, params, 4, SRC_LEN)
  # A cache without the cross-attention keys/values that a prefill would have stored.
  layers = {k: {n: d for n, d in layer.items() if n != "cross_attention"} for k, layer in cache.layers.items()}
  step = jax.jit(lambda p, c: kv.step(MODEL, p, c, jnp.full((4,), 5, jnp.int32)))
  with pytest.raises(ValueError, match="prefill"):
    step(params, kv.KVCache(layers, cache.state))


def test_greedy_equals_naive_greedy(params, fns, free_run):
  src = _sources()
  naive = _naive_greedy(params, fns, src, OUT_LEN, NO_EOS)
  assert free_run.shape == (4, OUT_LEN) and free_run.dtype == np.int32
  np.testing.assert_array_equal(free_run, naive)
  # Preconditions that make the comparison meaningful: varied tokens, no PAD generated.
  assert all(len(np.unique(row)) >= 3 for row in free_run)
  assert len({tuple(row) for row in free_run}) == 4
  assert not np.any(free_run == PAD_ID)


def test_greedy_with_eos_equals_naive_greedy(params, fns, free_run):
  eos = _eos_for_test(free_run)
  src = _sources()
  out = np.asarray(fns["greedy"](params, jnp.asarray(src), eos))
  np.testing.assert_array_equal(out, _naive_greedy(params, fns, src, OUT_LEN, eos))


def _eos_for_test(free_run):
  """A token that as many rows as possible emit before their last step, but not all of them."""
  best, best_hits = None, 0
  for token in range(4, VOCAB):
    hits = sum(bool((row[:-1] == token).any()) for row in free_run)
    if best_hits < hits < len(free_run):
      best, best_hits = token, hits
  if best is None:
    pytest.fail("no suitable stand-in EOS token in the free-running outputs")
  return best


def test_eos_stops_a_row_while_others_continue(params, fns, free_run):
  eos = _eos_for_test(free_run)
  out = np.asarray(fns["greedy"](params, jnp.asarray(_sources()), eos))
  assert out.shape == free_run.shape
  stopped = []
  for row, free in zip(out, free_run):
    hits = np.flatnonzero(free == eos)
    if hits.size:
      end = hits[0] + 1  # up to and including the first EOS
      np.testing.assert_array_equal(row[:end], free[:end])
      np.testing.assert_array_equal(row[end:], PAD_ID)
      stopped.append(end)
    else:  # never emits EOS: decodes the full length unchanged
      np.testing.assert_array_equal(row, free)
      assert np.all(row != PAD_ID)
  assert 1 <= len(stopped) < len(out) and min(stopped) < OUT_LEN


def test_all_rows_stopping_ends_with_pad(params, fns, free_run):
  """When every row has emitted EOS the loop stops; all later slots stay PAD."""
  common = [t for t in range(4, VOCAB) if all((row[:-2] == t).any() for row in free_run)]
  assert common, "no token that every free-running row emits"
  eos = common[0]
  out = np.asarray(fns["greedy"](params, jnp.asarray(_sources()), eos))
  ends = []
  for row, free in zip(out, free_run):
    end = np.flatnonzero(free == eos)[0] + 1
    np.testing.assert_array_equal(row[:end], free[:end])
    np.testing.assert_array_equal(row[end:], PAD_ID)
    ends.append(end)
  assert max(ends) < OUT_LEN


def test_max_decode_len_is_respected(params, fns, free_run):
  src = jnp.asarray(_sources())
  short = np.asarray(jax.jit(lambda p, s: greedy_decode(MODEL, p, s, 4, NO_EOS))(params, src))
  assert short.shape == (4, 4)
  np.testing.assert_array_equal(short, free_run[:, :4])
  assert free_run.shape == (4, OUT_LEN)


def test_batch_composition_does_not_change_output(params, fns, free_run):
  src = _sources()
  # Row 2 (9 tokens) decoded alone, without any padding column, equals its decoding in the
  # batch, next to a longer (11) and shorter (6, 3) sources that pad it to 11.
  alone = np.asarray(fns["greedy"](params, jnp.asarray(src[2:3, :9]), NO_EOS))
  assert alone.shape == (1, OUT_LEN)
  np.testing.assert_array_equal(alone[0], free_run[2])
  # Reordering the batch reorders the outputs and changes nothing else.
  order = [3, 2, 0, 1]
  mixed = np.asarray(fns["greedy"](params, jnp.asarray(src[order]), NO_EOS))
  np.testing.assert_array_equal(mixed, free_run[order])


# --- layouts, ragged rows, padding and idle rows, for both model kinds ----------------------

SMALL = dict(
  vocab_size=VOCAB,
  d_model=16,
  num_heads=4,
  d_ff=24,
  num_encoder_layers=1,
  num_decoder_layers=1,
  dropout_rate=0.0,
  max_length=16,
  pre_norm=True,
)
LENGTHS, WIDTH, CHUNK, STEPS = (7, 3, 5), 7, 2, 3  # prompt / source lengths; then a chunk, then steps
PAGE = 3  # divides none of the lengths nor max_length
KINDS = {
  "ed-rope-gqa-window": (EncoderDecoder, dict(position="rope", num_kv_heads=2, sliding_window=3)),
  "ed-alibi-mqa-window": (EncoderDecoder, dict(position="alibi", num_kv_heads=1, sliding_window=4)),
  "do-rope-gqa-window": (DecoderOnly, dict(position="rope", num_kv_heads=2, sliding_window=3)),
  "do-alibi-mqa-window": (DecoderOnly, dict(position="alibi", num_kv_heads=1, sliding_window=4)),
}


@functools.cache
def _case(name):
  """(model, params, run) for a `KINDS` case; N(0, 0.3^2) params (norm scales 1 + that).

  run(params, cache, inputs [B, W], chunk [B, C], steps [B, S]) -> (numpy outputs, cache): prefill
  of the inputs, one `extend` of the chunk, then one `step` per column of `steps`; outputs
  hold the logits of each ("first" [B, V], "chunk" [B, C, V], "steps" [B, S, V]) and the
  rows' lengths after the prefill and the chunk ("lengths" [B, 2]) and after each step
  ("step_lengths" [B, S])."""
  cls, options = KINDS[name]
  model = cls(ModelConfig(**SMALL, **options))
  tokens = jnp.ones((1, WIDTH), jnp.int32)
  args = (tokens, tokens) if cls is EncoderDecoder else (tokens,)
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: model.init(k, *args), jax.random.key(0)))["params"]
  rng = np.random.default_rng(3)
  params = jax.tree_util.tree_map_with_path(
    lambda path, s: jnp.asarray(
      0.3 * rng.standard_normal(s.shape) + jax.tree_util.keystr(path).endswith("['scale']"), jnp.float32
    ),
    shapes,
  )

  @jax.jit
  def run_jit(params, cache, inputs, chunk, steps):
    first, cache = kv.prefill(model, params, cache, inputs)
    after_prefill = cache.state.lengths
    chunk_logits, cache = kv.extend(model, params, cache, chunk)
    lengths = jnp.stack([after_prefill, cache.state.lengths], axis=1)

    def body(cache, tokens):
      logits, cache = kv.step(model, params, cache, tokens)
      return cache, (logits, cache.state.lengths)

    cache, (logits, step_lengths) = jax.lax.scan(body, cache, steps.T)
    return dict(
      first=first, chunk=chunk_logits, steps=jnp.moveaxis(logits, 0, 1), lengths=lengths, step_lengths=step_lengths.T
    ), cache

  def run(*args):
    outputs, cache = run_jit(*args)
    return jax.device_get(outputs), cache

  return model, params, run


def _data(rows=3, seed=4):
  """Inputs int32 `[rows, WIDTH]` of lengths cycling through LENGTHS (PAD padded), a chunk
  `[rows, CHUNK]` and steps `[rows, STEPS]` of real tokens (ids >= 4)."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(4, VOCAB, (rows, WIDTH)).astype(np.int32)
  lengths = np.resize(LENGTHS, rows)
  inputs[np.arange(WIDTH)[None] >= lengths[:, None]] = PAD_ID
  return (
    inputs,
    rng.integers(4, VOCAB, (rows, CHUNK)).astype(np.int32),
    rng.integers(4, VOCAB, (rows, STEPS)).astype(np.int32),
  )


def _contiguous(name, params, rows):
  model, _, _ = _case(name)
  return kv.contiguous_cache(model, params, rows, WIDTH)


def _paged(name, params, rows, active=None, tokens=None, seed=5):
  """A paged cache of `rows` rows, pages of PAGE tokens. Each active row (default: all) gets
  shuffled, non-contiguous page ids (some ids unused) for its first `tokens[r]` self-attention
  tokens (default: max_length) and all its source tokens; the rest of the tables is page 0."""
  model, _, _ = _case(name)
  per_row, source_per_row = -(-SMALL["max_length"] // PAGE), -(-WIDTH // PAGE)
  num_pages = 1 + rows * per_row + 5
  cache = kv.paged_cache(model, params, rows, num_pages, PAGE, per_row, source_per_row)
  rng = np.random.default_rng(seed)
  active = np.ones(rows, bool) if active is None else np.asarray(active)
  table = rng.permutation(np.arange(1, num_pages))[: rows * per_row].reshape(rows, per_row)
  source_table = rng.permutation(np.arange(1, num_pages))[: rows * source_per_row].reshape(rows, source_per_row)
  pages = np.full(rows, per_row) if tokens is None else -(-np.asarray(tokens) // PAGE)
  used = np.arange(per_row)[None] < pages[:, None]
  state = cache.state.replace(
    page_table=jnp.asarray(np.where(active[:, None] & used, table, 0), jnp.int32),
    source_page_table=jnp.asarray(np.where(active[:, None], source_table, 0), jnp.int32),
  )
  return kv.KVCache(cache.layers, state)


def _close(a, b, **kw):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5, **kw)


@pytest.mark.parametrize("name", sweep(KINDS, {"do-alibi-mqa-window"}))
def test_paged_cache_equals_contiguous(name):
  """Prefill, a chunk and single steps through a paged cache (shuffled page ids, pages of 3
  tokens: rows of 7, 3 and 5 inputs end mid-page) give the contiguous cache's logits."""
  _, params, run = _case(name)
  data = tuple(map(jnp.asarray, _data()))
  contiguous, _ = run(params, _contiguous(name, params, 3), *data)
  paged, cache = run(params, _paged(name, params, 3), *data)
  for key in ("first", "chunk", "steps"):
    _close(paged[key], contiguous[key], err_msg=key)
  np.testing.assert_array_equal(paged["step_lengths"], contiguous["step_lengths"])
  assert np.asarray(contiguous["steps"]).std() > 0.1  # non-degenerate logits
  pool = cache.layers["decoder_0" if "decoder_0" in cache.layers else "layer_0"]["self_attention"]["key"]
  assert pool.shape[0] == cache.state.num_pages and pool.shape[2] == PAGE


def _alone(name, params, inputs, chunk, steps):
  """Each row run by itself (batch 1, its PAD columns cut off): a list of output dicts."""
  _, _, run = _case(name)
  out = []
  for r in range(inputs.shape[0]):
    row = [x[r : r + 1, : max(int(np.sum(x[r] != PAD_ID)), 1)] for x in (inputs, chunk, steps)]
    out.append(run(params, _contiguous(name, params, 1), *map(jnp.asarray, row))[0])
  return out


@pytest.mark.parametrize("name", sweep(["ed-rope-gqa-window", "do-rope-gqa-window"], {"do-rope-gqa-window"}))
def test_rows_of_different_lengths_equal_each_row_alone(name):
  """Inputs of 7, 3 and 5 tokens in one batch (PAD padded): every row's logits equal the
  row's own run at batch size 1 without padding."""
  _, params, run = _case(name)
  inputs, chunk, steps = _data()
  batch = run(params, _contiguous(name, params, 3), *map(jnp.asarray, (inputs, chunk, steps)))[0]
  decoder_only = name.startswith("do")
  base = np.asarray(LENGTHS) if decoder_only else np.ones(3, int)  # self-attention tokens after prefill
  np.testing.assert_array_equal(batch["lengths"], np.stack([base, base + CHUNK], 1))
  np.testing.assert_array_equal(batch["step_lengths"], base[:, None] + CHUNK + np.arange(1, STEPS + 1))
  for r, alone in enumerate(_alone(name, params, inputs, chunk, steps)):
    for key in ("first", "chunk", "steps"):
      _close(batch[key][r], alone[key][0], err_msg=f"row {r} {key}")
  assert np.abs(np.asarray(batch["steps"][0] - batch["steps"][1])).max() > 1e-2  # rows do differ


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("name", ["ed-rope-gqa-window", "do-rope-gqa-window"])
def test_padding_fed_to_extend_changes_neither_lengths_nor_later_logits(name, layout):
  """Row 1's chunk ends with PAD and it is fed PAD at step 1; row 2's chunk ends with PAD and
  it is fed PAD at step 0. Their lengths do not count the PADs, and their logits at the real
  tokens equal those of the row alone without any PAD (row 0 has no PAD)."""
  _, params, run = _case(name)
  inputs, chunk, steps = _data()
  rng = np.random.default_rng(6)
  padded_chunk = np.concatenate([chunk, rng.integers(4, VOCAB, (3, 1))], axis=1).astype(np.int32)
  padded_chunk[1:, CHUNK] = PAD_ID
  padded_steps = np.concatenate([steps, rng.integers(4, VOCAB, (3, 1))], axis=1).astype(np.int32)
  padded_steps[1] = [steps[1, 0], PAD_ID, steps[1, 1], steps[1, 2]]
  padded_steps[2] = [PAD_ID, *steps[2]]
  cache = _contiguous(name, params, 3) if layout == "contiguous" else _paged(name, params, 3)
  batch = run(params, cache, *map(jnp.asarray, (inputs, padded_chunk, padded_steps)))[0]
  alone = _alone(name, params, inputs, chunk, steps)
  for r, real_steps in ((1, [0, 2, 3]), (2, [1, 2, 3])):
    _close(batch["first"][r], alone[r]["first"][0])
    _close(batch["chunk"][r, :CHUNK], alone[r]["chunk"][0], err_msg=f"row {r} chunk")
    _close(batch["steps"][r, real_steps], alone[r]["steps"][0], err_msg=f"row {r} steps")
    np.testing.assert_array_equal(batch["lengths"][r], alone[r]["lengths"][0])
    np.testing.assert_array_equal(batch["step_lengths"][r, real_steps], alone[r]["step_lengths"][0])
  np.testing.assert_array_equal(batch["step_lengths"][1, 1], batch["step_lengths"][1, 0])  # the PAD step
  np.testing.assert_array_equal(batch["step_lengths"][2, 0], batch["lengths"][2, 1])
  np.testing.assert_array_equal(batch["lengths"][0, 1] - batch["lengths"][0, 0], CHUNK + 1)


@pytest.mark.parametrize("name", sweep(["ed-alibi-mqa-window", "do-alibi-mqa-window"], {"do-alibi-mqa-window"}))
def test_idle_rows_on_page_zero_do_not_disturb_other_rows(name):
  """Rows 1 and 3 are idle: their page tables hold only page 0 (the null page). Row 1 is fed
  PAD throughout, row 3 real tokens (its keys/values all land on page 0). The active rows 0
  and 2, whose unused page-table entries also point at page 0, get the logits they get in a
  contiguous batch of their own."""
  _, params, run = _case(name)
  inputs, chunk, steps = _data(rows=4)
  for x in (inputs, chunk, steps):
    x[1] = PAD_ID
  base = np.sum(inputs != PAD_ID, axis=1) if name.startswith("do") else np.ones(4, int)  # ED: BOS
  paged, cache = run(
    params,
    _paged(name, params, 4, active=[True, False, True, False], tokens=base + CHUNK + STEPS),
    *map(jnp.asarray, (inputs, chunk, steps)),
  )
  own, _ = run(params, _contiguous(name, params, 2), *(jnp.asarray(x[[0, 2]]) for x in (inputs, chunk, steps)))
  for key in ("first", "chunk", "steps"):
    _close(paged[key][np.array([0, 2])], own[key], err_msg=key)
  np.testing.assert_array_equal(paged["step_lengths"][[0, 2]], own["step_lengths"])
  np.testing.assert_array_equal(paged["step_lengths"][1], base[1])  # PAD only: nothing (but BOS) cached
  pool = cache.layers["decoder_0" if "decoder_0" in cache.layers else "layer_0"]["self_attention"]["key"]
  assert float(jnp.abs(pool[0]).max()) > 0.0  # row 3 did write on page 0
