"""`runtime.deterministic` (the default): the same bits whatever the number of usable CPUs and
the load. Without it XLA:CPU sizes its thread pool by the usable CPUs and splits the
weight-gradient matmuls and batch reductions by that size, so the params of this very test
differ between 1 and 2 CPUs (measured with `runtime.deterministic=false`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxformer.config import ConfigError, config_from_dict
from jaxformer.runtime.startup import DETERMINISTIC_XLA_FLAGS, pin_cpu_numerics

ROOT = Path(__file__).resolve().parents[1]

# Three train steps (dropout on) of a tiny encoder-decoder; prints a hash of the params and
# the losses' bits. init_runtime runs first, as in the CLI.
TRAIN = """
import hashlib, json
from jaxformer.config import Config, MeshConfig, ModelConfig, OptimConfig, RuntimeConfig
from jaxformer.runtime.startup import init_runtime
init_runtime(RuntimeConfig())
import jax, numpy as np
from jaxformer import sharding as sh
from jaxformer.data import global_batch
from jaxformer.models.transformer import EncoderDecoder
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_train_step
cfg = Config(model=ModelConfig(vocab_size=101, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1,
                               num_decoder_layers=1, max_length=64), optim=OptimConfig(warmup_steps=2))
mesh = sh.make_mesh(MeshConfig())
model, tx = EncoderDecoder(cfg.model), make_optimizer(cfg.optim, 32)
_, shardings = state_shardings(model, tx, mesh)
state = create_state(model, tx, mesh, 0, shardings)
step = make_train_step(model, tx, cfg, mesh, shardings)
rng = np.random.default_rng(0)
batch = global_batch({k: rng.integers(3, 101, (32, 24)).astype(np.int32) for k in ("inputs", "targets")}, mesh)
losses = []
for _ in range(3):
  state, metrics = step(state, batch, jax.random.key(1))
  losses.append(float(metrics["loss"]).hex())
params = b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(state.params)))
print(json.dumps({"params": hashlib.sha256(params).hexdigest(), "losses": losses}))
"""


def _one_cpu():
  os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_training_is_bitwise_reproducible_across_cpu_counts_under_load():
  env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "JAX_COMPILATION_CACHE_DIR")}
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # each process compiles for its own CPUs
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # one device: the whole batch in each kernel
  busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  try:
    runs = [
      subprocess.Popen(
        [sys.executable, "-c", TRAIN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        preexec_fn=fn,
      )
      for fn in (None, _one_cpu)
    ]
    outs = [run.communicate(timeout=600) for run in runs]
  finally:
    busy.kill()
    busy.wait()
  for run, (_, err) in zip(runs, outs):
    assert run.returncode == 0, err[-2000:]
  all_cpus, one_cpu = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
  assert len(all_cpus["losses"]) == 3 and len(set(all_cpus["losses"])) == 3
  assert one_cpu == all_cpus


def test_pin_cpu_numerics_sets_the_pool_and_keeps_user_flags(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX512 --xla_backend_optimization_level=0")
  monkeypatch.setenv("NPROC", "64")
  pin_cpu_numerics(3)
  assert os.environ["NPROC"] == "3"
  flags = os.environ["XLA_FLAGS"].split()
  assert flags[:2] == ["--xla_cpu_max_isa=AVX512", "--xla_backend_optimization_level=0"]  # the user's ISA wins
  assert flags[2:] == list(DETERMINISTIC_XLA_FLAGS[1:])
  pin_cpu_numerics(3)  # idempotent
  assert os.environ["XLA_FLAGS"].split() == flags


def test_deterministic_is_the_default_and_cpu_threads_is_checked():
  runtime = config_from_dict({}, []).runtime
  assert (runtime.deterministic, runtime.cpu_threads) == (True, 2)
  assert not config_from_dict({}, ["runtime.deterministic=false"]).runtime.deterministic
  with pytest.raises(ConfigError, match=r"runtime.cpu_threads must be >= 1, got 0"):
    config_from_dict({}, ["runtime.cpu_threads=0"])
