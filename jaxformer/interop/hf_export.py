"""`jaxformer export --format hf`: a workdir's model as a Hugging Face Transformers directory.

The directory holds `config.json` (with our whole config under the key `jaxformer`, so an
import gives back the same run config), `generation_config.json`, `model.safetensors` and a
fast tokenizer (`tokenizer.json`, `tokenizer_config.json`, plus our `spiece.model`) that
`AutoTokenizer` loads. Which architecture a model maps to follows from its options:

| our model | Hugging Face |
|---|---|
| encoder_decoder, post-LN, sinusoidal, LayerNorm, ReLU/GELU/SiLU (the paper's; published Marian) | `MarianMTModel` |
| encoder_decoder, pre-LN, t5 bias, RMSNorm, no biases, unscaled embeddings | `T5ForConditionalGeneration` |
| decoder_only, pre-LN, RoPE (not ntk), RMSNorm, SwiGLU, no or all attention biases | `LlamaForCausalLM` |
| the same with attention biases on query/key/value only, no FFN biases | `Qwen2ForCausalLM` |
| the same with a sliding window, no biases | `MistralForCausalLM` |
| decoder_only, pre-LN, learned positions, LayerNorm, GELU (exact or tanh), ReLU or SiLU | `GPT2LMHeadModel` |
| encoder_only, pre-LN, learned positions, LayerNorm, GELU | `XLMRobertaXLForMaskedLM` |
| encoder_only, post-LN, learned positions, embedding LayerNorm, token types, MLM head, biases | `BertForMaskedLM` |
| the same with positions offset by pad_id + 1 and the exact GELU | `RobertaForMaskedLM` |

A LoRA model (`model.lora_rank` > 0) exports merged: each adapter folded into its kernel
(`layers.lora.merge_params`), a plain model of the architecture above with no LoRA params;
`--lora-format peft` writes a PEFT adapter directory instead (`interop/hf_peft.py`).

Anything else gets one line naming the options without a counterpart. The weights are
mapped by one invertible table per architecture (`links`), so the exported model computes
our function (logits equal to float rounding, tested) and importing it gives our params back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from jaxformer.config import Config, ConfigError, to_dict
from jaxformer.interop import (
  hf_bert,
  hf_bert_mlm,
  hf_gpt2,
  hf_llama,
  hf_marian,
  hf_mistral,
  hf_qwen2,
  hf_roberta,
  hf_t5,
)
from jaxformer.interop import links as L
from jaxformer.interop.hf_tokenizer import save_tokenizer

# The first that fits a model is its export (`select_mapping`): Llama's variants come before it.
MAPPINGS: tuple[ModuleType, ...] = (
  hf_marian,
  hf_t5,
  hf_qwen2,
  hf_mistral,
  hf_llama,
  hf_gpt2,
  hf_bert,
  hf_bert_mlm,
  hf_roberta,
)
CONFIG_KEY = "jaxformer"  # our run config inside config.json
EXPORT_FILE = "jaxformer_export.json"  # which workdir and step(s) an export holds


def select_mapping(config: Config, prefer: str | None = None) -> ModuleType:
  """The mapping module of `config`'s model (see the table in the module docstring): the one
  whose architecture is `prefer` (an imported model's own) if it fits, else the first that fits.

  Raises:
    ConfigError: no architecture fits; names the options of the closest one that do not.
  """
  experts = [f"model.num_experts={config.model.num_experts}"] if config.model.num_experts else []  # none maps them
  misses = [(experts + m.unsupported(config.model), m) for m in MAPPINGS]
  fitting = [m for bad, m in misses if not bad]
  if fitting:
    return next((m for m in fitting if m.ARCHITECTURE == prefer), fitting[0])
  bad, closest = min(misses, key=lambda x: len(x[0]))
  raise ConfigError(
    f"no Hugging Face counterpart for {', '.join(bad)} (closest architecture: "
    f"{closest.ARCHITECTURE}); the export table is in jaxformer/interop/hf_export.py"
  )


def merged(config: Config, params: Any) -> tuple[Config, Any]:
  """`(config, params)` of the plain model a LoRA model's merged params make (`model.lora_rank=0`,
  `W + (alpha / r) A B`, no adapters); a model without LoRA comes back as it is."""
  from jaxformer.layers.lora import merge_params  # noqa: PLC0415

  m = config.model
  if not m.lora_rank:
    return config, params
  return (
    dataclasses.replace(config, model=dataclasses.replace(m, lora_rank=0)),
    merge_params(params, m.lora_alpha / m.lora_rank),
  )


def unrolled(config: Config, params: Any) -> Any:
  """`config`'s model params (either layer layout) in the unrolled layout the link tables name."""
  from jaxformer.models import layout  # noqa: PLC0415
  from jaxformer.tasks import get_task  # noqa: PLC0415

  stacks = layout.layer_stacks(get_task(config).make_model())
  return layout.unstack_layers(params, stacks) if layout.is_scanned(params, stacks) else params


def hf_state(config: Config, params: Any) -> dict:
  """Our params (either layer layout; LoRA adapters merged) as the Hugging Face state dict of
  `select_mapping(config)`: `{name: float32 numpy array}`."""
  config, params = merged(config, params)
  links, consts = select_mapping(config).links(config.model)
  return L.to_hf(links, consts, L.flatten(unrolled(config, params)))


def hf_model(config: Config, params: Any, prefer: str | None = None):
  """A float32 transformers model (eval mode) holding our params (LoRA adapters merged), of
  `select_mapping(config, prefer)`.

  Raises:
    ValueError: a tensor of the transformers model the mapping does not set (a mapping bug).
  """
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  config, params = merged(config, params)
  mapping = select_mapping(config, prefer)
  hf_config = mapping.hf_config(config)
  hf_config.update({CONFIG_KEY: to_dict(config)})
  model = getattr(transformers, mapping.ARCHITECTURE)(hf_config).eval()
  if hasattr(mapping, "prepare"):  # T5: a head of its own where transformers ties it
    mapping.prepare(model, config.model)
  state = model.state_dict()
  ours = hf_state(config, params)
  written = {state[name].data_ptr() for name in ours}
  unset = getattr(mapping, "HF_COMPUTED", ()) + getattr(mapping, "HF_UNUSED", ())  # buffers; tensors never read
  missing = [k for k, v in state.items() if k not in ours and v.data_ptr() not in written and not k.endswith(unset)]
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


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
  """Yields `OUT.incomplete` to write into, renamed to `out` when the block completes; removed
  if it raises, so a failed export leaves nothing that looks like a model directory."""
  tmp = out.with_name(out.name + ".incomplete")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  try:
    yield tmp
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  tmp.rename(out)


def export_params(
  config: Config, params: Any, tokenizer, out: str | Path, origin: dict | None = None, prefer: str | None = None
) -> dict[str, Any]:
  """Writes our model as a Hugging Face directory `out` (config, safetensors weights,
  generation config, tokenizer), under a temporary name renamed when complete.

  Args:
    config: the run config; params: its params (float32 pytree, either layer layout);
    tokenizer: the run's (shared) SentencePiece tokenizer, or its `HFTokenizer` (`data.tokenizer=hf`) or
      target-side `MarianTokenizer` (`data.tokenizer=marian`).
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
  with staged_dir(out) as tmp:
    model.save_pretrained(str(tmp))
    if config.data.tokenizer in ("hf", "marian"):  # a published model's own tokenizer goes back as it came
      tokenizer.save(tmp)
    else:
      save_tokenizer(tokenizer, tmp, config.model.vocab_size, **mapping.TOKENIZER)
    if origin is not None:
      (tmp / EXPORT_FILE).write_text(json.dumps(origin) + "\n")
  return {"out": str(out), "architecture": mapping.ARCHITECTURE, "files": sorted(p.name for p in out.iterdir())}


def export_workdir(
  workdir: str | Path,
  out: str | Path,
  step: int | None = None,
  average_last: int | None = None,
  overrides=(),
  lora_format: str = "merged",
) -> dict[str, Any]:
  """`jaxformer export --workdir DIR --format hf --out OUT [--step N | --average-last N] [--lora-format F]`:
  restores the workdir's params (`inference.restore`: the newest step, `step`, or the mean of
  the newest `average_last`) and writes them with `export_params`, as the architecture it was
  imported from (`imported.json`) when that still fits. A LoRA workdir's adapters are merged
  (`lora_format="merged"`), or written as a PEFT adapter directory (`"peft"`, `interop.hf_peft`).

  Raises:
    ConfigError, CheckpointError: no mapping, `out` exists, no such checkpoint, `peft` for a
      workdir without LoRA or of another architecture than the Llama family; one line each.
  """
  import jax  # noqa: PLC0415

  from jaxformer.inference import restore as inference_restore  # noqa: PLC0415

  if Path(out).exists():  # before reading any checkpoint
    raise ConfigError(f"--out {out} already exists; remove it or pass another --out")
  config = inference_restore.workdir_config(workdir, overrides)
  if not config.data.shared_vocab or config.data.tokenizer == "char":
    raise ConfigError(
      "export needs one shared SentencePiece or Hugging Face tokenizer; this workdir has "
      + (
        "separate source and target vocabularies"
        if not config.data.shared_vocab
        else "a character tokenizer (data.tokenizer=char)"
      )
    )
  imported = Path(workdir) / "imported.json"  # hf_import.IMPORT_FILE (that module imports this one)
  prefer = json.loads(imported.read_text()).get("architecture") if imported.is_file() else None
  select_mapping(config)
  write = export_params
  if lora_format == "peft":
    from jaxformer.interop import hf_peft  # noqa: PLC0415

    hf_peft.check_exportable(config, prefer)
    write = hf_peft.export_adapter
  restored = inference_restore.restore(workdir, config, step, average_last)
  origin = {"workdir": str(Path(workdir).absolute()), "step": restored.step, "averaged_steps": restored.averaged}
  result = write(config, jax.device_get(restored.params), restored.tokenizer, out, origin, prefer)
  return {**result, **origin}
