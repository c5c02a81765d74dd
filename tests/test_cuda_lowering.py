"""GPU without a GPU: the train step, the decode step and prefill, and `model.attention=fused`
(cuDNN flash attention) lowered for CUDA on this CPU machine (`.trace(...).lower(lowering_platforms=
("cuda",))`): StableHLO with the mesh's shardings that XLA:GPU would take, which fails here for any
op or sharding with no CUDA lowering. Compiling needs the CUDA plugin, which compiles for described
GPUs without one (`--topology h100:8`, `aot_gpu`; not installed by CI: that test is skipped there)."""

import importlib.util
import re

import jax
import jax._src.cudnn.fused_attention_stablehlo as cudnn_attention
import pytest
from conftest import TINY

from jaxformer.aot import decode as aot_decode
from jaxformer.aot import gpu as aot_gpu
from jaxformer.aot import train_step as aot
from jaxformer.config import ConfigError, load_config

# One layer per stack, every weight sharded (data x fsdp x tensor over the 8 CPU devices), bfloat16 compute.
SMALL = [
  "model.num_encoder_layers=1",
  "model.num_decoder_layers=1",
  "data.max_length=16",
  "data.buckets=[16]",
  "train.batch_size=8",
  "runtime.deterministic=false",
  "mesh.data=2",
  "mesh.fsdp=2",
  "mesh.tensor=2",
  "precision.policy=compute=bfloat16",
]
DECODER = ["model.kind=decoder_only", "model.num_decoder_layers=1", "model.position=rope"]


def _custom_calls(lowered) -> set[str]:
  return set(re.findall(r"custom_call @([\w$.]+)", lowered.as_text()))


def _check_cuda(lowered, partitions: int = 8) -> None:
  text = lowered.as_text()
  assert f"mhlo.num_partitions = {partitions}" in text and "sdy.sharding" in text
  assert "cpu" not in " ".join(_custom_calls(lowered)).lower()


@pytest.mark.parametrize("overrides", [[], DECODER], ids=["encoder_decoder", "decoder_only"])
def test_train_step_lowers_for_cuda(overrides):
  lowered, mesh, _ = aot.lower_train_step(load_config(TINY, [*SMALL, *overrides]), platforms=("cuda",))
  assert mesh.devices.size == 8
  _check_cuda(lowered)


@pytest.mark.parametrize("page_size", [0, 8])
def test_decode_step_and_prefill_lower_for_cuda(page_size):
  facts, lowered = aot_decode.lower_decode(
    load_config(TINY, [*SMALL, *DECODER]), context=32, page_size=page_size, platforms=("cuda",)
  )
  assert facts["kv_cache_bytes"] > 0 and set(lowered) == {"decode_step", "prefill"}
  for program in lowered.values():
    _check_cuda(program)


def test_fused_attention_lowers_to_cudnn_for_cuda(monkeypatch):
  """`model.attention=fused` asks for cuDNN when JAX's backend is a GPU with bfloat16 inputs. This host
  has neither a GPU nor libcudnn, which JAX asks for its version while tracing: both are stood in for,
  so what is checked is that JAX's cuDNN lowering takes our shapes, masks and layouts, forward and
  backward, in the train step (on one device: on a mesh JAX wraps the cuDNN call in a custom
  partitioning that is expanded only when XLA:GPU compiles it)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(cudnn_attention, "check_cudnn_version", lambda: 91400)  # cuDNN 9.14
  fused = [*SMALL, "model.attention=fused", "model.attention_dropout_rate=0"]
  one = load_config(TINY, [*fused, "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"])
  lowered, _, _ = aot.lower_train_step(one, jax.devices()[:1], platforms=("cuda",))
  calls = _custom_calls(lowered)
  assert any(c.startswith("__cudnn$fmha") and "Backward" not in c for c in calls), calls
  assert any(c.startswith("__cudnn$fmha") and "Backward" in c for c in calls), calls
  sharded, _, _ = aot.lower_train_step(load_config(TINY, fused), platforms=("cuda",))
  assert "CustomSPMDPartitioning" in _custom_calls(sharded)
  _check_cuda(sharded)


needs_cuda_plugin = pytest.mark.skipif(
  not any(importlib.util.find_spec(p) for p in ("jax_cuda13_plugin", "jax_cuda12_plugin")),
  reason="the CUDA plugin is not installed (pip install jax-cuda13-plugin==0.10.2 jax-cuda13-pjrt==0.10.2)",
)


def test_gpu_topology_names_are_checked_in_one_line(monkeypatch):
  with pytest.raises(ConfigError, match=r"--topology h100:eight: write GPU:COUNT or GPU:HOSTSxCOUNT"):
    aot.topology_devices("h100:eight")
  monkeypatch.setattr(aot_gpu.importlib.util, "find_spec", lambda name: None)  # as without the CUDA plugin
  with pytest.raises(ConfigError, match=r"--topology h200:8: no XLA:GPU compiler here; pip install jax-cuda13"):
    aot.topology_devices("h200:8")
  assert aot.device_memory("h200:2x8") == 141 * 10**9 and aot.device_memory("v5e:2x2") is None


@pytest.mark.slow
@needs_cuda_plugin
def test_train_step_compiles_for_h100_without_a_gpu():
  """XLA:GPU compiles for 8 described H100s (the plugin's deviceless compilation): per-device memory."""
  devices = aot.topology_devices("h100:8")
  assert len(devices) == 8 and devices[0].device_kind == "NVIDIA H100 80GB HBM3"
  result = aot.compile_train_step(load_config(TINY, [*SMALL[:6], "mesh.data=8"]), devices, aot.device_memory("h100:8"))
  assert result["platform"] == "gpu" and result["fits"] and result["temp_bytes"] > 0
  assert result["alias_bytes"] >= result["params"] * 4 * 3  # the donated params and Adam moments, replicated
