"""The grouped beam layout of the KV cache (`layers.kv_cache.beam_attention`): beams share their
sentence's storage, a per-row origin table instead of copied keys. Checked against attention
over each row's own gathered history, and through beam search on every architecture option:
the scores it reports equal teacher-forced rescoring of its hypotheses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep

from jaxformer.config import ModelConfig
from jaxformer.inference.decode import beam_search
from jaxformer.inference.search import EOS_ID, beam_strategy, length_penalty
from jaxformer.layers import kv_cache as kvc
from jaxformer.layers.positions import alibi_bias, alibi_slopes
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.models.transformer import PAD_ID, EncoderDecoder
from jaxformer.tasks.evaluate import hypothesis_scores


@pytest.mark.parametrize(
  "cached", sweep([((4, 4, 4, 2, 2, 2),), ((12, 12, 12, 9, 9, 9),)], {"cached1"}, ids=["cached0", "cached1"])
)
def test_beam_attention_equals_attention_over_each_rows_own_history(cached):
  """Sentences of 3 beams, GQA (4 query heads, 2 key heads), causal + sliding window + ALiBi,
  storage in two segments (positions 0-9, 10-19): each row's output equals `cached_attention`
  over the keys its origin table names, gathered into a row of its own; a row that feeds PAD
  sees one key fewer. With at most 5 tokens the second segment is not read (NaN there)."""
  sentences, beams, capacity, kh, n, h = 2, 3, 20, 2, 4, 8
  rows = sentences * beams
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.standard_normal((sentences, kh, beams * capacity, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((sentences, kh, beams * capacity, h)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((rows, 1, n, h)), jnp.float32)
  lengths = jnp.asarray(cached, jnp.int32)  # tokens cached before this step
  origin = jnp.asarray(rng.integers(0, beams, (rows, capacity)), jnp.int32)
  valid = jnp.asarray([[True], [True], [False], [True], [True], [True]])
  state = kvc.CacheState(lengths=lengths, beam_origin=origin, capacity=capacity, beam_size=beams)
  state = kvc.mark_beams(state, valid[:, 0])
  bias = (alibi_bias, jnp.asarray(alibi_slopes(n)))
  opts = dict(causal=True, sliding_window=3, position_bias=bias)
  k_seg, v_seg = kvc.split_segments(k, beams), kvc.split_segments(v, beams)
  assert [x.shape[2] for x in k_seg] == [beams * 10, beams * 10]
  if max(cached) < 10:
    k_seg, v_seg = (k_seg[0], k_seg[1] * jnp.nan), (v_seg[0], v_seg[1] * jnp.nan)
  got = kvc.beam_attention(q, k_seg, v_seg, state, valid, **opts)

  slot = np.asarray(state.beam_origin) * capacity + np.arange(capacity)[None]  # [rows, S]
  sentence = np.arange(rows) // beams
  own_k = jnp.asarray(np.asarray(k)[sentence[:, None], :, slot].transpose(0, 2, 1, 3))  # [rows, kh, S, h]
  own_v = jnp.asarray(np.asarray(v)[sentence[:, None], :, slot].transpose(0, 2, 1, 3))
  want = kvc.cached_attention(q, (own_k,), (own_v,), lengths[:, None], lengths + valid[:, 0], **opts)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  # the step's own key comes from the row's own slot
  np.testing.assert_array_equal(
    np.asarray(state.beam_origin)[np.arange(rows), lengths], [0, 1, origin[2, cached[2]], 0, 1, 2]
  )


V = 29
BASE = ModelConfig(
  vocab_size=V,
  d_model=16,
  num_heads=4,
  d_ff=24,
  num_encoder_layers=1,
  num_decoder_layers=2,
  dropout_rate=0.0,
  pre_norm=True,
  max_length=24,
)
DECODER_CASES = {
  "rope-mqa-window3": dict(position="rope", num_kv_heads=1, sliding_window=3),
  "alibi-global-tokens": dict(position="alibi", sliding_window=2, global_tokens=1),
  "t5-gqa": dict(position="t5", num_kv_heads=2),
  "learned-softcap-untied": dict(position="learned", attn_logit_softcap=4.0, tie_embeddings=False),
  "scan-remat": dict(scan_layers=True, remat="full", position="rope"),
}


def _init(model, *inputs):
  return jax.jit(lambda key: model.init(key, *inputs)["params"])(jax.random.key(0))


def _lm_rescore(model, params, prompts, prompt_lengths, tokens, alpha):
  """Teacher-forced `sum log p(y_t) / lp(|Y|)` of each hypothesis after its own prompt."""
  rows, out_len = tokens.shape
  seqs = np.zeros((rows, prompts.shape[1] + out_len), np.int32)
  lengths = []
  for r in range(rows):
    hyp = np.asarray(tokens[r])
    n = int(np.flatnonzero(hyp == EOS_ID)[0]) + 1 if (hyp == EOS_ID).any() else out_len
    seqs[r, : prompt_lengths[r] + n] = np.concatenate([prompts[r, : prompt_lengths[r]], hyp[:n]])
    lengths.append(n)
  logits = model.apply({"params": params}, jnp.asarray(seqs)).at[..., PAD_ID].set(-jnp.inf)
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  return np.array(
    [
      sum(logp[r, prompt_lengths[r] - 1 + t, seqs[r, prompt_lengths[r] + t]] for t in range(n))
      / float(length_penalty(n, alpha))
      for r, n in enumerate(lengths)
    ]
  )


FAST_CASES = ("rope-mqa-window3",)  # the rest run with the slow tests


@pytest.mark.parametrize(
  "options",
  [
    pytest.param(options, id=name, marks=() if name in FAST_CASES else pytest.mark.slow)
    for name, options in DECODER_CASES.items()
  ],
)
def test_decoder_only_beam_scores_equal_teacher_forcing(options):
  """Prompts of different lengths (PAD padded), beam 3: each returned hypothesis's reported
  score is its teacher-forced score, which fails if any beam attended to another's keys."""
  model = DecoderOnly(dataclasses.replace(BASE, **options))
  prompt_lengths = [5, 2, 7]
  rng = np.random.default_rng(1)
  prompts = rng.integers(4, V, (3, 7)).astype(np.int32)
  prompts[np.arange(7)[None] >= np.array(prompt_lengths)[:, None]] = PAD_ID
  params = _init(model, jnp.asarray(prompts))
  tokens, scores = jax.jit(lambda p, x: beam_search(model, p, x, 3, 9, 0.6))(params, jnp.asarray(prompts))
  want = _lm_rescore(model, params, prompts, prompt_lengths, np.asarray(tokens), 0.6)
  np.testing.assert_allclose(scores, want, atol=1e-4, rtol=0)


def test_encoder_decoder_gqa_rope_beam_scores_equal_teacher_forcing():
  model = EncoderDecoder(dataclasses.replace(BASE, position="rope", num_kv_heads=2, pre_norm=False))
  rng = np.random.default_rng(2)
  src = rng.integers(4, V, (3, 6)).astype(np.int32)
  src[1, 3:] = PAD_ID
  src = jnp.asarray(src)
  params = _init(model, src, src)
  tokens, scores = jax.jit(lambda p, x: beam_search(model, p, x, 4, 10, 0.6))(params, src)
  want = jax.jit(lambda p, x, t: hypothesis_scores(model, p, x, t, 0.6))(params, src, tokens)
  np.testing.assert_allclose(scores, want, atol=1e-4, rtol=0)


def test_every_live_beam_feeds_a_token_with_more_beams_than_finite_candidates():
  """Two finite tokens and 4 beams: beam search fills two beams with -inf candidates (whose
  token is PAD, the lowest -inf id). They still feed a token, so the beams of a sentence stay
  the same length, which the grouped cache needs; a finished sentence feeds PAD."""
  logits = np.full((2, 12), -np.inf, np.float32)
  logits[:, [5, 9]] = [1.0, 2.0]
  strategy = beam_strategy(4, 6)
  state = strategy.init(jnp.asarray(logits))
  state = state._replace(done=jnp.array([False, True]))
  _, tokens, _ = strategy.step(state, jnp.asarray(np.repeat(logits, 4, axis=0)), 0)
  tokens = np.asarray(tokens).reshape(2, 4)
  assert (tokens[0] != PAD_ID).all() and sorted(tokens[0][:2]) == [5, 9]
  np.testing.assert_array_equal(tokens[1], [PAD_ID] * 4)
