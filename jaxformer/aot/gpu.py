"""GPU topologies without a GPU, for `jaxformer compile --topology h100:8`: XLA:GPU compiles for a
described device ("deviceless" compilation) when its PJRT plugin is given a target description, a
`stream_executor.GpuTargetConfigProto`. The descriptions here are written from NVIDIA's published
figures for each GPU (SM count, memory, bandwidth, caches, compute capability).

The CUDA plugin is an optional install (`pip install jax-cuda13-plugin==0.10.2
jax-cuda13-pjrt==0.10.2`, about 130 MB; no CUDA libraries are needed to compile, only to run). Once
installed, JAX tries to start it in every process that does not restrict `JAX_PLATFORMS`, and
without CUDA's libraries that prints a plugin error, so it is not part of the `aot` extra.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

from jaxformer.config import ConfigError

# NVIDIA's data-sheet figures (SXM parts): streaming multiprocessors, memory (the rated GB, 10^9 bytes: a
# little under what CUDA reports), memory bandwidth bytes/s, boost clock GHz, and the device name.
GPUS = {
  "h100": {"sms": 132, "memory": 80 * 10**9, "bandwidth": 3.35e12, "clock": 1.98, "name": "NVIDIA H100 80GB HBM3"},
  "h200": {"sms": 132, "memory": 141 * 10**9, "bandwidth": 4.8e12, "clock": 1.98, "name": "NVIDIA H200"},
}
# What every Hopper (compute capability 9.0) SM offers.
_HOPPER = {
  "threads_per_block_limit": 1024,
  "threads_per_warp": 32,
  "shared_memory_per_block": 48 * 1024,
  "shared_memory_per_core": 228 * 1024,
  "threads_per_core_limit": 2048,
  "fpus_per_core": 128,
  "block_dim_limit_x": 2**31 - 1,
  "block_dim_limit_y": 65535,
  "block_dim_limit_z": 65535,
  "l2_cache_size": 50 * 2**20,
  "shared_memory_per_block_optin": 227 * 1024,
  "registers_per_core_limit": 65536,
  "registers_per_block_limit": 65536,
}


def is_gpu(name: str) -> bool:
  """Whether topology `name` ("h100:8", "h200:2x8") names one of `GPUS`."""
  return name.split(":")[0].lower() in GPUS


def target_config(kind: str) -> str:
  """The text `GpuTargetConfigProto` of GPU `kind` (a key of `GPUS`)."""
  gpu = GPUS[kind]
  info = {
    **_HOPPER,
    "core_count": gpu["sms"],
    "memory_bandwidth": int(gpu["bandwidth"]),
    "clock_rate_ghz": gpu["clock"],
    "device_memory_size": gpu["memory"],
  }
  fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
  return (
    f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: 9 minor: 0 }}\n}}\n"
    f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 8 }}\n'
    f'device_description_str: "{gpu["name"]}"\n'
  )


def memory_bytes(name: str) -> int:
  """Device memory of the GPUs of topology `name`, bytes."""
  return GPUS[name.split(":")[0].lower()]["memory"]


def gpu_devices(name: str) -> list[Any]:
  """The devices of GPU topology `name`: KIND:N (one host of N GPUs) or KIND:HxN (H hosts of N),
  compile-only, from the CUDA plugin given `target_config`.

  Raises:
    ConfigError: a malformed name, or no CUDA plugin installed (one line each).
  """
  kind, _, shape = name.lower().partition(":")
  match = re.fullmatch(r"(?:(\d+)x)?(\d+)", shape)
  if not match:
    raise ConfigError(f"--topology {name}: write GPU:COUNT or GPU:HOSTSxCOUNT, e.g. h100:8 or h200:4x8")
  if not any(importlib.util.find_spec(p) for p in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
    raise ConfigError(
      f"--topology {name}: no XLA:GPU compiler here; pip install jax-cuda13-plugin==0.10.2 "
      "jax-cuda13-pjrt==0.10.2 (no CUDA libraries needed to compile), or use --devices N"
    )
  from jax.experimental import topologies

  sizes = f"1x{match.group(1) or 1}x{match.group(2)}"  # slices x hosts per slice x GPUs per host
  return list(topologies.get_topology_desc(name, "cuda", target_config=target_config(kind), topology=sizes).devices)
