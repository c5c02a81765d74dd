"""`jaxformer export --format hf --lora-format peft`: a LoRA workdir as a PEFT adapter directory.

`OUT/adapter_config.json` and `OUT/adapter_model.safetensors` are what `peft.PeftModel.from_pretrained(base,
OUT)` reads: a LoRA config (`r` = `model.lora_rank`, `lora_alpha`, `target_modules`, no dropout or
bias) and each adapted module's `base_model.model.<module>.lora_A.weight` `[r, in]` and
`lora_B.weight` `[out, r]`, PEFT computing `x W^T + (lora_alpha / r) x A^T B^T`, which is ours.
`OUT/base/` holds the frozen base model (the params without adapters) as a Hugging Face directory
(`hf_export.export_params`: config, weights, tokenizer), and `base_model_name_or_path` names it,
so the directory is complete on its own (`peft.AutoPeftModelForCausalLM.from_pretrained(OUT)`).

Module names come from the architecture's link table (`hf_llama.links`: our kernel
`layer_{i}/self_attention/query` is `model.layers.{i}.self_attn.q_proj.weight`). Our adapter of a kernel
`[*in, *out]` is A `[*in, r]`, B `[r, *out]`, and the Llama family stores that kernel as the Linear
weight `W.reshape(in, out)^T` (no permutation), so `lora_A = A.reshape(in, r)^T` and
`lora_B = B.reshape(r, out)^T` exactly. Only the Llama family (`ARCHITECTURES`) is written: GPT-2
fuses query, key and value into one `c_attn` Conv1D (separate adapters are no single PEFT LoRA of
it), Marian permutes d_model and BERT-style models are not causal LMs; export those merged.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.config import Config, ConfigError
from jaxformer.interop import links as L
from jaxformer.layers import lora

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_DIR = "base"  # the frozen base model, inside the adapter directory
PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's module names


def check_exportable(config: Config, prefer: str | None = None) -> None:
  """Raises ConfigError (one line) unless `config` is a LoRA model of the Llama family."""
  from jaxformer.interop.hf_export import select_mapping  # noqa: PLC0415  (that module imports this one)

  if not config.model.lora_rank:
    raise ConfigError(
      "--lora-format peft writes LoRA adapters, and this workdir has none (model.lora_rank=0); "
      "export without --lora-format"
    )
  architecture = select_mapping(config, prefer).ARCHITECTURE
  if architecture not in ARCHITECTURES:
    raise ConfigError(
      f"--lora-format peft is written for the Llama family ({', '.join(ARCHITECTURES)}), not "
      f"{architecture} (its projections do not map one to one onto PEFT's per-module LoRA); "
      "export with --lora-format merged"
    )


def peft_tensors(config: Config, params: Any, prefer: str | None = None) -> tuple[dict[str, np.ndarray], list[str]]:
  """`({PEFT tensor name: float32 array}, sorted target module names)` of a LoRA model's params
  (either layer layout).

  Raises:
    ConfigError: as `check_exportable`.
  """
  from jaxformer.interop.hf_export import select_mapping, unrolled  # noqa: PLC0415

  check_exportable(config, prefer)
  links, _ = select_mapping(config, prefer).links(config.model)
  modules = {link.ours[0]: link.hf.removesuffix(".weight") for link in links if len(link.ours) == 1}
  flat = L.flatten(lora.trainable(unrolled(config, params)))
  tensors, targets = {}, set()
  for path, a in flat.items():
    if not path.endswith(lora.SUFFIX_A):
      continue
    kernel = path.removesuffix(lora.SUFFIX_A)
    module, rank = modules[kernel], a.shape[-1]
    tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T)
    tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(flat[kernel + lora.SUFFIX_B].reshape(rank, -1).T)
    targets.add(module.rsplit(".", 1)[-1])
  return tensors, sorted(targets)


def adapter_config(config: Config, targets: list[str], base: str, architecture: str) -> dict[str, Any]:
  """The `adapter_config.json` fields of a LoRA model (PEFT's `LoraConfig`; the rest take PEFT's defaults)."""
  m = config.model
  alpha = int(m.lora_alpha) if float(m.lora_alpha).is_integer() else m.lora_alpha
  return {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": base,
    "r": m.lora_rank,
    "lora_alpha": alpha,
    "target_modules": targets,
    "lora_dropout": 0.0,
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "init_lora_weights": True,
    "inference_mode": True,
    "modules_to_save": None,
    "auto_mapping": {"base_model_class": architecture, "parent_library": "transformers"},
  }


def export_adapter(
  config: Config, params: Any, tokenizer, out: str | Path, origin: dict | None = None, prefer: str | None = None
) -> dict[str, Any]:
  """Writes the PEFT adapter directory `out` (see the module docstring) under a temporary name,
  renamed when complete; arguments as `hf_export.export_params`.

  Returns:
    `{"out", "architecture", "files", "base"}`: what was written.

  Raises:
    ConfigError: `out` exists, or as `check_exportable`.
  """
  from safetensors.numpy import save_file  # noqa: PLC0415

  from jaxformer.interop.hf_export import export_params, staged_dir  # noqa: PLC0415

  out = Path(out)
  if out.exists():
    raise ConfigError(f"--out {out} already exists; remove it or pass another --out")
  tensors, targets = peft_tensors(config, params, prefer)
  base_config = dataclasses.replace(config, model=dataclasses.replace(config.model, lora_rank=0))
  base = str((out / BASE_DIR).absolute())
  with staged_dir(out) as tmp:
    written = export_params(base_config, lora.without_adapters(params), tokenizer, tmp / BASE_DIR, origin, prefer)
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    settings = adapter_config(config, targets, base, written["architecture"])
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
  return {
    "out": str(out),
    "architecture": written["architecture"],
    "files": sorted(p.name for p in out.iterdir()),
    "base": base,
  }
