"""Speculative greedy decoding (`jaxformer.inference.speculative`): the output is the target's
greedy output token for token, whatever the draft proposes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import sharding as sh
from jaxformer.config import MeshConfig, ModelConfig
from jaxformer.inference.decode import Draft, SearchOptions, greedy_decode, make_decode_fn
from jaxformer.inference.speculative import speculative_greedy
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.models.transformer import PAD_ID, EncoderDecoder

VOCAB, OUT_LEN = 37, 14
BASE = dict(
  vocab_size=VOCAB,
  d_model=32,
  num_heads=4,
  d_ff=48,
  num_encoder_layers=1,
  num_decoder_layers=2,
  dropout_rate=0.0,
  max_length=40,
)


def _models(kind):
  """(target, its params, draft, its params): the draft is smaller and differently initialised."""
  if kind == "encoder_decoder":
    target = EncoderDecoder(ModelConfig(**BASE))
    draft = EncoderDecoder(ModelConfig(**{**BASE, "d_model": 16, "num_heads": 2, "num_decoder_layers": 1}))
  else:
    target = DecoderOnly(ModelConfig(**BASE, kind="decoder_only", position="rope", num_kv_heads=2))
    draft = DecoderOnly(ModelConfig(**{**BASE, "d_model": 16, "num_heads": 2}, kind="decoder_only"))
  x = jnp.ones((1, 4), jnp.int32)
  return (
    target,
    jax.jit(target.init)(jax.random.key(0), x, x)["params"],
    draft,
    jax.jit(draft.init)(jax.random.key(1), x, x)["params"],
  )


def _inputs():
  src = np.random.default_rng(0).integers(4, VOCAB, (4, 7))
  src[1, 4:] = PAD_ID
  src[3, 2:] = PAD_ID
  return jnp.asarray(src, jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["encoder_decoder", "decoder_only"])
def test_output_is_the_targets_greedy_output(kind):
  target, tp, draft, dp = _models(kind)
  src = _inputs()
  greedy = jax.jit(lambda p, x, e: greedy_decode(target, p, x, OUT_LEN, eos_id=e), static_argnums=2)
  plain = np.asarray(greedy(tp, src, -1))
  # An EOS the target emits mid-row in some rows: those rows must stop there.
  eos = int(plain[0, 5])
  with_eos = np.asarray(greedy(tp, src, eos))
  assert (with_eos == PAD_ID).any()
  for d, p, k, same in ((draft, dp, 1, False), (draft, dp, 3, False), (target, tp, 3, True)):
    run = jax.jit(lambda a, b, s, e, d=d, k=k: speculative_greedy(target, a, d, b, s, OUT_LEN, k, e))
    for e, expected in ((-1, plain), (eos, with_eos)):
      tokens, accepted, rounds = run(tp, p, src, e)
      np.testing.assert_array_equal(tokens, expected)
    tokens, accepted, rounds = map(np.asarray, run(tp, p, src, -1))
    if same:  # the target as its own draft: every proposal is kept, k + 1 tokens per round
      np.testing.assert_array_equal(accepted, k * rounds)
      assert (rounds == -(-(OUT_LEN - 1) // (k + 1))).all()
    else:
      assert (accepted <= k * rounds).all() and (rounds >= 1).all()


def test_make_decode_fn_with_a_draft_reports_acceptance_and_refuses_beam_search():
  target, tp, draft, dp = _models("encoder_decoder")
  mesh = sh.make_mesh(MeshConfig(data=2), jax.devices()[:2])
  plain = make_decode_fn(target, mesh, BASE["max_length"], SearchOptions(extra_tokens=6))
  fast = make_decode_fn(target, mesh, BASE["max_length"], SearchOptions(extra_tokens=6), Draft(target, tp, 3))
  src = _inputs()
  np.testing.assert_array_equal(fast(tp, src), plain(tp, src))
  ((accepted, proposed),) = fast.speculation
  assert accepted == proposed > 0  # the target as its own draft
  with pytest.raises(ValueError, match="speculative decoding .* is greedy"):
    make_decode_fn(target, mesh, BASE["max_length"], SearchOptions(beam_size=4), Draft(draft, dp))


def test_num_draft_tokens_must_be_positive():
  target, tp, draft, dp = _models("decoder_only")
  with pytest.raises(ValueError, match="propose >= 1 token"):
    speculative_greedy(target, tp, draft, dp, _inputs(), 4, 0)
