"""A decoder-only model with RoPE, RMSNorm, SwiGLU and grouped-query attention as Hugging Face
`LlamaForCausalLM` (pre-LN, final RMSNorm, `mlp_bias=True` for our FFN biases).

Our RoPE rotates dimension pairs (i, i + head_dim/2) by position * 10000^(-2i/head_dim),
which is Llama's `rotate_half` convention, so queries and keys map without a permutation.
Llama does not scale embeddings: `embed_tokens` holds ours times sqrt(d_model), and the
output layer (`lm_head`, untied in Hugging Face) holds our unscaled (tied or untied) matrix.
"""

from __future__ import annotations

import numpy as np

from jaxformer.config import Config, ModelConfig
from jaxformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from jaxformer.interop import links as L

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
TOKENIZER = {"add_eos": False}
EPSILON = 1e-6   # our RMSNorm's


def unsupported(m: ModelConfig) -> list[str]:
  """`key=value` of each option of `m` Llama has no counterpart for (empty: it maps)."""
  wanted = {"kind": "decoder_only", "pre_norm": True, "position": "rope", "norm": "rmsnorm", "ffn": "swiglu",
            "attn_logit_softcap": 0.0, "sliding_window": 0}
  return [f"model.{k}={getattr(m, k)}" for k, v in wanted.items() if getattr(m, k) != v]


def hf_config(config: Config):
  """The `transformers.LlamaConfig` of our model config."""
  import transformers  # noqa: PLC0415
  m = config.model
  return transformers.LlamaConfig(
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff, num_hidden_layers=m.num_decoder_layers,
      num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim, hidden_act="silu",
      max_position_embeddings=m.max_length, rms_norm_eps=EPSILON, tie_word_embeddings=False, attention_bias=False,
      mlp_bias=True, attention_dropout=m.attention_dropout_rate, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
      eos_token_id=EOS_ID, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
      architectures=[ARCHITECTURE])


def generation(m: ModelConfig) -> dict:
  """generation_config.json fields: PAD is never generated (our decoding excludes it)."""
  return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "suppress_tokens": [PAD_ID],
          "max_length": m.max_length}


def model_config(hf) -> dict:
  """Our `model.*` fields for a `LlamaConfig`.

  Raises:
    ValueError: options jaxformer has no counterpart for (named in one line).
  """
  rope = getattr(hf, "rope_parameters", None) or {}
  head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
  bad = [f"{k}={v}" for k, v, ok in (
      ("hidden_act", hf.hidden_act, hf.hidden_act == "silu"),
      ("rope_parameters", rope, rope.get("rope_type", "default") == "default" and rope.get("rope_theta", 1e4) == 1e4),
      ("attention_bias", hf.attention_bias, not hf.attention_bias),
      ("head_dim", head_dim, head_dim * hf.num_attention_heads == hf.hidden_size)) if not ok]
  if bad:
    raise ValueError(f"this Llama model has options jaxformer has no counterpart for: {', '.join(bad)}")
  return dict(kind="decoder_only", vocab_size=hf.vocab_size, d_model=hf.hidden_size, num_heads=hf.num_attention_heads,
              num_kv_heads=hf.num_key_value_heads, d_ff=hf.intermediate_size, num_decoder_layers=hf.num_hidden_layers,
              attention_dropout_rate=hf.attention_dropout, pre_norm=True, tie_embeddings=False,
              max_length=hf.max_position_embeddings, position="rope", norm="rmsnorm", ffn="swiglu")


def output_links(m: ModelConfig, embed: str, head: str, basis: L.Basis) -> list[L.Link]:
  """The token embedding (times sqrt(d_model): Hugging Face does not scale) and the output
  layer `[vocab, d_model]`; for tied models the output link comes last, so an import reads
  the unscaled matrix exactly."""
  links = [L.embedding("embed/embedding", embed, basis, scale=float(np.sqrt(m.d_model)))]
  if m.tie_embeddings:
    return links + [L.embedding("embed/embedding", head, basis)]
  return links + [L.Link(("output_proj",), head, lambda w: basis.to_hf(w.T, 1), lambda y: (basis.from_hf(y, 1).T,))]


def links(m: ModelConfig) -> tuple[list[L.Link], list[L.Const]]:
  """The tensor table of a `LlamaForCausalLM` state dict (see `links`)."""
  b = L.Basis()
  d, n, k, h, f = m.d_model, m.num_heads, m.kv_heads, m.head_dim, m.d_ff
  out = output_links(m, "model.embed_tokens.weight", "lm_head.weight", b)
  out.append(L.vector("final_norm/scale", "model.norm.weight", b))
  for i in range(m.num_decoder_layers):
    ours, hf = f"layer_{i}", f"model.layers.{i}"
    out += [L.vector(f"{ours}/attention_sublayer/norm/scale", f"{hf}.input_layernorm.weight", b),
            L.linear_in(f"{ours}/self_attention/query", f"{hf}.self_attn.q_proj.weight", b, (d, n, h)),
            L.linear_in(f"{ours}/self_attention/key", f"{hf}.self_attn.k_proj.weight", b, (d, k, h)),
            L.linear_in(f"{ours}/self_attention/value", f"{hf}.self_attn.v_proj.weight", b, (d, k, h)),
            L.linear_out(f"{ours}/self_attention/out", f"{hf}.self_attn.o_proj.weight", b, (n, h, d)),
            L.vector(f"{ours}/ffn_sublayer/norm/scale", f"{hf}.post_attention_layernorm.weight", b),
            L.linear_in(f"{ours}/ffn/wi_gate", f"{hf}.mlp.gate_proj.weight", b, (d, f)),
            L.plain(f"{ours}/ffn/bi_gate", f"{hf}.mlp.gate_proj.bias", (f,)),   # absent: mlp_bias=False
            L.linear_in(f"{ours}/ffn/wi", f"{hf}.mlp.up_proj.weight", b, (d, f)),
            L.plain(f"{ours}/ffn/bi", f"{hf}.mlp.up_proj.bias", (f,)),
            L.linear_out(f"{ours}/ffn/wo", f"{hf}.mlp.down_proj.weight", b, (f, d)),
            L.plain(f"{ours}/ffn/bo", f"{hf}.mlp.down_proj.bias", (d,))]
  return out, []
