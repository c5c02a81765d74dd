"""`jaxformer compile`: ahead-of-time compilation for a mesh of simulated devices, from
abstract inputs only, with XLA's per-device memory analysis."""

import json

import jax
import pytest
from conftest import TINY

from jaxformer import cli
from jaxformer import sharding as sh
from jaxformer.aot import train_step as aot
from jaxformer.cli import args as cli_args
from jaxformer.config import ConfigError, load_config
from jaxformer.tasks import get_task
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import abstract_state, state_shardings
from jaxformer.train.summary import per_device_bytes

# One layer per stack, short rows: every sharded weight and collective, compiled in seconds.
SMALL = [
  "model.num_encoder_layers=1",
  "model.num_decoder_layers=1",
  "data.max_length=16",
  "data.buckets=[16]",
  "train.batch_size=8",
  "runtime.deterministic=false",
]


def test_compile_reports_per_device_memory_that_adds_up(capsys):
  overrides = [*SMALL, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
  assert cli.main(["compile", "--config", TINY, "--devices", "8", "--hbm", "1MiB", *overrides]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  result = json.loads(out[-1])
  assert result["devices"] == 8
  assert result["mesh"] == {"data": 2, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}
  parts = result["argument_bytes"] + result["output_bytes"] - result["alias_bytes"] + result["temp_bytes"]
  assert result["total_bytes_per_device"] == parts and result["temp_bytes"] > 0 and result["compile_seconds"] > 0
  assert result["hbm_bytes"] == 2**20 and result["fits"] is (parts <= 2**20)
  assert any("per device:" in line for line in out) and any("fit" in line for line in out[:-1])
  # The arguments are this device's shard of the train state plus its rows of the batch (and the key).
  config = load_config(TINY, overrides)
  abstract, shardings = state_shardings(
    get_task(config).make_model(), make_optimizer(config.optim, 64), sh.make_mesh(config.mesh)
  )
  state_bytes = per_device_bytes(abstract, shardings)
  batch_bytes = 2 * (8 // 4) * 16 * 4  # inputs and targets: 8 rows over data*fsdp = 4, 16 int32 tokens
  assert state_bytes + batch_bytes <= result["argument_bytes"] <= state_bytes + batch_bytes + 64
  # Donation: the new state reuses the old one's buffers, so the aliased bytes are the state's.
  assert state_bytes - 64 <= result["alias_bytes"] <= state_bytes


@pytest.mark.parametrize(
  "text, size", [("80GiB", 80 * 2**30), ("16GB", 16 * 10**9), ("512 mib", 2**29), ("1.5TB", 1.5e12), ("1000", 1000)]
)
def test_parse_size(text, size):
  assert aot.parse_size(text) == size


@pytest.mark.parametrize("text", ["80GiX", "", "-1GB", "GiB"])
def test_bad_size_is_one_line(text):
  with pytest.raises(ConfigError, match="is not a size; write e.g. 80GiB"):
    aot.parse_size(text)


def test_mesh_that_does_not_divide_fails_before_compiling(capsys):
  assert (
    cli.main(
      [
        "compile",
        "--config",
        TINY,
        "--devices",
        "8",
        *SMALL,
        "mesh.data=1",
        "mesh.tensor=8",
        "mesh.fsdp=1",
        "model.d_ff=132",
      ]
    )
    == 2
  )
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: mesh.tensor=8 does not divide model.d_ff=132") and "\n" not in err


def test_topology_without_libtpu_is_one_line(monkeypatch):
  monkeypatch.setattr(aot.importlib.util, "find_spec", lambda name: None)  # as where the aot extra is not installed
  with pytest.raises(ConfigError, match=r"--topology v5e:2x2: no TPU compiler for it here .*use --devices N") as err:
    aot.topology_devices("v5e:2x2")
  assert "\n" not in str(err.value)


def test_the_presets_are_llama_shapes():
  """decoder_1b/8b/70b hold 1.24B, 8.03B and 70.6B parameters (Llama 3.2 1B, Llama 3 8B and 70B)."""
  counts = {}
  for name in ("decoder_1b", "decoder_8b", "decoder_70b"):
    config = load_config(cli_args.CONFIGS_DIR / f"{name}.yaml")
    abstract, _ = abstract_state(get_task(config).make_model(), make_optimizer(config.optim, config.model.d_model))
    counts[name] = sum(x.size for x in jax.tree.leaves(abstract.params))
    assert config.model.dtype == "bfloat16" and config.model.scan_layers and config.model.remat == "full"
  assert counts == {"decoder_1b": 1_236_109_312, "decoder_8b": 8_031_309_824, "decoder_70b": 70_558_949_376}
