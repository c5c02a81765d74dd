"""`batched_threefry`: a model's init with its Threefry hashes merged gives bitwise the values of
`model.init`, with as many hashes as the key chain is deep instead of one per draw; draws above
`max_size`, keys passed through a scan, other key implementations and side effects are handled."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from jaxformer import sharding as sh
from jaxformer.config import MeshConfig
from jaxformer.models.abstract import _boxed_params
from jaxformer.models.batched_threefry import batched_threefry
from jaxformer.tasks import get_task
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings


def _equal(a, b) -> bool:
  same = jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)
  return jax.tree.structure(a) == jax.tree.structure(b) and all(jax.tree.leaves(same))


@pytest.mark.parametrize(
  "kind,overrides",
  [
    (None, ()),
    ("decoder_only", ("model.scan_layers=true", "model.remat=full", "model.num_experts=2", "model.mlp_bias=true")),
    ("encoder_only", ("model.lora_rank=2",)),
  ],
  ids=["encoder_decoder", "decoder_only-scan-remat-moe", "encoder_only-lora"],
)
def test_model_init_is_bitwise_flax_init_with_a_hash_per_wave(kind, overrides):
  model = get_task(tiny_config(kind, *overrides)).make_model()
  init = lambda key: _boxed_params(model, key)  # noqa: E731
  key = jax.random.key(7)
  merged = batched_threefry(init)
  assert _equal(jax.jit(merged)(key), jax.jit(init)(key))
  plain = str(jax.make_jaxpr(init)(key))
  draws = plain.count("random_bits") + plain.count("random_fold_in")  # one hash each
  hashes = str(jax.make_jaxpr(merged)(key)).count("threefry2x32")
  assert draws >= 25 and 1 <= hashes <= 3  # one merged hash per wave of the key chain (2 here)


def test_big_draws_keep_their_own_hash_and_keys_pass_through_a_scan():
  def fn(key):
    a, b, c = jax.random.split(key, 3)
    big = jax.random.normal(a, (40, 30))  # 1,200 elements, above max_size below: its own hash
    small = [jax.random.uniform(jax.random.fold_in(b, i), (3, i + 1)) for i in range(4)]

    def body(carry, k):
      return carry + jax.random.normal(k, (2,)), jax.random.bits(k, (2,))

    total, bits = jax.lax.scan(body, jnp.zeros(2), jax.random.split(c, 3))
    return big, small, total, bits, jax.random.fold_in(c, 5)

  key = jax.random.key(3)
  merged = batched_threefry(fn, max_size=1000)
  got, want = jax.jit(merged)(key), jax.jit(fn)(key)
  # Key data rewrapped inside: the same key, so the same values.
  rewrapped = batched_threefry(lambda k: fn(jax.random.wrap_key_data(jax.random.key_data(k))), max_size=1000)
  assert _equal(jax.jit(rewrapped)(key)[:-1], want[:-1])
  assert _equal(jax.random.key_data(got[-1]), jax.random.key_data(want[-1]))
  assert _equal(got[:-1], want[:-1])
  eqns = jax.make_jaxpr(merged)(key).jaxpr.eqns
  widths = sorted(e.outvars[0].aval.size for e in eqns if e.primitive.name == "threefry2x32")
  # The big draw alone at 1,200 elements; the small draws and key derivations merged, wider than any one.
  assert 1200 in widths and max(w for w in widths if w != 1200) > 3 * 4


def test_other_key_implementations_and_side_effects_run_the_function_as_written():
  fn = lambda key: jax.random.normal(jax.random.fold_in(key, 1), (3,))  # noqa: E731
  rbg = jax.random.key(0, impl="rbg")
  assert _equal(jax.jit(batched_threefry(fn))(rbg), jax.jit(fn)(rbg))
  scanned = lambda keys: jax.lax.scan(lambda c, k: (c + fn(k), None), jnp.zeros(3), keys)[0]  # noqa: E731
  rbg_keys = jax.random.split(rbg, 2)  # they reach the scan before any key operation
  assert _equal(jax.jit(batched_threefry(scanned))(rbg_keys), jax.jit(scanned)(rbg_keys))
  # An rbg key seeded inside a call the merge would inline.
  seeded = lambda seed: jax.jit(lambda s: jax.random.normal(jax.random.key(s, impl="rbg"), (3,)))(seed)  # noqa: E731
  assert _equal(jax.jit(batched_threefry(seeded))(7), jax.jit(seeded)(7))

  def printing(key):
    x = fn(key)
    jax.debug.callback(lambda v: None, x)
    return x

  key = jax.random.key(0)
  jaxpr = jax.make_jaxpr(batched_threefry(printing))(key)
  assert jaxpr.effects and str(jaxpr).count("random_fold_in") == 1  # unchanged: not expanded
  assert _equal(jax.jit(batched_threefry(printing))(key), jax.jit(fn)(key))


def test_merged_draws_sharded_over_an_fsdp_mesh_and_create_state_there_hold_flax_init():
  """Under a mesh the merged draws are replicated, then each device slices out its own shards;
  `create_state` on a mesh of several devices draws each parameter as `model.init` does."""
  config = tiny_config(None, "model.num_encoder_layers=1", "model.num_decoder_layers=1")
  model = get_task(config).make_model()
  tx = make_optimizer(config.optim, config.model.d_model)
  mesh = sh.make_mesh(MeshConfig(data=1, fsdp=8), jax.devices()[:8])
  _, shardings = state_shardings(model, tx, mesh)
  init = lambda key: nn.meta.unbox(_boxed_params(model, key))  # noqa: E731
  want = jax.jit(init)(jax.random.key(5))
  with sh.bind(mesh, sh.LOGICAL_RULES):
    merged = jax.jit(batched_threefry(init), out_shardings=shardings.params)(jax.random.key(5))
  assert _equal(jax.device_get(merged), want)
  assert merged["embed"]["embedding"].sharding == shardings.params["embed"]["embedding"]
  state = create_state(model, tx, mesh, 5, shardings)
  assert _equal(jax.device_get(state.params), want)
