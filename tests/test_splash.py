"""`model.attention=splash`: JAX's splash-attention Pallas kernels (Pallas interpret mode on this
CPU) against our dense attention, outputs and gradients in float32, on every real query; the
model with it against the model with dense attention, sharded; and the train step compiled by the
TPU compiler with the Mosaic kernels in it."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY

from jaxformer import sharding as sh
from jaxformer.aot import train_step as aot
from jaxformer.config import ConfigError, load_config
from jaxformer.layers.dot_product import AttentionOptions, dot_product_attention
from jaxformer.layers.dot_product import attention as dispatch
from jaxformer.layers.scores import attention_mask
from jaxformer.layers.splash import splash_attention
from jaxformer.runtime.startup import build_mesh
from jaxformer.tasks import get_task

B, N, H = 2, 4, 8


def _valid(lengths, size):
  return jnp.arange(size)[None] < jnp.asarray(lengths)[:, None]


def _packed(t):
  """Two rows of packed examples: segment ids (0 on padding) and positions restarting per example."""
  ids = np.zeros((B, t), np.int32)
  ids[0, : t // 2], ids[0, t // 2 : t - 3] = 1, 2
  ids[1, :5], ids[1, 5 : t - 7], ids[1, t - 7 :] = 1, 2, 3
  starts = np.array([[np.argmax(row == s) for s in row] for row in ids])
  return jnp.asarray(ids), jnp.asarray(np.arange(t)[None] - starts), jnp.asarray(ids > 0)


def _compare(
  q,
  k,
  v,
  q_valid,
  kv_valid,
  q_seg=None,
  kv_seg=None,
  q_pos=None,
  kv_pos=None,
  *,
  causal,
  window=0,
  softcap=0.0,
  block=128,
):
  t, s = q.shape[1], k.shape[1]
  q_pos = jnp.arange(t)[None] if q_pos is None else q_pos
  kv_pos = jnp.arange(s)[None] if kv_pos is None else kv_pos
  mask = attention_mask(q_pos, kv_pos, q_valid, kv_valid, causal, window, q_seg, kv_seg)
  weight = jax.random.normal(jax.random.key(9), q.shape) * (q_valid if q_valid is not None else 1)[:, :, None, None]

  def dense(q, k, v):
    return dot_product_attention(q, k, v, mask, softcap=softcap)

  def splash(q, k, v):
    return splash_attention(
      q, k, v, q_valid, kv_valid, q_seg, kv_seg, causal=causal, sliding_window=window, softcap=softcap, block_size=block
    )

  outs, grads = [], []
  for fn in (dense, splash):
    out, vjp = jax.vjp(fn, q, k, v)
    outs.append(out * (weight != 0))  # real queries only
    grads.append(vjp(weight))
  np.testing.assert_allclose(outs[1], outs[0], atol=1e-5, rtol=1e-5)
  for got, want in zip(grads[1], grads[0]):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _qkv(t, s, kv_heads, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (
    jax.random.normal(keys[0], (B, t, N, H)),
    jax.random.normal(keys[1], (B, s, kv_heads, H)),
    jax.random.normal(keys[2], (B, s, kv_heads, H)),
  )


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [N, 2, 1], ids=["mha", "gqa", "mqa"])
def test_causal_self_attention_with_padding_equals_dense(kv_heads):
  q, k, v = _qkv(256, 256, kv_heads)  # 2 x 2 blocks: the kernels skip the one above the diagonal
  valid = _valid([256, 150], 256)
  _compare(q, k, v, valid, valid, causal=True)


def test_packed_segments_with_positions_equal_dense():
  q, k, v = _qkv(128, 128, 2, seed=1)
  ids, positions, valid = _packed(128)
  _compare(q, k, v, valid, valid, ids, ids, positions, positions, causal=True)


def test_a_kernel_built_in_one_trace_is_not_reused_by_the_next():
  """Each trace builds its own kernels: one kept from an earlier trace (here `eval_shape`'s) held
  that trace's mask arrays, and the next trace failed with an escaped tracer."""
  q, k, v = _qkv(128, 128, 2, seed=2)
  valid = _valid([128, 90], 128)

  def splash(q, k, v):
    return splash_attention(q, k, v, valid, valid, causal=True)

  assert jax.eval_shape(splash, q, k, v).shape == q.shape
  mask = attention_mask(jnp.arange(128)[None], jnp.arange(128)[None], valid, valid, True, 0)
  want = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask))(q, k, v)
  real = valid[:, :, None, None]
  # A new trace (not eval_shape's), through the dispatcher a model's attention layer calls.
  opts = AttentionOptions(
    implementation="splash",
    causal=True,
    sliding_window=0,
    global_tokens=0,
    softcap=0.0,
    block_size=128,
    bias_fn=None,
    causal_by_index=False,
    dropout_rate=0.0,
  )
  got, _ = jax.jit(lambda q, k, v: dispatch(opts, (q, k, v, None, None, valid, valid, None, None), None))(q, k, v)
  np.testing.assert_allclose(jnp.where(real, got, 0), jnp.where(real, want, 0), atol=1e-5)


@pytest.mark.slow
def test_cross_attention_over_a_padded_source_equals_dense():
  q, k, v = _qkv(128, 256, N, seed=2)
  _compare(q, k, v, _valid([128, 77], 128), _valid([256, 130], 256), causal=False)


@pytest.mark.slow
@pytest.mark.parametrize("window, softcap", [(8, 0.0), (0, 5.0)], ids=["sliding_window", "softcap"])
def test_sliding_window_and_softcap_equal_dense(window, softcap):
  q, k, v = _qkv(128, 128, 2, seed=3)
  valid = _valid([128, 100], 128)
  _compare(q * 3, k, v, valid, valid, causal=True, window=window, softcap=softcap)


@pytest.mark.slow
def test_lengths_off_the_blocks_are_padded_and_masked():
  """Lengths of 40 and 72 tokens: the kernels run on 128, the padding masked out."""
  q, k, v = _qkv(40, 72, 2, seed=5)
  _compare(q, k, v, _valid([40, 33], 40), _valid([72, 50], 72), causal=False)


def test_a_block_off_the_lanes_is_one_line():
  q, k, v = _qkv(128, 128, N)
  with pytest.raises(ValueError, match=r"needs model.attention_block_size to be a multiple of 128, got 96"):
    splash_attention(q, k, v, None, None, causal=True, block_size=96)


@pytest.mark.parametrize("override", ["model.position=alibi", "model.attention_dropout_rate=0.1"])
def test_options_splash_cannot_take_are_refused(override):
  with pytest.raises(ConfigError, match="model.attention="):
    load_config(TINY, ["model.attention=splash", "model.attention_dropout_rate=0", override])


@pytest.mark.slow
def test_sharded_model_with_splash_equals_dense():
  """A packed decoder-only batch on data=2 x tensor=2: the kernels run per device (shard_map) on its rows and
  heads; logits and parameter gradients match dense attention's."""
  base = [
    "model.kind=decoder_only",
    "model.num_decoder_layers=1",
    "model.position=rope",
    "model.num_kv_heads=2",
    "model.dropout_rate=0",
    "model.attention_dropout_rate=0",
    "model.max_length=128",
    "mesh.data=2",
    "mesh.tensor=2",
    "mesh.fsdp=2",
  ]
  ids, positions, valid = _packed(128)
  inputs = jnp.where(valid, jax.random.randint(jax.random.key(4), (B, 128), 3, 1000), 0)
  batch = {"segment_ids": ids, "positions": positions}
  results = []
  for attention in ("dense", "splash"):
    config = load_config(TINY, [*base, f"model.attention={attention}"])
    model, mesh = get_task(config).make_model(), build_mesh(config)
    params = jax.jit(model.init)(jax.random.key(0), inputs)["params"]

    def loss(params, model=model):
      logits = model.apply({"params": params}, inputs, deterministic=True, **batch)
      return jnp.sum(jnp.where(valid[..., None], logits, 0.0) ** 2) / 1e3, logits

    with sh.bind(mesh, sh.rules_for(config.mesh)):
      results.append(jax.jit(jax.value_and_grad(loss, has_aux=True))(params))
  (_, dense_logits), dense_grads = results[0]
  (_, splash_logits), splash_grads = results[1]
  np.testing.assert_allclose(
    np.where(valid[..., None], splash_logits, 0), np.where(valid[..., None], dense_logits, 0), atol=1e-5, rtol=1e-5
  )
  for got, want in zip(jax.tree.leaves(splash_grads), jax.tree.leaves(dense_grads)):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason="libtpu is not installed (pip install -e '.[aot]'): no TPU compiler here",
)


@needs_libtpu
def test_sharded_kernels_compile_for_tpu():
  """Forward and backward on a data=2 x tensor=2 v5e slice: the Mosaic kernels, per device."""
  mesh = jax.sharding.Mesh(np.array(aot.topology_devices("v5e:2x2")).reshape(2, 2), ("data", "tensor"))
  rules = (("act_batch", "data"), ("act_heads", "tensor"))

  def loss(q, k, v, valid):
    return jnp.sum(splash_attention(q, k, v, valid, valid, causal=True, block_size=128) ** 2)

  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None, "tensor"))
  q, kv = (
    jax.ShapeDtypeStruct((4, 256, 4, 128), jnp.bfloat16, sharding=spec),
    jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16, sharding=spec),
  )
  valid = jax.ShapeDtypeStruct(
    (4, 256), jnp.bool_, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  )
  with sh.bind(mesh, rules):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, valid).compile()
  assert compiled.as_text().count("tpu_custom_call") >= 3  # the forward, dq and dkv kernels


@pytest.mark.slow
@needs_libtpu
def test_train_step_with_splash_compiles_for_tpu():
  """The Mosaic kernels (forward, dq, dkv) in a train step compiled by the TPU compiler for v5e:2x2."""
  config = load_config(
    TINY,
    [
      "model.kind=decoder_only",
      "model.num_decoder_layers=1",
      "model.position=rope",
      "model.attention=splash",
      "model.attention_dropout_rate=0",
      "model.d_model=256",
      "model.num_heads=2",
      "model.d_ff=256",
      "data.max_length=128",
      "data.buckets=[128]",
      "train.batch_size=4",
      "mesh.data=2",
      "mesh.tensor=2",
    ],
  )
  lowered, mesh, _ = aot.lower_train_step(config, aot.topology_devices("v5e:2x2"))
  assert mesh.devices.flat[0].platform == "tpu"
  compiled = lowered.compile()
  assert compiled.as_text().count("tpu_custom_call") >= 3  # splash forward, dq and dkv kernels
