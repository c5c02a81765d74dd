"""`jaxformer compile --topology`: the train step, decode step and prefill compiled by the real TPU
compiler (libtpu, the `aot` extra) for a TPU slice this machine does not have; a compiler
out-of-memory refusal is an answer (`fits: false`, exit 0), any other compile failure one line."""

import importlib.util
import json
import subprocess
import sys

import jax
import pytest
from conftest import TINY

from jaxformer import cli
from jaxformer.aot import train_step as aot
from jaxformer.config import ConfigError
from jaxformer.errors import CompileError

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason="libtpu is not installed (pip install -e '.[aot]'): no TPU compiler here",
)
# One layer per stack, short rows: compiled by the TPU compiler in a few seconds.
SMALL = [
  "model.num_encoder_layers=1",
  "model.num_decoder_layers=1",
  "data.max_length=16",
  "data.buckets=[16]",
  "train.batch_size=8",
  "runtime.deterministic=false",
]
# The compiler's messages, as libtpu 0.0.42 words them (the second from its message table).
TEMPORARIES = (
  "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
  "(27.21G) exceeds available HBM (15.75G)."
)
USED = (
  "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 20.50G of "
  "15.75G hbm. Exceeded hbm capacity by 4.75G.\n\nTotal hbm usage >= 21.00G:\n    reserved 256.00M\n"
)


def _compile(capsys, *args) -> tuple[dict, list[str]]:
  assert cli.main(["compile", "--config", TINY, "--topology", "v5e:2x2", *args]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  return json.loads(out[-1]), out[:-1]


@needs_libtpu
def test_decode_step_and_prefill_compile_for_tpu(capsys):
  result, summary = _compile(capsys, "--decode", "--context", "32", *SMALL)
  assert result["platform"] == "tpu" and result["devices"] == 4 and result["mode"] == "decode"
  assert (result["batch_size"], result["context"], result["page_size"]) == (8, 32, 0)
  # The weights are replicated over data=4; the cache's rows split 4 ways: one decoder layer, self- and
  # cross-attention keys and values, 8 rows x 8 heads x 32 tokens x head_dim 8, float32.
  assert result["weight_bytes_per_device"] == result["params"] * 4
  assert result["kv_cache_bytes"] == 2 * 2 * 8 * 8 * 32 * 8 * 4 and result["kv_cache_bytes_per_device"] == 2**16
  for name in ("decode_step", "prefill"):
    program = result[name]
    assert program["fits"] and program["flops"] > 0 and program["temp_bytes"] > 0
    assert program["argument_bytes"] >= result["weight_bytes_per_device"] + result["kv_cache_bytes_per_device"]
    assert program["alias_bytes"] >= result["kv_cache_bytes_per_device"]  # the donated cache is written in place
  assert result["prefill"]["flops"] > result["decode_step"]["flops"] and result["fits"]
  assert any(line.startswith("per device: weights") for line in summary)


@needs_libtpu
def test_decode_that_does_not_fit_is_an_answer(capsys):
  """262144 rows of 128 tokens: an 8 GiB cache shard per device, more than a v5e's 16 GiB once the compiler pads it."""
  result, summary = _compile(capsys, "--decode", "--context", "128", *SMALL, "train.batch_size=262144")
  assert result["fits"] is False and result["kv_cache_bytes_per_device"] == 2**33
  for name in ("decode_step", "prefill"):
    program = result[name]
    assert program["fits"] is False and program["required_bytes"] > program["available_bytes"]
    assert program["available_bytes"] == pytest.approx(15.75 * 2**30, rel=0.005)  # a v5e's usable HBM
    assert program["compiler_message"].startswith("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
  assert sum("does NOT fit" in line for line in summary) == 2


@needs_libtpu
@pytest.mark.slow
def test_train_step_compiles_for_tpu(capsys):
  result, summary = _compile(capsys, "--hbm", "16GiB", *SMALL)
  assert result["platform"] == "tpu" and result["devices"] == 4 and result["fits"] is True
  assert result["mesh"]["data"] == 4 and result["hbm_bytes"] == 16 * 2**30
  parts = result["argument_bytes"] + result["output_bytes"] - result["alias_bytes"] + result["temp_bytes"]
  assert result["total_bytes_per_device"] == parts and result["flops"] > 0 and result["bytes_accessed"] > 0
  assert result["alias_bytes"] >= result["params"] * 4 * 3  # params and both Adam moments, donated
  assert "fits in 16.00 GiB of device memory" in summary


@needs_libtpu
@pytest.mark.slow
def test_train_step_that_does_not_fit_exits_0_with_one_json_line():
  """A 1.07B-parameter FFN on 4 v5e chips, data-parallel: the compiler needs ~20 GiB of temporaries per chip."""
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxformer",
      "compile",
      "--config",
      TINY,
      "--topology",
      "v5e:2x2",
      *SMALL,
      "model.d_model=1024",
      "model.d_ff=262144",
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = proc.stdout.strip().splitlines()
  result = json.loads(lines[-1])
  assert result["fits"] is False and result["required_for"] == "HLO temporaries"
  assert result["required_bytes"] > 16 * 2**30 > result["available_bytes"] > 15 * 2**30
  assert "does NOT fit" in lines[-3] and "argument_bytes" not in result


@needs_libtpu
def test_unknown_topology_is_one_line():
  with pytest.raises(ConfigError, match=r"--topology v9z:2x2: libtpu does not know it .*e.g. v5e:4x4") as err:
    aot.topology_devices("v9z:2x2")
  assert "\n" not in str(err.value)


@pytest.mark.parametrize(
  "message, need, have, what",
  [(TEMPORARIES, 27.21 * 2**30, 15.75 * 2**30, "HLO temporaries"), (USED, 20.5 * 2**30, 15.75 * 2**30, "all buffers")],
)
def test_out_of_memory_figures_are_read_from_the_message(message, need, have, what):
  oom = aot.out_of_memory(message)
  assert oom["required_bytes"] == int(need) and oom["available_bytes"] == int(have) and oom["required_for"] == what
  assert "\n" not in oom["compiler_message"] and "Ran out of memory" in oom["compiler_message"]


def test_other_errors_are_not_out_of_memory():
  assert (
    aot.out_of_memory("RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem. Used 20.00M of 16.00M vmem.") is None
  )
  assert aot.out_of_memory("INVALID_ARGUMENT: shapes do not match") is None


def test_any_other_compile_failure_is_one_line():
  class Refused:
    def compile(self):
      raise jax.errors.JaxRuntimeError("UNIMPLEMENTED: no lowering for op foo\n\nwith more detail\nand more")

  with pytest.raises(
    CompileError,
    match=r"^the compiler rejected the train step: UNIMPLEMENTED: no lowering for "
    r"op foo; change the mesh",
  ) as err:
    aot.compile_program(Refused(), None, "the train step", "tpu")
  assert "\n" not in str(err.value)


def test_decode_of_an_encoder_only_model_is_one_line(capsys):
  assert cli.main(["compile", "--config", "shakespeare_mlm", "--devices", "8", "--decode"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: --decode: model.kind=encoder_only has no KV-cache decoding") and "\n" not in err


@needs_libtpu
def test_a_mesh_the_physical_axes_cannot_form_is_one_line(capsys):
  """v6e:4x4's axes make mesh sizes 4 and 16, not 2 x 8."""
  assert (
    cli.main(
      [
        "compile",
        "--config",
        TINY,
        "--topology",
        "v6e:4x4",
        *SMALL,
        "mesh.data=2",
        "mesh.fsdp=8",
        "train.batch_size=16",
      ]
    )
    == 2
  )
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: the mesh does not map onto the topology's physical axes") and "\n" not in err
