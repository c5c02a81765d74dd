"""Packing leaves the loss per real token unchanged: the train step's loss sums over a packed
batch equal those over the same examples unpacked (fp32, label smoothing and z-loss on)."""

import jax
import numpy as np
import pytest
from test_packing_models import _random_params

from jaxformer import data as D
from jaxformer.config import config_from_dict
from jaxformer.tasks import get_task
from jaxformer.tasks.objective import loss_fn

MODEL = {
  "vocab_size": 41,
  "d_model": 16,
  "num_heads": 2,
  "d_ff": 24,
  "num_encoder_layers": 2,
  "num_decoder_layers": 2,
  "dropout_rate": 0.0,
  "max_length": 64,
}


def _sums(config, batch):
  task = get_task(config)
  model = task.make_model()
  params = _random_params(model, batch["inputs"][:1], batch["targets"][:1])
  batch = {k: jax.numpy.asarray(v) for k, v in batch.items()}
  sums = jax.jit(lambda p, b: loss_fn(task, model, p, b, None, 0.1, 1e-3)[1])(params, batch)
  return {k: float(v) for k, v in sums.items()}


def _ids(rng, n):
  return np.append(rng.integers(4, 41, n - 1), D.EOS_ID).astype(np.int32)


@pytest.mark.parametrize("position", ["sinusoidal", "rope"])
def test_translation_loss_is_the_same_packed_and_unpacked(position):
  rng = np.random.default_rng(0)
  src = [_ids(rng, n) for n in (5, 7, 3, 9)]
  tgt = [_ids(rng, n) for n in (6, 4, 8, 5)]
  config = config_from_dict({"model": {**MODEL, "position": position}})
  packed = D.pack_rows([src[:3], src[3:]], [tgt[:3], tgt[3:]], 20)
  unpacked = D.pack_rows([[s] for s in src], [[t] for t in tgt], 20)
  a = _sums(config, packed)
  b = _sums(config, {k: unpacked[k] for k in ("inputs", "targets")})
  assert a["num_tokens"] == b["num_tokens"] == 23
  for key in ("loss", "nll", "correct"):
    assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5)


def test_causal_lm_loss_is_the_same_packed_and_unpacked():
  rng = np.random.default_rng(1)
  docs = [rng.integers(4, 41, n).astype(np.int32) for n in (5, 8, 3)]
  stream = D.ArrayStream(np.concatenate(docs))
  stream.doc_starts = np.cumsum([0, 5, 8])
  config = config_from_dict(
    {"model": {**MODEL, "kind": "decoder_only", "position": "alibi"}, "data": {"max_length": 15, "packing": True}}
  )
  packed = D.window_eval_batches(stream, 1, 15, packing=True)[0]  # one row: the three documents
  alone = [D.window_eval_batches(d, 1, 15)[0] for d in docs]  # each document in its own row
  unpacked = {k: np.concatenate([b[k] for b in alone]) for k in ("inputs", "targets")}
  a, b = _sums(config, packed), _sums(config, unpacked)
  assert a["num_tokens"] == b["num_tokens"] == 4 + 7 + 2
  for key in ("loss", "nll", "correct"):
    assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5)
