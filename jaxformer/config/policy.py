"""The mixed-precision policy: which dtype holds parameters, runs the model and holds outputs.

A policy names three dtypes: `params` (storage of parameters and optimizer state),
`compute` (activations and matmuls inside the model) and `output` (logits and the loss).
Parameters and optimizer state are always float32, and so are LayerNorm statistics,
attention softmax, logits and the loss; only `compute` varies (float32, bfloat16, float16).
One exception: a LoRA run (`model.lora_rank` > 0) may set `params=bfloat16|float16` to hold its
frozen base's projection kernels in that dtype (`layers.lora.hold_frozen`; `Config.validate`
refuses it without LoRA); the adapters and their optimizer state stay float32.
Parsing needs no JAX, so a config is checked before JAX is imported.
"""

from __future__ import annotations

import dataclasses

DTYPES = ("float32", "bfloat16", "float16")
KEYS = ("params", "compute", "output")


@dataclasses.dataclass(frozen=True)
class Policy:
  """Dtype names of parameters, compute and outputs (`float32`, `bfloat16` or `float16`)."""

  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  output_dtype: str = "float32"

  def __str__(self) -> str:
    return f"params={self.param_dtype},compute={self.compute_dtype},output={self.output_dtype}"


def parse_policy(text: str) -> Policy:
  """Parses "params=float32,compute=bfloat16,output=float32" (keys in any order; a missing
  key means float32).

  Raises:
    ValueError: one line naming the problem: empty text, an item without "=", an unknown
      or repeated key, an unknown dtype, or output other than float32.
  """
  names = {}
  for item in text.split(","):
    if "=" not in item:
      raise ValueError(f"{item.strip()!r} is not key=dtype; write e.g. params=float32,compute=bfloat16,output=float32")
    key, name = (part.strip() for part in item.split("=", 1))
    if key not in KEYS:
      raise ValueError(f"unknown key {key!r}; use {', '.join(KEYS)}")
    if key in names:
      raise ValueError(f"{key} is given twice")
    if name not in DTYPES:
      raise ValueError(f"unknown dtype {name!r} for {key}; use {', '.join(DTYPES)}")
    names[key] = name
  if names.get("output", "float32") != "float32":
    raise ValueError(f"output={names['output']}: logits and the loss are always float32; use output=float32")
  return Policy(param_dtype=names.get("params", "float32"), compute_dtype=names.get("compute", "float32"))
