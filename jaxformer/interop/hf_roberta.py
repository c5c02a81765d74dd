"""A post-LN encoder-only masked LM as Hugging Face `RobertaForMaskedLM`: the `hf_bert_mlm`
table under RoBERTa's names, with learned positions offset by `pad_token_id + 1`
(`model.position_offset = model.pad_id + 1`) and the exact GELU (its LM head's, whatever
`hidden_act`). See `hf_bert_mlm` for the layout and what is refused.
"""

from __future__ import annotations

from jaxformer.config import Config, ModelConfig
from jaxformer.interop import hf_bert_mlm
from jaxformer.interop import links as L
from jaxformer.interop.hf_bert_mlm import TOKENIZER, generation  # noqa: F401  (the same settings)

MODEL_TYPE = "roberta"
ARCHITECTURE = "RobertaForMaskedLM"
HF_UNUSED = ("lm_head.bias",)  # tied to the decoder's bias; never read when untied (see hf_bert_mlm)
HEAD = {"dense": "lm_head.dense", "norm": "lm_head.layer_norm", "decoder": "lm_head.decoder", "bias": "lm_head.bias"}


def unsupported(m: ModelConfig) -> list[str]:
  """`key=value` of each option of `m` RoBERTa has no counterpart for (empty: it maps)."""
  bad = [] if m.pad_id >= 0 else [f"model.pad_id={m.pad_id}"]  # RoBERTa's positions count from it
  return bad + hf_bert_mlm.unsupported(m, offset=max(m.pad_id, 0) + 1, activations=("gelu",))


def hf_config(config: Config):
  """The `transformers.RobertaConfig` of our model config."""
  m = config.model
  return hf_bert_mlm.hf_config(config, "RobertaConfig", max_positions=m.max_length + m.position_offset)


def model_config(hf) -> dict:
  """Our `model.*` fields for a `RobertaConfig`.

  Raises:
    ValueError: options jaxformer has no counterpart for (named in one line).
  """
  if hf.pad_token_id is None:
    raise ValueError(
      "this RoBERTa model has pad_token_id=None; its positions count from pad_token_id + 1, so jaxformer needs one"
    )
  return hf_bert_mlm.model_config(hf, "RoBERTa", offset=hf.pad_token_id + 1, activations=("gelu", "gelu_python"))


def links(m: ModelConfig) -> tuple[list[L.Link], list]:
  """The tensor table of a `RobertaForMaskedLM` state dict (`hf_bert_mlm.links` under RoBERTa's names)."""
  return hf_bert_mlm.links(m, "roberta", HEAD)
