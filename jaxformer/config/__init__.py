"""The run configuration: typed, validated frozen dataclasses from YAML plus dotted `a.b=c` overrides.

Loaded and checked before JAX is imported. The modules: `loader` (the run's sections and
`load_config`), `schema` (dicts to dataclasses and back), `model` and `mesh` (those sections),
`options` (checks of the model's architecture options), `policy` (the mixed-precision policy
and the `precision` section).
The names below are the public ones: `from jaxformer.config import load_config, Config, ConfigError`.
"""

from jaxformer.config.loader import (
  PLATFORMS,
  Config,
  DataConfig,
  OptimConfig,
  RuntimeConfig,
  TrainConfig,
  check_directory,
  config_from_dict,
  dump_config,
  load_config,
  runtime_from_overrides,
  to_dict,
)
from jaxformer.config.mesh import MeshConfig
from jaxformer.config.model import ModelConfig
from jaxformer.config.policy import PrecisionConfig
from jaxformer.config.schema import parse_override
from jaxformer.errors import ConfigError

__all__ = [
  "PLATFORMS",
  "Config",
  "ConfigError",
  "DataConfig",
  "MeshConfig",
  "ModelConfig",
  "OptimConfig",
  "PrecisionConfig",
  "RuntimeConfig",
  "TrainConfig",
  "check_directory",
  "config_from_dict",
  "dump_config",
  "load_config",
  "parse_override",
  "runtime_from_overrides",
  "to_dict",
]
