"""Context parallelism (`mesh.context`): attention with the length split over c devices equals
dense attention on one device, forward and gradients (1e-5), for every mask and position
scheme; a tiny model's loss and gradients likewise; per-device memory of the compiled train
step falls about 1/c; configurations that cannot split fail in one line."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import shakespeare_files, sweep, tiny_config

from jaxformer import sharding as sh
from jaxformer.aot.train_step import compile_train_step
from jaxformer.config import ConfigError, MeshConfig
from jaxformer.layers.attention import MultiHeadAttention
from jaxformer.runtime.startup import build_mesh
from jaxformer.tasks import get_task
from jaxformer.tasks.objective import loss_fn

ROOT = Path(__file__).parent.parent
B, T, S, D = 2, 16, 8, 24


def _mesh(context: int):
  return sh.make_mesh(MeshConfig(data=1, context=context), jax.devices()[:context])


def _run(fn, context: int, *args):
  """`fn(*args)` jitted, on one device (context 0) or inside `bind` on a mesh of `context` devices."""
  if not context:
    return jax.jit(fn)(*args)
  with sh.bind(_mesh(context), sh.LOGICAL_RULES):
    return jax.jit(fn)(*args)


def _inputs():
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (B, T, D))
  src = jax.random.normal(keys[1], (B, S, D))
  valid = jnp.arange(T)[None] < jnp.array([[T], [11]])  # row 1: 5 padded, fully masked query rows
  src_valid = jnp.arange(S)[None] < jnp.array([[S], [5]])
  segments = jnp.array([[1] * 6 + [2] * 7 + [3] * 3, [1] * 4 + [2] * 7 + [0] * 5])
  positions = jnp.array([list(range(6)) + list(range(7)) + list(range(3)), list(range(4)) + list(range(7)) + [0] * 5])
  src_segments = jnp.array([[1] * 3 + [2] * 3 + [3] * 2, [1] * 2 + [2] * 3 + [0] * 3])
  return dict(
    x=x,
    src=src,
    valid=valid,
    src_valid=src_valid,
    segments=segments,
    positions=positions,
    src_segments=src_segments,
    weights=jnp.cos(jnp.arange(B * T * D)).reshape(B, T, D),
  )


# name -> (module options, call keywords built from _inputs()): every mask and position scheme.
CASES = {
  "causal-rope-padding": (dict(causal=True, position="rope"), lambda a: dict(q_valid=a["valid"])),
  "window-global-alibi-packed": (
    dict(causal=True, position="alibi", sliding_window=3, global_tokens=2),
    lambda a: dict(q_valid=a["valid"], q_segment_ids=a["segments"], positions=a["positions"]),
  ),
  "bidirectional-t5-padding": (
    dict(position="t5", relative_buckets=8, relative_max_distance=12),
    lambda a: dict(q_valid=a["valid"]),
  ),
  "cross-packed": (
    dict(is_cross=True),
    lambda a: dict(
      kv=a["src"],
      q_valid=a["valid"],
      kv_valid=a["src_valid"],
      q_segment_ids=a["segments"],
      kv_segment_ids=a["src_segments"],
    ),
  ),
}


def _attention_grads(implementation: str, case: str, context: int):
  """(output, gradients wrt params, x, the source and the T5 table) of the layer under `context`."""
  options, call = CASES[case]
  layer = MultiHeadAttention(
    num_heads=4, num_kv_heads=2, head_dim=8, implementation=implementation, block_size=4, **options
  )
  a = _inputs()
  kw = call(a)
  src = kw.pop("kv", None)
  table = jax.random.normal(jax.random.key(2), (8, 4)) * 0.5 if options.get("position") == "t5" else None
  params = MultiHeadAttention(num_heads=4, num_kv_heads=2, head_dim=8, **options).init(
    jax.random.key(1), a["x"], src, deterministic=True, bias_table=table, **kw
  )

  def loss(p, x, src, table):
    y = layer.apply(p, x, src, deterministic=True, bias_table=table, **kw)
    return jnp.sum(y * a["weights"]), y

  (_, out), grads = _run(
    jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True), context, params, a["x"], src, table
  )
  return out, grads


@pytest.fixture(scope="module")
def dense_references():
  return {case: _attention_grads("dense", case, 0) for case in CASES}


def _assert_close(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
  "implementation, context", [("blockwise", 2), ("blockwise", 4), ("blockwise", 8), ("dense", 8), ("fused", 8)]
)
def test_causal_rope_padding_equals_dense_on_one_device(dense_references, implementation, context):
  _assert_close(
    _attention_grads(implementation, "causal-rope-padding", context), dense_references["causal-rope-padding"]
  )


@pytest.mark.parametrize("case", [c for c in CASES if c != "causal-rope-padding"])
@pytest.mark.parametrize("implementation, context", [("blockwise", 8), ("dense", 4)])
def test_masks_and_position_biases_equal_dense_on_one_device(dense_references, case, implementation, context):
  """Sliding window with global tokens, ALiBi, packed segments, T5 (its table's gradient summed
  over the devices) and cross-attention over a split source."""
  _assert_close(_attention_grads(implementation, case, context), dense_references[case])


def _config(*overrides: str):
  return tiny_config(
    None, "model.num_encoder_layers=1", "model.num_decoder_layers=2", "model.attention_block_size=4", *overrides
  )


@pytest.mark.parametrize(
  "kind, context, extra",
  sweep(
    [
      (
        "decoder_only",
        8,
        ["model.position=rope", "model.attention=blockwise", "model.remat=full", "model.scan_layers=true"],
      ),
      ("encoder_decoder", 4, []),
    ],
    {"decoder_only-8-extra0"},
    ids=["decoder_only-8-extra0", "encoder_decoder-4-extra1"],
  ),
)
def test_tiny_model_loss_and_gradients_equal_one_device(kind, context, extra):
  """A decoder-only model (RoPE, blockwise, remat, scanned layers) and the encoder-decoder (its
  cross-attention gathers the split encoder output)."""
  config = _config(f"model.kind={kind}", "model.dropout_rate=0", *extra)
  task = get_task(config)
  model = task.make_model()
  rng = np.random.default_rng(0)
  ids = rng.integers(1, config.model.vocab_size, size=(2, 2, 16)).astype(np.int32)
  ids[:, 1, 12:] = 0  # padding
  batch = {"inputs": ids[0], "targets": ids[1]}
  params = jax.jit(model.init)(jax.random.key(0), batch["inputs"], batch["targets"])["params"]

  def loss(p):
    return loss_fn(task, model, p, batch, None, 0.0)[0]

  ref = _run(jax.value_and_grad(loss), 0, params)
  got = _run(jax.value_and_grad(loss), context, params)
  assert np.isfinite(float(ref[0]))
  _assert_close(got, ref)


@pytest.mark.parametrize("attention", sweep(["dense", "blockwise"], {"blockwise"}))
def test_bfloat16_compute_compiles_and_agrees_with_one_device(attention):
  """bfloat16 compute (the GPU/TPU preset): the keys' gradients are reduce-scattered in float32
  (XLA:CPU aborts on a bfloat16 one inside a partly manual map); values agree with one device up
  to bfloat16 rounding."""
  config = _config(
    "model.kind=decoder_only",
    "model.dropout_rate=0",
    "model.position=rope",
    f"model.attention={attention}",
    "precision.policy=params=float32,compute=bfloat16,output=float32",
  )
  task = get_task(config)
  model = task.make_model()
  ids = np.random.default_rng(1).integers(1, config.model.vocab_size, size=(2, 2, 16)).astype(np.int32)
  batch = {"inputs": ids[0], "targets": ids[1]}
  params = jax.jit(model.init)(jax.random.key(0), batch["inputs"], batch["targets"])["params"]

  def loss(p):
    return loss_fn(task, model, p, batch, None, 0.0)[0]

  (ref_loss, ref_grads), (loss_, grads) = (_run(jax.value_and_grad(loss), c, params) for c in (0, 2))
  assert float(loss_) == pytest.approx(float(ref_loss), rel=1e-2)
  a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]).astype(np.float64) for g in (grads, ref_grads))
  assert np.all(np.isfinite(a)) and a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.99


@pytest.mark.slow
def test_per_device_memory_falls_with_the_context_size():
  """Compiled memory of a decoder-only train step on one 4096-token sequence (blockwise attention,
  one layer): temporaries fall monotonically and at c = 8 are at most half of c = 1 (each device
  still holds the gathered keys and values and the step's parameter-sized temporaries)."""
  config = _config(
    "model.kind=decoder_only",
    "model.position=rope",
    "model.attention=blockwise",
    "model.attention_block_size=256",
    "model.num_decoder_layers=1",
    "model.max_length=4096",
    "data.max_length=4096",
    "train.batch_size=1",
    "model.dropout_rate=0",
  )
  temps = []
  for c in (1, 2, 4, 8):
    cfg = dataclasses.replace(config, mesh=MeshConfig(data=1, context=c))
    temps.append(compile_train_step(cfg, jax.devices()[:c])["temp_bytes"])
  assert temps == sorted(temps, reverse=True) and temps[-1] <= temps[0] / 2, temps


def test_a_length_that_does_not_split_is_left_to_jit_and_configs_that_cannot_run_fail_in_one_line():
  """12 tokens over 8 devices (e.g. a source being translated): jit's automatic partitioning, same
  values. A training config must split (checked before compiling)."""
  layer = MultiHeadAttention(num_heads=2, head_dim=4, causal=True)
  x = jax.random.normal(jax.random.key(0), (1, 12, 8))
  params = layer.init(jax.random.key(1), x, None, deterministic=True)
  np.testing.assert_allclose(
    *(_run(lambda p: layer.apply(p, x, None, deterministic=True), c, params) for c in (8, 0)), atol=1e-6
  )
  with pytest.raises(ConfigError, match="model.attention_dropout_rate=0.1 does not run with context parallelism"):
    build_mesh(_config("model.attention_dropout_rate=0.1", "mesh.data=1", "mesh.context=8", "train.batch_size=8"))
  with pytest.raises(ConfigError, match=r"mesh.context=8 does not divide the sequence lengths \[12\]"):
    build_mesh(_config("model.kind=decoder_only", "data.max_length=12", "mesh.data=1", "mesh.context=8"))


@pytest.mark.slow
def test_a_decoder_trains_on_a_32k_token_sequence_over_8_devices(tmp_path):
  """`jaxformer train` on one 32,768-token sequence per step with mesh.context=8 (4,096 tokens per
  simulated CPU device; RoPE, causal blockwise attention): two steps, the loss finite and falling.
  A subprocess, so XLA:CPU optimises the program (the suite turns that off to compile faster)."""
  import json
  import os
  import subprocess
  import sys

  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  length = 32768
  args = [
    "train",
    "--config",
    str(ROOT / "configs/shakespeare_char.yaml"),
    "--workdir",
    str(tmp_path / "run"),
    *shakespeare_files(tmp_path, length + 1),  # the closing evaluation: one 32k window
    "model.d_model=16",
    "model.num_heads=1",  # one head of 16 and 512-key blocks: half the time of 2 x 8 and 1024
    "model.d_ff=32",
    "model.num_decoder_layers=1",
    "model.position=rope",
    "model.attention=blockwise",
    "model.attention_block_size=512",
    f"model.max_length={length}",
    f"data.max_length={length}",
    "train.batch_size=1",
    "train.steps_per_call=1",
    "train.num_steps=2",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.checkpoint_every=1000",
    "optim.warmup_steps=1",
    "mesh.data=1",
    "mesh.context=8",
    "runtime.num_cpu_devices=8",
  ]
  result = subprocess.run(
    [sys.executable, "-m", "jaxformer", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200
  )
  assert result.returncode == 0, result.stderr[-2000:]
  rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
  losses = [row["loss"] for row in rows if "loss" in row and row.get("step") in (1, 2)]
  assert len(losses) == 2 and all(np.isfinite(losses)) and losses[1] < losses[0]
  assert all(row["padding_fraction"] == 0.0 for row in rows if "loss" in row)  # full 32k-token windows
