"""A Llama-family model with a sliding attention window as Hugging Face `MistralForCausalLM`:
the `hf_llama` table, without attention or FFN biases; `sliding_window` (tokens, the query
included, as ours) maps to `model.sliding_window` (null: 0, all tokens).
"""

from __future__ import annotations

from jaxformer.config import Config, ModelConfig
from jaxformer.interop import hf_llama
from jaxformer.interop.hf_llama import TOKENIZER, generation, links  # noqa: F401  (the same table and settings)

MODEL_TYPE = "mistral"
ARCHITECTURE = "MistralForCausalLM"


def unsupported(m: ModelConfig) -> list[str]:
  """`key=value` of each option of `m` Mistral has no counterpart for (empty: it maps)."""
  return hf_llama.unsupported(m, attention_bias=("none",), sliding_window=True) + (
    [f"model.mlp_bias={m.mlp_bias}"] if m.mlp_bias else []
  )


def hf_config(config: Config):
  """The `transformers.MistralConfig` of our model config."""
  return hf_llama.hf_config(config, "MistralConfig", sliding_window=config.model.sliding_window or None)


def model_config(hf) -> dict:
  """Our `model.*` fields for a `MistralConfig` (raises ValueError as `hf_llama.model_config`)."""
  return hf_llama.model_config(hf, attention_bias="none", sliding_window=hf.sliding_window or 0)
