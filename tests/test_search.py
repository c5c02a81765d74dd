"""Tests of jaxformer.inference.search and .decode: beam search, sampling, the decoding factory, and
hypothesis scoring."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep

from jaxformer import sharding as sh
from jaxformer.config import Config, MeshConfig, ModelConfig, OptimConfig
from jaxformer.inference.decode import (
  SearchOptions,
  beam_search,
  decode_with,
  default_decode_len,
  greedy_decode,
  make_decode_fn,
  sample_decode,
  source_limits,
)
from jaxformer.inference.sampling import filter_logits, source_row_keys
from jaxformer.inference.search import EOS_ID, LENGTH_PENALTY, beam_search_core, length_penalty, sample_core
from jaxformer.models.transformer import PAD_ID, EncoderDecoder
from jaxformer.tasks.evaluate import hypothesis_scores
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_train_step

VOCAB, MAX_LEN = 37, 16


# --- a tiny random model ----------------------------------------------------------------------


def _sources(seed=0, lengths=(11, 4, 7, 2)):
  rng = np.random.default_rng(seed)
  src = rng.integers(4, VOCAB, (len(lengths), max(lengths)))
  src[np.arange(src.shape[1])[None] >= np.array(lengths)[:, None]] = PAD_ID
  return jnp.asarray(src, jnp.int32)


@pytest.fixture(scope="module")
def model_and_params():
  cfg = ModelConfig(
    vocab_size=VOCAB,
    d_model=16,
    num_heads=2,
    d_ff=24,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_length=MAX_LEN,
  )
  model = EncoderDecoder(cfg)
  src = _sources()
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: model.init(k, src, src), jax.random.key(0)))["params"]
  rng = np.random.default_rng(1)

  def fill(path, s):
    x = 0.5 * rng.standard_normal(s.shape)
    if jax.tree_util.keystr(path).endswith("['scale']"):
      x = x + 1.0
    return jnp.asarray(x, jnp.float32)

  params = jax.tree_util.tree_map_with_path(fill, shapes)
  # Point EOS's (tied) embedding along the decoder's final LayerNorm bias so EOS is likely
  # in some rows: with these params beam search ends row 0 of `_sources()` with EOS at once
  # (greedy does not) while the other rows run to the length limit.
  bias = params["decoder_0"]["ffn_sublayer"]["norm"]["bias"]
  params["embed"]["embedding"] = params["embed"]["embedding"].at[EOS_ID].set(3.0 * bias / jnp.linalg.norm(bias))
  return model, params


@pytest.fixture(scope="module")
def fns(model_and_params):
  model, _ = model_and_params
  greedy = jax.jit(lambda p, x: greedy_decode(model, p, x, 12))
  beam = {(k, a): jax.jit(lambda p, x, k=k, a=a: beam_search(model, p, x, k, 12, a)) for k, a in ((1, 0.0), (3, 0.6))}
  sample = jax.jit(lambda p, x, rng, t, k: sample_decode(model, p, x, 12, rng, t, k), static_argnums=(3, 4))
  return greedy, beam, sample


@pytest.fixture(scope="module")
def rescore(model_and_params):
  """(src, tokens, alpha) -> `hypothesis_scores` (teacher-forced sum log p(y_t) / lp(|Y|)),
  after checking the layout: tokens through EOS (or all of them), then only PAD."""
  model, params = model_and_params
  scores = jax.jit(lambda s, t, a: hypothesis_scores(model, params, s, t, a), static_argnums=2)

  def fn(src, tokens, alpha):
    for row in np.asarray(tokens):
      eos = np.flatnonzero(row == EOS_ID)
      n = eos[0] + 1 if eos.size else len(row)
      assert (row[n:] == PAD_ID).all() and (row[:n] != PAD_ID).all()
    return np.asarray(scores(src, tokens, alpha))

  return fn


def test_length_penalty_formula():
  np.testing.assert_allclose(length_penalty(2, 0.6), (7 / 6) ** 0.6, rtol=1e-6)
  np.testing.assert_allclose(length_penalty(jnp.array([1, 10]), 0.6), [1.0, 2.5**0.6], rtol=1e-6)
  assert float(length_penalty(30, 0.0)) == 1.0


def test_beam_one_equals_greedy(model_and_params, fns):
  _, params = model_and_params
  greedy, beam, _ = fns
  src = _sources()
  tokens, scores = beam[1, 0.0](params, src)
  np.testing.assert_array_equal(tokens, greedy(params, src))
  assert np.all(np.asarray(scores) < 0)  # log-probs


def test_beam_hypotheses_and_greedy_under_the_same_objective(model_and_params, fns, rescore):
  _, params = model_and_params
  _, beam, _ = fns
  src = _sources()
  tokens, _ = beam[3, 0.6](params, src)
  assert tokens.shape == (4, 12) and tokens.dtype == jnp.int32
  assert (np.asarray(tokens) == EOS_ID).any(axis=1).tolist() == [True, False, False, False]  # row 0 stops
  greedy_tokens = fns[0](params, src)
  # the wider beam never does worse than greedy here (checked under the same penalty)
  assert (rescore(src, tokens, 0.6) >= rescore(src, greedy_tokens, 0.6) - 1e-5).all()


def test_beam_scores_match_teacher_forced_rescoring(model_and_params, fns, rescore, reversal_model):
  """Scores of the returned hypotheses equal their teacher-forced length-normalised
  log-probs (`hypothesis_scores`), which fails if the cache were not reordered with the
  beams: beam 1 (raw log-probs), beam 3 with alpha 0.6, and the trained model's beam 4."""
  _, params = model_and_params
  _, beam, _ = fns
  src = _sources()
  for k, alpha in ((1, 0.0), (3, 0.6)):
    tokens, scores = beam[k, alpha](params, src)
    np.testing.assert_allclose(scores, rescore(src, tokens, alpha), rtol=1e-4, atol=1e-4, err_msg=f"beam {k}")
  model, params = reversal_model
  src, _ = _reversal_pairs(48, seed=1)
  beam_tokens, beam_reported = jax.jit(lambda p, x: beam_search(model, p, x, 4, 12, 0.6))(params, src)
  rescored = jax.jit(lambda p, x, t: hypothesis_scores(model, p, x, t, 0.6))(params, src, beam_tokens)
  np.testing.assert_allclose(np.asarray(rescored), beam_reported, rtol=0, atol=1e-4)


# --- a briefly trained model: beam search on its own objective ------------------------------

REV_LEN, REV_STEPS = 8, 300  # source tokens at most; train steps


def _reversal_pairs(n, seed):
  """Sources of 3..REV_LEN random tokens + EOS; targets the tokens reversed + EOS (int32 [n, REV_LEN + 1])."""
  rng = np.random.default_rng(seed)
  src = np.zeros((n, REV_LEN + 1), np.int32)
  tgt = np.zeros_like(src)
  for i in range(n):
    tokens = rng.integers(4, VOCAB, rng.integers(3, REV_LEN + 1))
    src[i, : len(tokens) + 1] = np.append(tokens, EOS_ID)
    tgt[i, : len(tokens) + 1] = np.append(tokens[::-1], EOS_ID)
  return src, tgt


@pytest.fixture(scope="module")
def reversal_model():
  """A 1+1-layer model trained for REV_STEPS steps (fresh batches of 64) to reverse sequences,
  with the library's train step on one device. Returns (model, params)."""
  cfg = Config(
    model=ModelConfig(
      vocab_size=VOCAB,
      d_model=32,
      num_heads=2,
      d_ff=64,
      num_encoder_layers=1,
      num_decoder_layers=1,
      dropout_rate=0.0,
      max_length=MAX_LEN,
    ),
    optim=OptimConfig(schedule="constant", learning_rate=3e-3, label_smoothing=0.0),
  )
  model = EncoderDecoder(cfg.model)
  tx = make_optimizer(cfg.optim, cfg.model.d_model)
  mesh = sh.make_mesh(MeshConfig(data=1), jax.devices()[:1])
  _, shardings = state_shardings(model, tx, mesh)
  state = create_state(model, tx, mesh, 0, shardings)
  step = make_train_step(model, tx, cfg, mesh, shardings)
  for i in range(REV_STEPS):
    src, tgt = _reversal_pairs(64, seed=100 + i)
    state, _ = step(state, {"inputs": jnp.asarray(src), "targets": jnp.asarray(tgt)}, jax.random.key(0))
  return model, state.params


def test_beam_beats_greedy_on_its_objective_after_training(reversal_model):
  """On held-out sentences beam 4's length-penalised score (alpha 0.6) is >= greedy's on
  >= 90% of them, both measured by `hypothesis_scores` (which should equal the score beam
  search reports for its own hypotheses: `test_beam_scores_match_teacher_forced_rescoring`)."""
  model, params = reversal_model
  src, tgt = _reversal_pairs(48, seed=1)
  greedy_tokens = jax.jit(lambda p, x: greedy_decode(model, p, x, 12))(params, src)
  beam_tokens, _ = jax.jit(lambda p, x: beam_search(model, p, x, 4, 12, 0.6))(params, src)
  # Trained but not perfect (about 70% exact), so beam and greedy outputs sometimes differ.
  assert np.mean(np.all(np.asarray(greedy_tokens)[:, : REV_LEN + 1] == tgt, axis=1)) >= 0.5
  score = jax.jit(lambda p, x, t: hypothesis_scores(model, p, x, t, 0.6))
  beam_scores = np.asarray(score(params, src, beam_tokens))
  greedy_scores = np.asarray(score(params, src, greedy_tokens))
  assert np.all(beam_scores < 0) and np.all(np.isfinite(greedy_scores))
  assert np.mean(beam_scores >= greedy_scores - 1e-5) >= 0.9, (beam_scores, greedy_scores)


# --- hand-weighted next-token distribution --------------------------------------------------
A, B = 4, 5
_OTHER = 0.01  # PAD, UNK, BOS


def _table(rows):
  """log-prob table [6, 6]: next-token distribution given the previous token."""
  t = np.full((6, 6), 1 / 6)
  for prev, probs in rows.items():
    t[prev] = probs
  return np.log(t / t.sum(1, keepdims=True))


def _fake_logits_fn(table):
  table = jnp.asarray(table, jnp.float32)

  def fn(tokens, cache, position):
    return table[tokens], {"prev": tokens, "index": cache["index"] + 1}

  return fn


def _fake_cache(batch):
  return {"prev": jnp.zeros((batch,), jnp.int32), "index": jnp.array(0, jnp.int32)}


#                   PAD     UNK     BOS     EOS   A     B
INIT = np.log([_OTHER, _OTHER, _OTHER, 0.07, 0.5, 0.4])
TRAP = _table(
  {
    A: [_OTHER, _OTHER, _OTHER, 0.37, 0.3, 0.3],  # greedy: A (0.5) then EOS: 0.185
    B: [_OTHER, _OTHER, _OTHER, 0.9, 0.03, 0.04],
  }
)  # better: B (0.4) then EOS: 0.36


def _jit_beam(fn, beam_size, max_decode_len, alpha):
  """`beam_search_core` over `fn` jitted, `(init_logits [batch, 6]) -> (tokens, scores)`: one compile
  rather than one per op of the search's set-up."""
  return jax.jit(
    lambda init: beam_search_core(
      fn, init, _fake_cache(init.shape[0]), beam_size=beam_size, max_decode_len=max_decode_len, alpha=alpha
    )
  )


def test_beam_finds_hypothesis_greedy_misses():
  fn = _fake_logits_fn(TRAP)
  init = jnp.asarray(INIT[None], jnp.float32)
  g_tokens, g_score = _jit_beam(fn, beam_size=1, max_decode_len=5, alpha=0.0)(init)
  np.testing.assert_array_equal(g_tokens, [[A, EOS_ID, 0, 0, 0]])
  np.testing.assert_allclose(g_score, [np.log(0.5 * 0.37)], rtol=1e-5)
  s_tokens = jax.jit(
    lambda init: sample_core(
      fn,
      init,
      _fake_cache(1),
      source_row_keys(jax.random.key(0), jnp.ones((1, 2), jnp.int32)),
      max_decode_len=5,
      top_k=1,
    )
  )(init)
  np.testing.assert_array_equal(s_tokens, g_tokens)

  tokens, score = _jit_beam(fn, beam_size=2, max_decode_len=5, alpha=0.6)(init)
  np.testing.assert_array_equal(tokens, [[B, EOS_ID, 0, 0, 0]])
  np.testing.assert_allclose(score, [np.log(0.4 * 0.9) / (7 / 6) ** 0.6], rtol=1e-5)


def test_finished_hypothesis_beats_a_truncated_one_with_a_higher_score():
  """A hypothesis cut at max length (no EOS) is returned only when none finished: here
  `A A A A <eos>` scores (4 log 0.8 + log 0.15) / (10/6)^2 = -1.004 at alpha = 2 and
  `A A A A A`, which never ended, would score 5 log 0.8 / (10/6)^2 = -0.402."""
  #                          PAD   UNK   BOS   EOS   A    B
  init = jnp.log(jnp.array([[0.01, 0.01, 0.01, 0.07, 0.8, 0.1]], jnp.float32))
  fn = _fake_logits_fn(_table({A: [0.01, 0.01, 0.01, 0.15, 0.8, 0.02]}))  # B's row: uniform
  tokens, score = _jit_beam(fn, beam_size=2, max_decode_len=5, alpha=2.0)(init)
  np.testing.assert_array_equal(tokens, [[A, A, A, A, EOS_ID]])
  np.testing.assert_allclose(score, [(4 * np.log(0.8) + np.log(0.15)) / (10 / 6) ** 2], rtol=1e-5)
  # Beam 1 never puts EOS in its beam (A is always the most probable): nothing finished, so
  # the truncated hypothesis is the answer, as greedy search gives.
  tokens, score = _jit_beam(fn, beam_size=1, max_decode_len=5, alpha=2.0)(init)
  np.testing.assert_array_equal(tokens, [[A, A, A, A, A]])
  np.testing.assert_allclose(score, [5 * np.log(0.8) / (10 / 6) ** 2], rtol=1e-5)


def test_eos_stops_one_row_while_the_other_runs_to_max_length():
  cycle = _table({A: [1e-4, 1e-4, 1e-4, 1e-4, 0.01, 0.9], B: [1e-4, 1e-4, 1e-4, 1e-4, 0.9, 0.01]})
  init = np.stack(
    [
      np.log([1e-4, 1e-4, 1e-4, 0.9, 0.05, 0.05]),  # row 0: EOS at once
      np.log([1e-4, 1e-4, 1e-4, 1e-4, 0.9, 0.05]),
    ]
  )  # row 1: A B A B ... never EOS
  calls = []

  def fn(tokens, cache, position):
    jax.debug.callback(lambda p: calls.append(int(p)), position)
    return _fake_logits_fn(cycle)(tokens, cache, position)

  for k in (1, 3):
    calls.clear()
    tokens, scores = _jit_beam(fn, beam_size=k, max_decode_len=6, alpha=0.6)(jnp.asarray(init, jnp.float32))
    np.testing.assert_array_equal(tokens, [[EOS_ID, 0, 0, 0, 0, 0], [A, B, A, B, A, B]])
    init_lp = jax.nn.log_softmax(jnp.asarray(init), -1)
    cyc = jax.nn.log_softmax(jnp.asarray(cycle), -1)
    expect1 = (init_lp[1, A] + 3 * cyc[A, B] + 2 * cyc[B, A]) / (11 / 6) ** 0.6
    np.testing.assert_allclose(scores, [init_lp[0, EOS_ID], expect1], rtol=1e-5)
    assert calls == [1, 2, 3, 4, 5]  # max_decode_len - 1 model calls (the last token needs none), then the end

  calls.clear()  # a batch whose rows all stop early ends the loop early
  _jit_beam(fn, beam_size=3, max_decode_len=6, alpha=LENGTH_PENALTY)(jnp.asarray(init[:1], jnp.float32))
  assert calls == []  # the first token (from the prefill's logits) already finished it


# --- sampling -------------------------------------------------------------------------------


def test_sampling_top_k_one_is_greedy_and_seeds_reproduce(model_and_params, fns):
  _, params = model_and_params
  greedy, _, sample = fns
  src = _sources()
  np.testing.assert_array_equal(sample(params, src, jax.random.key(5), 1.0, 1), greedy(params, src))
  a = np.asarray(sample(params, src, jax.random.key(0), 2.0, 0))
  b = np.asarray(sample(params, src, jax.random.key(0), 2.0, 0))
  c = np.asarray(sample(params, src, jax.random.key(1), 2.0, 0))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert a.shape == (4, 12)


def test_filter_logits_top_k_top_p_and_temperature():
  logits = jnp.log(jnp.array([0.05, 0.4, 0.3, 0.15, 0.1]))
  kept = lambda x: np.flatnonzero(np.isfinite(np.asarray(x))).tolist()  # noqa: E731
  assert kept(filter_logits(logits, top_k=2)) == [1, 2]
  assert kept(filter_logits(logits, top_p=0.7)) == [1, 2]  # 0.4 + 0.3 reaches 0.7
  assert kept(filter_logits(logits, top_p=0.71)) == [1, 2, 3]
  assert kept(filter_logits(logits, top_p=1e-6)) == [1]  # top-1 always kept
  assert kept(filter_logits(logits, top_k=3, top_p=0.8)) == [1, 2]  # p over the renormalised top 3
  np.testing.assert_allclose(filter_logits(logits, temperature=2.0), logits / 2, rtol=1e-6)


# --- batch safety ---------------------------------------------------------------------------


def test_sentence_alone_equals_sentence_in_batch(model_and_params, fns):
  """A sentence decodes identically alone and between a longer and a shorter neighbour
  (more padding, another batch position), for beam search and for sampling."""
  _, params = model_and_params
  _, beam, sample = fns
  batch = _sources()  # lengths 11, 4, 7, 2: probe row 2
  alone = batch[2:3, :7]
  tokens_b, scores_b = beam[3, 0.6](params, batch)
  tokens_a, scores_a = beam[3, 0.6](params, alone)
  np.testing.assert_array_equal(tokens_b[2:3], tokens_a)
  np.testing.assert_allclose(scores_b[2:3], scores_a, rtol=1e-5)
  rng = jax.random.key(0)
  in_batch = sample(params, batch, rng, 2.0, 0)[2]
  np.testing.assert_array_equal(sample(params, alone, rng, 2.0, 0)[0], in_batch)
  moved = batch[jnp.array([2, 0, 1, 3])]  # the probe first: same draws
  np.testing.assert_array_equal(sample(params, moved, rng, 2.0, 0)[0], in_batch)


# --- factory, options and errors ------------------------------------------------------------


def test_search_options_strategy_rule():
  assert SearchOptions().strategy == "greedy"
  assert SearchOptions(beam_size=4).strategy == "beam"
  assert SearchOptions(top_p=0.9).strategy == "sample"
  assert SearchOptions(temperature=1.0).summary() == {
    "strategy": "sample",
    "extra_tokens": 50,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "seed": 0,
  }
  with pytest.raises(ValueError, match="cannot be combined with sampling"):
    SearchOptions(beam_size=4, top_k=5).validate()
  for bad in (
    dict(beam_size=0),
    dict(length_penalty=-1.0),
    dict(temperature=0.0),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(top_k=-1),
    dict(extra_tokens=-1),
  ):
    with pytest.raises(ValueError):
      SearchOptions(**bad).validate()


def test_bad_inputs_raise_one_line_errors(model_and_params):
  model, params = model_and_params
  src = _sources()
  for call, match in [
    (lambda: beam_search(model, params, src, 0, 5), "beam_size"),
    (lambda: beam_search(model, params, src, 2, MAX_LEN + 1), "max_decode_len"),
    (lambda: beam_search(model, params, src[0], 2, 5), "inputs"),
    (lambda: beam_search(model, params, src, 2, 5, alpha=-0.5), "alpha"),
    (lambda: sample_decode(model, params, src, 5, jax.random.key(0), temperature=0.0), "greedy"),
    (lambda: sample_decode(model, params, src, 5, jax.random.key(0), top_p=0.0), "top_p"),
    (lambda: sample_decode(model, params, src.astype(jnp.float32), 5, jax.random.key(0)), "integer"),
  ]:
    with pytest.raises(ValueError, match=match) as e:
      call()
    assert "\n" not in str(e.value)


def test_make_decode_fn_matches_direct_calls_on_a_mesh(model_and_params):
  _, params = model_and_params
  mesh = sh.make_mesh(MeshConfig(data=2), jax.devices()[:2])
  model = model_and_params[0]
  src = _sources()  # [4, 11]; 11 + 1 extra = 12 tokens
  limits = source_limits(src, PAD_ID, 1, MAX_LEN)  # each row: its length + 1
  np.testing.assert_array_equal(limits, [12, 5, 8, 3])
  out = make_decode_fn(model, mesh, MAX_LEN, SearchOptions(beam_size=3, extra_tokens=1))(params, src)
  assert out.shape == (4, 12)
  # The direct calls jitted: run op by op they would compile each of their hundreds of ops alone.
  beam = jax.jit(lambda p, x: beam_search(model, p, x, 3, 12, 0.6, row_limits=limits)[0])
  np.testing.assert_array_equal(out, beam(params, src))
  out = make_decode_fn(model, mesh, MAX_LEN, SearchOptions(temperature=2.0, seed=0, extra_tokens=1))(params, src)
  sample = jax.jit(lambda p, x: sample_decode(model, p, x, 12, jax.random.key(0), 2.0, row_limits=limits))
  np.testing.assert_array_equal(out, sample(params, src))
  assert default_decode_len(11, MAX_LEN) == MAX_LEN and default_decode_len(3, 100) == 53


@pytest.mark.parametrize(
  "options",
  sweep(
    [
      SearchOptions(beam_size=3, extra_tokens=1),
      SearchOptions(extra_tokens=2),
      SearchOptions(temperature=2.0, seed=0, extra_tokens=1),
    ],
    {"options1"},
    ids=["options0", "options1", "options2"],
  ),
)
def test_make_decode_fn_reuses_its_cache_memory_without_reading_it(model_and_params, options):
  """On one device the decode function donates the last call's KV cache to the next call of
  that shape: its buffers are consumed (so their memory can be reused), one shape's cache is
  kept, and whatever they hold never reaches the output, even NaN."""
  model, params = model_and_params
  decode = make_decode_fn(model, sh.make_mesh(MeshConfig(), jax.devices()[:1]), MAX_LEN, options)
  a, b = _sources(0), _sources(1, lengths=(3, 9, 5))

  def want(src):  # a fresh cache every call
    out_len = default_decode_len(src.shape[1], MAX_LEN, options.extra_tokens)
    limits = source_limits(src, PAD_ID, options.extra_tokens, MAX_LEN)
    return jax.jit(lambda p, x: decode_with(model, p, x, out_len, options, row_limits=limits))(params, src)

  want_a = want(a)
  np.testing.assert_array_equal(decode(params, a), want_a)
  ((key, kept),) = decode.workspace.items()
  garbage = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else 7), kept)
  decode.workspace[key] = garbage
  np.testing.assert_array_equal(decode(params, a), want_a)
  assert all(x.is_deleted() for x in jax.tree.leaves(garbage))  # donated
  np.testing.assert_array_equal(decode(params, b), want(b))  # another shape
  assert [k[0] for k in decode.workspace] == [b.shape]
  np.testing.assert_array_equal(decode(params, a), want_a)


@pytest.mark.parametrize(
  "options",
  sweep(
    [
      SearchOptions(extra_tokens=3),
      SearchOptions(beam_size=3, extra_tokens=3),
      SearchOptions(temperature=2.0, seed=0, extra_tokens=3),
    ],
    {"options0"},
    ids=["options0", "options1", "options2"],
  ),
)
def test_each_sentence_is_capped_at_its_own_length(model_and_params, options):
  """Section 6.1's "input length + 50" is per sentence: beside a longer source (a wider batch), a
  sentence gets exactly what decoding it alone with max_decode_len = its length + extra gives."""
  model, params = model_and_params
  decode = make_decode_fn(model, sh.make_mesh(MeshConfig(), jax.devices()[:1]), MAX_LEN, options)
  src = _sources()  # lengths 11, 4, 7, 2
  out = np.asarray(decode(params, src))
  assert out.shape == (4, 14)  # the widest source + 3
  for row, n in enumerate((11, 4, 7, 2)):
    cap = min(n + 3, MAX_LEN)
    alone_fn = jax.jit(lambda p, x, cap=cap: decode_with(model, p, x, cap, options))
    alone = np.asarray(alone_fn(params, src[row : row + 1, :n]))
    np.testing.assert_array_equal(out[row, :cap], alone[0])
    assert (out[row, cap:] == PAD_ID).all()
  assert (out[1:, :5] != PAD_ID).all() and (out[:, -1] == PAD_ID).any()  # rows ran to their caps


def test_cli_decoding_flags_pick_the_strategy():
  from jaxformer.cli import _parser
  from jaxformer.cli.args import search_options as _search_options

  parse = lambda *a: _search_options(_parser().parse_args(["translate", "--workdir", "w", *a]))  # noqa: E731
  assert parse() == SearchOptions()
  assert parse("--beam-size", "4", "--length-penalty", "1.0", "--max-length", "10").summary() == {
    "strategy": "beam",
    "extra_tokens": 10,
    "beam_size": 4,
    "length_penalty": 1.0,
  }
  assert parse("--top-p", "0.9", "--seed", "3").summary() == {
    "strategy": "sample",
    "extra_tokens": 50,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 0.9,
    "seed": 3,
  }
  with pytest.raises(ValueError, match="speculative decoding .* is greedy; drop it or the beam options"):
    parse("--beam-size", "2", "--draft-workdir", "d")
  with pytest.raises(ValueError, match="--beam-size 2 cannot be combined with --temperature/--top-k"):
    _search_options(
      _parser().parse_args(["eval", "--workdir", "w", "--beam-size", "2", "--temperature", "1", "--top-k", "3"])
    )
  with pytest.raises(ValueError, match="beam size must be"):
    parse("--beam-size", "0")
