"""`jaxformer import --from-hf DIR --workdir NEW`: a local Hugging Face directory of a supported
architecture (see `hf_export`) as a jaxformer workdir that `eval`, `translate`, `generate`
and `train` (fine-tuning) read.

The workdir holds `config.yaml` (the exporting run's config when `config.json` carries it,
else the architecture's options on the default config: set the data keys when training),
`tokenizer.model` (the directory's SentencePiece model), `imported.json` (where from) and one
checkpoint at step 0: the imported params with a fresh optimizer state, so `jaxformer train
--config NEW/config.yaml --workdir NEW` continues from them. Every imported tensor is checked
by mapping the params back: a checkpoint holding anything our model has no counterpart for (a
nonzero attention bias, another LM-head transform) is refused in one line. Nothing downloads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.config import Config, ConfigError, DataConfig, config_from_dict, dump_config
from jaxformer.interop import links as L
from jaxformer.interop.hf_export import CONFIG_KEY, MAPPINGS
from jaxformer.interop.hf_tokenizer import load_tokenizer

IMPORT_FILE = "imported.json"


def read_hf(hf_dir: str | Path) -> tuple[Config, dict[str, np.ndarray]]:
  """Our config and the float32 state dict (`{name: numpy array}`) of a Hugging Face directory.

  Raises:
    ConfigError: not a directory with `config.json`, or an architecture with no mapping.
    ValueError: options of the architecture jaxformer has no counterpart for.
  """
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  path = Path(hf_dir) / "config.json"
  if not path.is_file():
    raise ConfigError(f"{path} is missing; --from-hf takes a local Hugging Face model directory")
  raw = json.loads(path.read_text())
  by_type = {m.MODEL_TYPE: m for m in MAPPINGS}
  mapping = by_type.get(raw.get("model_type"))
  if mapping is None:
    raise ConfigError(f"{hf_dir} holds a {raw.get('model_type')!r} model; import supports "
                      f"{', '.join(m.ARCHITECTURE for m in MAPPINGS)}")
  hf_config = transformers.AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
  if CONFIG_KEY in raw:
    config = config_from_dict(raw[CONFIG_KEY])
  else:
    model = mapping.model_config(hf_config)
    length = min(DataConfig.max_length, model["max_length"])
    buckets = [b for b in DataConfig.buckets if b < length] + [length]
    config = config_from_dict({"name": Path(hf_dir).name, "model": model,
                               "data": {"max_length": length, "buckets": buckets}})
  model = getattr(transformers, mapping.ARCHITECTURE).from_pretrained(str(hf_dir), dtype=torch.float32,
                                                                      local_files_only=True)
  return config, {k: v.detach().numpy() for k, v in model.state_dict().items()}


def params_from_hf(config: Config, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Our params (nested dict of float32 numpy arrays, the config's layer layout) from a
  Hugging Face state dict, checked by mapping them back (see the module docstring).

  Raises:
    ValueError: a tensor is missing or holds what our model cannot express (one line).
  """
  from jaxformer.interop.hf_export import select_mapping  # noqa: PLC0415
  links, consts = select_mapping(config).links(config.model)
  flat = L.from_hf(links, consts, tensors)
  for name, again in L.to_hf(links, consts, flat).items():
    if name not in tensors and any(link.hf == name and link.from_hf is None for link in links):
      continue   # a derived tensor the checkpoint leaves out (a tied head)
    if not np.allclose(again, tensors.get(name, np.zeros_like(again)), rtol=1e-5, atol=1e-6):
      raise ValueError(f"{name} has values jaxformer's {config.model.kind} model cannot express exactly; "
                       "this checkpoint cannot be imported")
  params = L.unflatten(flat)
  if config.model.scan_layers:
    from jaxformer.models import layout  # noqa: PLC0415
    from jaxformer.tasks import get_task  # noqa: PLC0415
    params = layout.stack_layers(params, layout.layer_stacks(get_task(config).make_model()))
  return params


def write_workdir(config: Config, params: Any, tokenizer, workdir: str | Path, origin: dict) -> Path:
  """Writes a workdir (see the module docstring) under a temporary name, renamed when complete.

  Raises:
    ConfigError: `workdir` exists.
  """
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from jaxformer import checkpoint as ckpt  # noqa: PLC0415
  from jaxformer.precision import initial_loss_scale  # noqa: PLC0415
  from jaxformer.train.optim import make_optimizer  # noqa: PLC0415
  from jaxformer.train.state import TrainState  # noqa: PLC0415
  workdir = Path(workdir)
  if workdir.exists():
    raise ConfigError(f"--workdir {workdir} already exists; import writes a new workdir")
  tmp = workdir.with_name(workdir.name + ".incomplete")
  shutil.rmtree(tmp, ignore_errors=True)
  ckpt.save_run_files(tmp, dump_config(config), tokenizer.serialized)
  (tmp / IMPORT_FILE).write_text(json.dumps(origin) + "\n")
  params = jax.tree.map(jnp.asarray, params)
  tx = make_optimizer(config.optim, config.model.d_model)
  state = TrainState(jnp.array(0, jnp.int32), params, tx.init(params), initial_loss_scale(config.precision.start_scale))
  saver = ckpt.Checkpointer(tmp, async_save=False)
  saver.save(state, force=True)
  saver.close()
  tmp.rename(workdir)
  return workdir


def import_hf(hf_dir: str | Path, workdir: str | Path) -> dict[str, Any]:
  """`jaxformer import`: reads `hf_dir` and writes the workdir `workdir`.

  Returns:
    `{"workdir", "architecture", "from_hf"}`.

  Raises:
    ConfigError, ValueError, FileNotFoundError: one line naming the problem.
  """
  if Path(workdir).exists():   # before reading any weights
    raise ConfigError(f"--workdir {workdir} already exists; import writes a new workdir")
  config, tensors = read_hf(hf_dir)
  params = params_from_hf(config, tensors)
  tokenizer = load_tokenizer(hf_dir)
  from jaxformer.interop.hf_export import select_mapping  # noqa: PLC0415
  architecture = select_mapping(config).ARCHITECTURE
  origin = {"from_hf": str(Path(hf_dir).absolute()), "architecture": architecture}
  write_workdir(config, params, tokenizer, workdir, origin)
  return {"workdir": str(workdir), **origin}
