"""The mixed-precision policy: which dtype holds parameters, runs the model and holds outputs;
and the `precision` section of a config, which names the policy and the dynamic loss scaling.

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
import math

from jaxformer.errors import ConfigError

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


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  """Mixed-precision policy and dynamic loss scaling (see jaxformer/train/loss_scale.py)."""

  policy: str = "params=float32,compute=float32,output=float32"  # compute: float32 | bfloat16 | float16
  loss_scale: str = "auto"  # auto (dynamic iff compute=float16) | dynamic | none
  initial_scale: float = 32768.0  # 2**15
  growth_interval: int = 2000  # finite steps in a row before the scale grows
  growth_factor: float = 2.0  # the loss scale grows by this after growth_interval finite steps
  backoff_factor: float = 0.5  # on a non-finite step

  @property
  def parsed(self) -> Policy:
    """The policy as dtypes; raises ConfigError (one line) for bad text."""
    try:
      return parse_policy(self.policy)
    except ValueError as e:
      raise ConfigError(f"precision.policy={self.policy!r}: {e}") from None

  @property
  def dynamic_loss_scale(self) -> bool:
    """Whether the train step scales the loss and skips non-finite steps."""
    if self.loss_scale == "auto":
      return self.parsed.compute_dtype == "float16"
    return self.loss_scale == "dynamic"

  @property
  def start_scale(self) -> float:
    """The loss scale a fresh train state starts at (1 when scaling is off)."""
    return self.initial_scale if self.dynamic_loss_scale else 1.0

  def validate(self) -> None:
    """Raises ConfigError (one line) for an unparsable policy or a bad loss-scale setting."""
    self.parsed  # noqa: B018  parsing raises ConfigError for bad text
    if self.loss_scale not in ("auto", "dynamic", "none"):
      raise ConfigError(f"precision.loss_scale={self.loss_scale!r} is unknown; use auto, dynamic or none")
    if not 1.0 <= self.initial_scale < float(2**127):
      raise ConfigError(f"precision.initial_scale must be in [1, 2**127), got {self.initial_scale}")
    if self.growth_interval < 1:
      raise ConfigError(f"precision.growth_interval must be >= 1, got {self.growth_interval}")
    if not 1.0 < self.growth_factor < math.inf:  # written so that NaN fails too
      raise ConfigError(f"precision.growth_factor must be a finite number > 1, got {self.growth_factor}")
    if not 0.0 < self.backoff_factor < 1.0:
      raise ConfigError(f"precision.backoff_factor must be in (0, 1), got {self.backoff_factor}")
