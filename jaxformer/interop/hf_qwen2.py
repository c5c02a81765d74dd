"""A Llama-family model with query/key/value biases as Hugging Face `Qwen2ForCausalLM`: the
`hf_llama` table with `model.attention_bias=qkv` and no FFN biases. Qwen2's optional sliding
window (`use_sliding_window`, on some layers only) has no counterpart and is refused.
"""

from __future__ import annotations

from jaxformer.config import Config, ModelConfig
from jaxformer.interop import hf_llama
from jaxformer.interop.hf_llama import TOKENIZER, generation, links  # noqa: F401  (the same table and settings)

MODEL_TYPE = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"


def unsupported(m: ModelConfig) -> list[str]:
  """`key=value` of each option of `m` Qwen2 has no counterpart for (empty: it maps)."""
  return hf_llama.unsupported(m, attention_bias=("qkv",)) + ([f"model.mlp_bias={m.mlp_bias}"] if m.mlp_bias else [])


def hf_config(config: Config):
  """The `transformers.Qwen2Config` of our model config."""
  return hf_llama.hf_config(config, "Qwen2Config", use_sliding_window=False)


def model_config(hf) -> dict:
  """Our `model.*` fields for a `Qwen2Config`.

  Raises:
    ValueError: `use_sliding_window=true`, or options as `hf_llama.model_config` refuses.
  """
  if getattr(hf, "use_sliding_window", False):
    raise ValueError("use_sliding_window=true (a window on some of Qwen2's layers) has no counterpart in jaxformer")
  return hf_llama.model_config(hf, attention_bias="qkv")
