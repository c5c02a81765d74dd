"""`jaxformer export --format hf`: a workdir's model as a Hugging Face Transformers directory.

The directory holds `config.json` (with our whole config under the key `jaxformer`, so an
import gives back the same run config), `generation_config.json`, `model.safetensors` and a
fast tokenizer (`tokenizer.json`, `tokenizer_config.json`, plus our `spiece.model`) that
`AutoTokenizer` loads. Which architecture a model maps to follows from its options:

| our model | Hugging Face |
|---|---|
| encoder_decoder, post-LN, sinusoidal, LayerNorm, ReLU/GELU (the paper's) | `MarianMTModel` |
| decoder_only, pre-LN, RoPE (not ntk), RMSNorm, SwiGLU, no or all attention biases | `LlamaForCausalLM` |
| the same with attention biases on query/key/value only, no FFN biases | `Qwen2ForCausalLM` |
| the same with a sliding window, no biases | `MistralForCausalLM` |
| decoder_only, pre-LN, learned positions, LayerNorm, GELU (exact or tanh), ReLU or SiLU | `GPT2LMHeadModel` |
| encoder_only, pre-LN, learned positions, LayerNorm, GELU | `XLMRobertaXLForMaskedLM` |

Anything else gets one line naming the options without a counterpart. The weights are
mapped by one invertible table per architecture (`links`), so the exported model computes
our function (logits equal to float rounding, tested) and importing it gives our params back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from jaxformer.config import Config, ConfigError, to_dict
from jaxformer.interop import hf_bert, hf_gpt2, hf_llama, hf_marian, hf_mistral, hf_qwen2
from jaxformer.interop import links as L
from jaxformer.interop.hf_tokenizer import save_tokenizer

# The first that fits a model is its export (`select_mapping`): Llama's variants come before it.
MAPPINGS: tuple[ModuleType, ...] = (hf_marian, hf_qwen2, hf_mistral, hf_llama, hf_gpt2, hf_bert)
CONFIG_KEY = "jaxformer"   # our run config inside config.json
EXPORT_FILE = "jaxformer_export.json"   # which workdir and step(s) an export holds


def select_mapping(config: Config, prefer: str | None = None) -> ModuleType:
  """The mapping module of `config`'s model (see the table in the module docstring): the one
  whose architecture is `prefer` (an imported model's own) if it fits, else the first that fits.

  Raises:
    ConfigError: no architecture fits; names the options of the closest one that do not.
  """
  experts = [f"model.num_experts={config.model.num_experts}"] if config.model.num_experts else []   # none maps them
  misses = [(experts + m.unsupported(config.model), m) for m in MAPPINGS]
  fitting = [m for bad, m in misses if not bad]
  if fitting:
    return next((m for m in fitting if m.ARCHITECTURE == prefer), fitting[0])
  bad, closest = min(misses, key=lambda x: len(x[0]))
  raise ConfigError(f"no Hugging Face counterpart for {', '.join(bad)} (closest architecture: "
                    f"{closest.ARCHITECTURE}); the export table is in jaxformer/interop/hf_export.py")


def hf_state(config: Config, params: Any) -> dict:
  """Our params (either layer layout) as the Hugging Face state dict of `select_mapping(config)`:
  `{name: float32 numpy array}`."""
  from jaxformer.models import layout  # noqa: PLC0415
  from jaxformer.tasks import get_task  # noqa: PLC0415
  model = get_task(config).make_model()
  if layout.is_scanned(params, layout.layer_stacks(model)):
    params = layout.unstack_layers(params, layout.layer_stacks(model))
  links, consts = select_mapping(config).links(config.model)
  return L.to_hf(links, consts, L.flatten(params))


def hf_model(config: Config, params: Any, prefer: str | None = None):
  """A float32 transformers model (eval mode) holding our params, of `select_mapping(config, prefer)`.

  Raises:
    ValueError: a tensor of the transformers model the mapping does not set (a mapping bug).
  """
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  mapping = select_mapping(config, prefer)
  hf_config = mapping.hf_config(config)
  hf_config.update({CONFIG_KEY: to_dict(config)})
  model = getattr(transformers, mapping.ARCHITECTURE)(hf_config).eval()
  state = model.state_dict()
  ours = hf_state(config, params)
  written = {state[name].data_ptr() for name in ours}
  missing = [k for k, v in state.items() if k not in ours and v.data_ptr() not in written
             and not k.endswith(getattr(mapping, "HF_COMPUTED", ()))]
  if missing:
    raise ValueError(f"the export mapping leaves {missing[:3]} of {mapping.ARCHITECTURE} unset")
  with torch.no_grad():
    for name, value in ours.items():
      if tuple(state[name].shape) != value.shape:
        raise ValueError(f"{name}: mapped shape {value.shape}, {mapping.ARCHITECTURE} has {tuple(state[name].shape)}")
      state[name].copy_(torch.from_numpy(np.array(value)))
  if mapping.generation(config.model):
    model.generation_config.update(**mapping.generation(config.model))
  return model


def export_params(config: Config, params: Any, tokenizer, out: str | Path,
                  origin: dict | None = None, prefer: str | None = None) -> dict[str, Any]:
  """Writes our model as a Hugging Face directory `out` (config, safetensors weights,
  generation config, tokenizer), under a temporary name renamed when complete.

  Args:
    config: the run config; params: its params (float32 pytree, either layer layout);
    tokenizer: the run's (shared) SentencePiece tokenizer.
    origin: written as `jaxformer_export.json` (which workdir and step), if given.
    prefer: the architecture to write when it fits (an imported model's own; see `select_mapping`).

  Returns:
    `{"out", "architecture", "files"}`: what was written.

  Raises:
    ConfigError: the model has no Hugging Face counterpart, or `out` exists.
  """
  out = Path(out)
  if out.exists():
    raise ConfigError(f"--out {out} already exists; remove it or pass another --out")
  mapping = select_mapping(config, prefer)
  model = hf_model(config, params, prefer)
  tmp = out.with_name(out.name + ".incomplete")
  shutil.rmtree(tmp, ignore_errors=True)
  model.save_pretrained(str(tmp))
  save_tokenizer(tokenizer, tmp, config.model.vocab_size, **mapping.TOKENIZER)
  if origin is not None:
    (tmp / EXPORT_FILE).write_text(json.dumps(origin) + "\n")
  tmp.rename(out)
  return {"out": str(out), "architecture": mapping.ARCHITECTURE, "files": sorted(p.name for p in out.iterdir())}


def export_workdir(workdir: str | Path, out: str | Path, step: int | None = None, average_last: int | None = None,
                   overrides=()) -> dict[str, Any]:
  """`jaxformer export --workdir DIR --format hf --out OUT [--step N | --average-last N]`:
  restores the workdir's params (`inference.restore`: the newest step, `step`, or the mean of
  the newest `average_last`) and writes them with `export_params`, as the architecture it was
  imported from (`imported.json`) when that still fits.

  Raises:
    ConfigError, CheckpointError: no mapping, `out` exists, no such checkpoint; one line each.
  """
  import jax  # noqa: PLC0415

  from jaxformer.inference import restore as inference_restore  # noqa: PLC0415
  if Path(out).exists():   # before reading any checkpoint
    raise ConfigError(f"--out {out} already exists; remove it or pass another --out")
  config = inference_restore.workdir_config(workdir, overrides)
  if not config.data.shared_vocab or config.data.tokenizer == "char":
    raise ConfigError("export needs one shared SentencePiece tokenizer; this workdir has "
                      + ("separate source and target vocabularies" if not config.data.shared_vocab
                         else "a character tokenizer (data.tokenizer=char)"))
  imported = Path(workdir) / "imported.json"   # hf_import.IMPORT_FILE (that module imports this one)
  prefer = json.loads(imported.read_text()).get("architecture") if imported.is_file() else None
  select_mapping(config)
  restored = inference_restore.restore(workdir, config, step, average_last)
  origin = {"workdir": str(Path(workdir).absolute()), "step": restored.step, "averaged_steps": restored.averaged}
  result = export_params(config, jax.device_get(restored.params), restored.tokenizer, out, origin, prefer)
  return {**result, **origin}
