"""Int8 quantization (jaxformer/inference/quantize.py, jaxformer/layers/int8.py): hand-checked
per-channel scales, the half-step round-trip bound, int8 storage size, logits close to float32
for the unrolled and the scanned tiny model (dequantized, and through the layers' int8 x int8
products), a hand-computed int8 product, which kernels decoding keeps in int8, and greedy
decoding with int8 products against float32."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep

from jaxformer.config import load_config
from jaxformer.inference import quantize
from jaxformer.inference.decode import greedy_decode
from jaxformer.inference.quantize import (
  QuantizedArray,
  decoding_params,
  dequantize_params,
  quantize_params,
  weight_bytes,
)
from jaxformer.layers import int8
from jaxformer.models.transformer import PAD_ID
from jaxformer.tasks import get_task


def _model_and_params(path, overrides=(), abstract=False):
  model = get_task(load_config(path, list(overrides))).make_model()
  ids = jnp.ones((1, 8), jnp.int32)
  init = lambda key: nn.meta.unbox(model.init(key, ids, ids)["params"])  # noqa: E731
  return model, (jax.eval_shape(init, jax.random.key(0)) if abstract else init(jax.random.key(0)))


def _tokens(seed, shape, vocab):
  ids = np.random.default_rng(seed).integers(4, vocab, shape).astype(np.int32)
  ids[1, shape[1] // 2 :] = PAD_ID
  return jnp.asarray(ids)


def _assert_close_logits(got, expected, targets, tolerance):
  """The argmax agrees at >= 95% of the non-pad targets, and no logit is off by more than
  `tolerance` times the largest |expected| logit."""
  valid = np.asarray(targets != PAD_ID)
  agree = np.mean(np.argmax(got, -1)[valid] == np.argmax(expected, -1)[valid])
  diff = np.max(np.abs(np.asarray(got) - np.asarray(expected)))
  assert agree >= 0.95, agree
  assert diff <= tolerance * np.max(np.abs(np.asarray(expected))), diff


def test_scales_per_output_channel_by_hand():
  wi = np.array([[1.0, -0.5, 0.0], [-2.54, 0.1, 0.0]], np.float32)  # [d_model=2, d_ff=3]
  out = np.array([[[1.27, -0.21]], [[-0.64, 0.4]]], np.float32)  # [heads=2, head_dim=1, d_model=2]
  embedding = np.array([[0.3, -1.27], [0.5, 0.2]], np.float32)  # [vocab=2, d_model=2]
  query = np.array(
    [[[[1.27, 0.1]], [[0.2, -2.54]]], [[[0.0, 0.5]], [[-0.127, 0.0]]]], np.float32
  )  # [layers=2, d_model=2, heads=1, head_dim=2]
  params = {
    "ffn": {"wi": wi, "bi": np.ones(3, np.float32)},
    "attn": {"out": out},
    "embed": {"embedding": embedding},
    "decoder": {"attn": {"query": query}, "norm": {"scale": np.ones((2, 7), np.float32)}},
  }
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
  np.testing.assert_allclose(q["decoder"]["attn"]["query"].scale, [[[[0.01, 0.02]]], [[[0.001, 0.5 / 127]]]], rtol=1e-6)
  np.testing.assert_array_equal(
    q["decoder"]["attn"]["query"].values, [[[[127, 5]], [[20, -127]]], [[[0, 127]], [[-127, 0]]]]
  )
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


@pytest.mark.parametrize("scan", sweep([False, True], {"True"}))
def test_dequantized_logits_match_float32(scan):
  model, params = _model_and_params("configs/tiny.yaml", [f"model.scan_layers={str(scan).lower()}"])
  vocab = model.config.vocab_size
  inputs, targets = _tokens(0, (4, 13), vocab), _tokens(1, (4, 11), vocab)
  q = jax.device_put(jax.jit(quantize_params)(params))
  assert jax.tree.structure(q) == jax.tree.structure(jax.eval_shape(quantize_params, params))
  if scan:  # stacked kernels are scaled per layer
    assert q["decoder"]["self_attention"]["query"].scale.shape == (2, 1, 8, 8)
  expected = jax.jit(lambda p, x, y: model.apply({"params": p}, x, y))(params, inputs, targets)
  # The intended use: the int8 tree is the jitted function's argument, dequantised inside.
  got = jax.jit(lambda qp, x, y: model.apply({"params": dequantize_params(qp)}, x, y))(q, inputs, targets)
  _assert_close_logits(got, expected, targets, 0.02)


def test_int8_product_by_hand():
  x = jnp.asarray([[1.27, -0.635], [0.0, 0.0], [0.1, 0.254]], jnp.float32)  # [rows=3, k=2]
  w = QuantizedArray(values=jnp.asarray([[100, -127], [50, 10]], jnp.int8), scale=jnp.asarray([[0.5, 0.25]]))
  # Row scales 0.01, 0 (an all-zero row), 0.002: x quantizes to [[127, -64], [0, 0], [50, 127]].
  xq, x_scale = int8.quantize_rows(x)
  np.testing.assert_array_equal(xq, [[127, -64], [0, 0], [50, 127]])
  np.testing.assert_allclose(x_scale[:, 0], [0.01, 0.0, 0.002], rtol=1e-6)
  acc = np.array([[127 * 100 - 64 * 50, -127 * 127 - 64 * 10], [0, 0], [50 * 100 + 127 * 50, -50 * 127 + 127 * 10]])
  expected = acc * np.array([[0.01], [0.0], [0.002]]) * np.array([[0.5, 0.25]])
  np.testing.assert_allclose(int8.matmul(x, w), expected, rtol=1e-6)
  # The tied output layer: a [n, d] table scaled per row, x times its transpose.
  table = QuantizedArray(values=w.values.T, scale=w.scale.T)
  np.testing.assert_allclose(int8.matmul_rows(x, table), expected, rtol=1e-6)
  # A row lookup dequantizes the rows it reads.
  np.testing.assert_allclose(int8.take_rows(table, jnp.asarray([[1, 0]])), [[[-31.75, 2.5], [50.0, 25.0]]], rtol=1e-6)


def test_int8_products_only_with_ynnpack_dots(monkeypatch):
  for flags, expected in (
    ("", True),
    ("--xla_cpu_use_xnnpack=false", True),
    ("--xla_cpu_max_isa=AVX2 --xla_cpu_experimental_ynn_fusion_type=", False),
    ("--xla_cpu_experimental_ynn_fusion_type=individual_dot,eltwise", True),
  ):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert quantize.int8_products() is expected, flags
  q = quantize_params({"ffn": {"wi": jnp.ones((4, 4))}}, min_size=1)
  assert isinstance(decoding_params(q)["ffn"]["wi"], QuantizedArray)
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")  # dequantized where int8 dots are slow
  np.testing.assert_array_equal(decoding_params(q)["ffn"]["wi"], np.ones((4, 4)))


@pytest.fixture
def int8_dots(monkeypatch):
  """Decoding keeps int8 kernels whatever XLA_FLAGS the tests run with."""
  monkeypatch.setattr(quantize, "int8_products", lambda: True)


def test_decoding_keeps_the_layers_int8_kernels(int8_dots):
  e, d, f = 2, 4, 3
  params = {
    "layer_0": {
      "attention": {"query": np.ones((d, 2, 2)), "out": np.ones((2, 2, d))},
      "ffn": {"wi": np.ones((d, f))},
      "moe": {"wi": np.ones((e, d, f)), "router": np.ones((d, e))},
    },
    "embed": {"embedding": np.ones((7, d))},
    "relative_bias": {"table": np.ones((5, 2))},
  }
  q = quantize_params(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params), min_size=1)
  got = decoding_params(q)
  layer = got["layer_0"]
  for kernel in (layer["attention"]["query"], layer["attention"]["out"], layer["ffn"]["wi"], got["embed"]["embedding"]):
    assert isinstance(kernel, QuantizedArray)
  # A mixture of experts' [experts, d, f] kernel and a kernel of another name go to the model in float.
  for leaf in (layer["moe"]["wi"], got["relative_bias"]["table"]):
    assert not isinstance(leaf, QuantizedArray) and leaf.dtype == jnp.float32
  np.testing.assert_allclose(layer["moe"]["wi"], params["layer_0"]["moe"]["wi"], rtol=1e-6)


@pytest.mark.parametrize("scan", sweep([False, True], {"True"}))
def test_int8_products_match_float32(scan, int8_dots):
  # Activations quantized per row add their own rounding to the weights': a looser bound than dequantized.
  model, params = _model_and_params("configs/tiny.yaml", [f"model.scan_layers={str(scan).lower()}"])
  vocab = model.config.vocab_size
  inputs, targets = _tokens(0, (4, 13), vocab), _tokens(1, (4, 11), vocab)
  q = quantize_params(params, min_size=1)
  expected = model.apply({"params": params}, inputs, targets)
  got = jax.jit(lambda qp, x, y: model.apply({"params": decoding_params(qp)}, x, y))(q, inputs, targets)
  _assert_close_logits(got, expected, targets, 0.03)


def test_int8_greedy_decoding_agrees_with_float32(int8_dots):
  model, params = _model_and_params("configs/tiny.yaml")
  inputs = _tokens(2, (8, 12), model.config.vocab_size)
  decode = jax.jit(lambda p, x: greedy_decode(model, p, x, 16))
  expected = np.asarray(decode(params, inputs))
  got = np.asarray(decode(quantize_params(params, min_size=1), inputs))
  assert got.shape == expected.shape == (8, 16)
  assert np.mean(got == expected) >= 0.9, np.mean(got == expected)


def test_unsupported_input():
  with pytest.raises(ValueError, match="no float kernel"):
    quantize_params({"norm": {"scale": jnp.ones(8), "bias": jnp.zeros(8)}})
  with pytest.raises(ValueError, match="no float kernel"):
    quantize_params({"ffn": {"wi": jnp.ones((4, 4))}})  # below the default min_size
  q = quantize_params({"ffn": {"wi": jnp.ones((4, 4))}}, min_size=1)
  with pytest.raises(ValueError, match="already quantized"):
    quantize_params(q, min_size=1)
