"""Int8 weight-only quantization (jaxformer/inference/quantize.py): hand-checked per-channel
scales, the half-step round-trip bound, int8 storage size, and logits close to float32
for the unrolled and the scanned tiny model."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import load_config
from jaxformer.inference.quantize import QuantizedArray, dequantize_params, quantize_params, weight_bytes
from jaxformer.models.transformer import PAD_ID
from jaxformer.tasks import get_task


def _model_and_params(path, overrides=(), abstract=False):
  model = get_task(load_config(path, list(overrides))).make_model()
  ids = jnp.ones((1, 8), jnp.int32)
  init = lambda key: nn.meta.unbox(model.init(key, ids, ids)["params"])  # noqa: E731
  return model, (jax.eval_shape(init, jax.random.key(0)) if abstract else init(jax.random.key(0)))


def _tokens(seed, shape, vocab):
  ids = np.random.default_rng(seed).integers(4, vocab, shape).astype(np.int32)
  ids[1, shape[1] // 2:] = PAD_ID
  return jnp.asarray(ids)


def test_scales_per_output_channel_by_hand():
  wi = np.array([[1.0, -0.5, 0.0],
                 [-2.54, 0.1, 0.0]], np.float32)            # [d_model=2, d_ff=3]
  out = np.array([[[1.27, -0.21]], [[-0.64, 0.4]]], np.float32)  # [heads=2, head_dim=1, d_model=2]
  embedding = np.array([[0.3, -1.27], [0.5, 0.2]], np.float32)  # [vocab=2, d_model=2]
  query = np.array([[[[1.27, 0.1]], [[0.2, -2.54]]],
                    [[[0.0, 0.5]], [[-0.127, 0.0]]]], np.float32)  # [layers=2, d_model=2, heads=1, head_dim=2]
  params = {"ffn": {"wi": wi, "bi": np.ones(3, np.float32)}, "attn": {"out": out}, "embed": {"embedding": embedding},
            "decoder": {"attn": {"query": query}, "norm": {"scale": np.ones((2, 7), np.float32)}}}
  q = quantize_params(jax.tree.map(jnp.asarray, params), min_size=1)

  # FFN kernel: one scale per column (d_ff); an all-zero column gets scale 0 and values 0.
  np.testing.assert_allclose(q["ffn"]["wi"].scale, [[0.02, 0.5 / 127, 0.0]], rtol=1e-6)
  np.testing.assert_array_equal(q["ffn"]["wi"].values, [[50, -127, 0], [-127, 25, 0]])
  # Attention output [heads, head_dim, d_model]: one scale per d_model column.
  np.testing.assert_allclose(q["attn"]["out"].scale, [[[0.01, 0.4 / 127]]], rtol=1e-6)
  np.testing.assert_array_equal(q["attn"]["out"].values, [[[127, -67]], [[-64, 127]]])
  # Embedding table: one scale per row (vocab entry).
  np.testing.assert_allclose(q["embed"]["embedding"].scale, [[0.01], [0.5 / 127]], rtol=1e-6)
  np.testing.assert_array_equal(q["embed"]["embedding"].values, [[30, -127], [127, 51]])
  # Stacked [layers, d_model, heads, head_dim]: per layer and per (head, head_dim).
  np.testing.assert_allclose(q["decoder"]["attn"]["query"].scale, [[[[0.01, 0.02]]], [[[0.001, 0.5 / 127]]]],
                             rtol=1e-6)
  np.testing.assert_array_equal(q["decoder"]["attn"]["query"].values,
                                [[[[127, 5]], [[20, -127]]], [[[0, 127]], [[-127, 0]]]])
  # Vectors stay float, also stacked ones ([layers, d_model] norm scales).
  assert q["ffn"]["bi"].dtype == jnp.float32 and q["decoder"]["norm"]["scale"].dtype == jnp.float32
  # A kernel of another name is read as [..., in, out]: scales per column.
  other = quantize_params({"moe": {"w": jnp.asarray(wi)}}, min_size=1)["moe"]["w"]
  np.testing.assert_allclose(other.scale, [[0.02, 0.5 / 127, 0.0]], rtol=1e-6)


def test_round_trip_within_half_a_step():
  _, params = _model_and_params("configs/tiny.yaml")
  q = quantize_params(params)
  back = dequantize_params(q)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  nodes = jax.tree.leaves(q, is_leaf=lambda x: isinstance(x, QuantizedArray))
  quantized = 0
  for (path, w), w_back, node in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(back), nodes):
    assert w_back.shape == w.shape and w_back.dtype == w.dtype, jax.tree_util.keystr(path)
    if isinstance(node, QuantizedArray):
      quantized += 1
      assert node.values.dtype == jnp.int8 and node.scale.dtype == jnp.float32
      err = np.abs(np.asarray(w) - np.asarray(w_back))
      assert np.all(err <= np.asarray(node.scale) * (0.5 + 1e-5) + 1e-9), jax.tree_util.keystr(path)
    else:  # norm scales and biases come back untouched
      assert w.ndim == 1
      np.testing.assert_array_equal(w, w_back)
  # The shared embedding and, per layer, 4 attention kernels (8 in a decoder layer) and 2 FFN kernels.
  assert quantized == 1 + 2 * (4 + 2) + 2 * (8 + 2)
  bf16 = dequantize_params(q, jnp.bfloat16)
  assert bf16["embed"]["embedding"].dtype == jnp.bfloat16
  assert bf16["encoder_0"]["ffn"]["bi"].dtype == jnp.float32


def test_int8_storage_is_about_four_times_smaller():
  _, abstract = _model_and_params("configs/multi30k_small.yaml", abstract=True)
  quantized = jax.eval_shape(quantize_params, abstract)
  assert sum(x.size for x in jax.tree.leaves(abstract)) > 7_000_000
  assert weight_bytes(abstract) >= 3.5 * weight_bytes(quantized)


@pytest.mark.parametrize("scan", [False, True])
def test_dequantized_logits_match_float32(scan):
  model, params = _model_and_params("configs/tiny.yaml", [f"model.scan_layers={str(scan).lower()}"])
  vocab = model.config.vocab_size
  inputs, targets = _tokens(0, (4, 13), vocab), _tokens(1, (4, 11), vocab)
  q = jax.device_put(quantize_params(params))
  assert jax.tree.structure(q) == jax.tree.structure(quantize_params(params))
  if scan:  # stacked kernels are scaled per layer
    assert q["decoder"]["self_attention"]["query"].scale.shape == (2, 1, 8, 8)
  expected = model.apply({"params": params}, inputs, targets)
  # The intended use: the int8 tree is the jitted function's argument, dequantised inside.
  got = jax.jit(lambda qp, x, y: model.apply({"params": dequantize_params(qp)}, x, y))(q, inputs, targets)
  valid = np.asarray(targets != PAD_ID)
  agree = np.mean(np.argmax(got, -1)[valid] == np.argmax(expected, -1)[valid])
  diff = np.max(np.abs(np.asarray(got) - np.asarray(expected)))
  assert agree >= 0.95, agree
  assert diff <= 0.02 * np.max(np.abs(np.asarray(expected))), diff


def test_unsupported_input():
  with pytest.raises(ValueError, match="no float kernel"):
    quantize_params({"norm": {"scale": jnp.ones(8), "bias": jnp.zeros(8)}})
  with pytest.raises(ValueError, match="no float kernel"):
    quantize_params({"ffn": {"wi": jnp.ones((4, 4))}})  # below the default min_size
  q = quantize_params({"ffn": {"wi": jnp.ones((4, 4))}}, min_size=1)
  with pytest.raises(ValueError, match="already quantized"):
    quantize_params(q, min_size=1)
