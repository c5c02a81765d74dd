"""A decoder-only model with RoPE, RMSNorm and a gated SiLU FFN as Hugging Face
`LlamaForCausalLM`; `hf_mistral` and `hf_qwen2` are the same table with their variants' options.

Our RoPE rotates dimension pairs (i, i + head_dim/2) by position * theta_i, which is Llama's
`rotate_half` convention, so queries and keys map without a permutation; `rope_parameters`
(theta, and the default, linear, dynamic, yarn and llama3 scalings) map to `model.rope_*`
(`layers.positions.RopeScaling` computes them as transformers does). Embeddings are not scaled in
Llama: an imported model has `model.embedding_scale=false`; one of ours with the paper's scaling
exports `embed_tokens` as ours times sqrt(d_model) and an untied `lm_head` holding our matrix.
"""

from __future__ import annotations

import numpy as np

from jaxformer.config import Config, ModelConfig
from jaxformer.interop import links as L
from jaxformer.tasks.causal_lm import CausalLM

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
TOKENIZER = {"add_eos": False}
ROPE_TYPES = {"default": "none", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}
YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1, "truncate": True}  # ours (layers.positions)


def unsupported(m: ModelConfig, attention_bias=("none", "all"), sliding_window: bool = False) -> list[str]:
  """`key=value` of each option of `m` Llama has no counterpart for (empty: it maps). The variants
  pass which `attention_bias` values and whether a sliding window they express."""
  wanted = {
    "kind": CausalLM.kind,
    "pre_norm": True,
    "position": "rope",
    "norm": "rmsnorm",
    "ffn": "swiglu",
    "attn_logit_softcap": 0.0,
    "global_tokens": 0,
    "embedding_norm": False,
    "type_vocab_size": 0,
  }
  return L.mismatches(
    m,
    wanted,
    {
      "attention_bias": m.attention_bias in attention_bias,
      "rope_scaling": m.rope_scaling != "ntk",
      # transformers' dynamic scaling counts from max_position_embeddings
      "rope_trained_length": m.rope_scaling != "dynamic" or m.rope_trained_length == m.max_length,
      "sliding_window": sliding_window or not m.sliding_window,
    },
  )


def rope_parameters(m: ModelConfig) -> dict:
  """transformers' `rope_parameters` of our `model.rope_*` (rope_scaling ntk has none)."""
  kind = {v: k for k, v in ROPE_TYPES.items()}[m.rope_scaling]
  out = {"rope_type": kind, "rope_theta": m.rope_theta}
  if kind != "default":
    out["factor"] = m.rope_scaling_factor
  if kind in ("yarn", "llama3"):
    out["original_max_position_embeddings"] = m.rope_trained_length or round(m.max_length / m.rope_scaling_factor)
  if kind == "llama3":
    out.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor)
  return out


def hf_config(config: Config, cls: str = "LlamaConfig", **extra):
  """The `transformers.LlamaConfig` (or a variant's `cls`, with its `extra` fields) of our model config."""
  import transformers  # noqa: PLC0415

  m = config.model
  if cls == "LlamaConfig":
    extra = {"attention_bias": m.attention_bias == "all", "mlp_bias": m.mlp_bias, **extra}
  return getattr(transformers, cls)(
    vocab_size=m.vocab_size,
    hidden_size=m.d_model,
    intermediate_size=m.d_ff,
    num_hidden_layers=m.num_decoder_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.kv_heads,
    head_dim=m.head_dim,
    hidden_act="silu",
    max_position_embeddings=m.max_length,
    rms_norm_eps=m.norm_epsilon,
    tie_word_embeddings=tied_in_hf(m),
    attention_dropout=m.attention_dropout_rate,
    pad_token_id=pad_token(m),
    bos_token_id=m.bos_id,
    eos_token_id=m.eos_id,
    rope_parameters=rope_parameters(m),
    architectures=[getattr(transformers, cls).__name__[:-6] + "ForCausalLM"],
    **extra,
  )


def pad_token(m: ModelConfig) -> int | None:
  """The model's pad id for Hugging Face: `model.pad_id`, None when it has none (-1)."""
  return m.pad_id if m.pad_id >= 0 else None


def generation(m: ModelConfig) -> dict:
  """generation_config.json fields: PAD, if the model has one, is never generated (our decoding excludes it)."""
  pad = pad_token(m)
  return {
    "bos_token_id": m.bos_id,
    "eos_token_id": m.eos_id,
    "pad_token_id": pad,
    "suppress_tokens": [] if pad is None else [pad],
    "max_length": m.max_length,
  }


def rope_options(hf) -> dict:
  """Our `model.rope_*` fields for a Llama-family config's `rope_parameters`.

  Raises:
    ValueError: a rope type or parameter jaxformer has no counterpart for (named in one line).
  """
  rope = dict(getattr(hf, "rope_parameters", None) or {})
  kind = rope.get("rope_type", "default")
  if kind not in ROPE_TYPES:
    raise ValueError(f"rope_type={kind} has no counterpart in jaxformer; supported: {', '.join(ROPE_TYPES)}")
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(
      f"partial_rotary_factor={rope['partial_rotary_factor']} has no counterpart in jaxformer "
      "(it rotates all of each head)"
    )
  factor = rope.get("factor") or 1.0
  original = rope.get("original_max_position_embeddings") or hf.max_position_embeddings
  if kind == "yarn":
    if rope.get("factor") is None:
      factor = hf.max_position_embeddings / original
    odd = {k: rope[k] for k, v in YARN_DEFAULTS.items() if rope.get(k) not in (None, v)}
    odd.update({k: rope[k] for k in ("attention_factor", "mscale", "mscale_all_dim") if rope.get(k) is not None})
    if odd:
      raise ValueError(
        f"yarn rope_parameters {odd} have no counterpart in jaxformer (it uses beta_fast=32, "
        "beta_slow=1, truncate=true and the attention factor 0.1 ln(factor) + 1)"
      )
  return dict(
    rope_theta=float(rope.get("rope_theta", 10000.0)),
    rope_scaling=ROPE_TYPES[kind],
    rope_scaling_factor=float(factor),
    rope_trained_length=int(hf.max_position_embeddings if kind == "dynamic" else original),
    rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
    rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
  )


def model_config(hf, attention_bias: str | None = None, sliding_window: int = 0) -> dict:
  """Our `model.*` fields for a `LlamaConfig` (a variant passes its `attention_bias` and window).

  Raises:
    ValueError: options jaxformer has no counterpart for (named in one line).
  """
  if hf.hidden_act != "silu":
    raise ValueError(f"hidden_act={hf.hidden_act} has no counterpart in jaxformer's Llama-family model (silu)")
  if attention_bias is None:
    attention_bias = "all" if hf.attention_bias else "none"
  head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
  return dict(
    kind=CausalLM.kind,
    vocab_size=hf.vocab_size,
    d_model=hf.hidden_size,
    num_heads=hf.num_attention_heads,
    attention_head_dim=0 if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim,
    num_kv_heads=hf.num_key_value_heads,
    d_ff=hf.intermediate_size,
    num_decoder_layers=hf.num_hidden_layers,
    attention_dropout_rate=hf.attention_dropout,
    dropout_rate=0.0,
    pre_norm=True,
    tie_embeddings=bool(hf.tie_word_embeddings),
    embedding_scale=False,
    max_length=hf.max_position_embeddings,
    position="rope",
    norm="rmsnorm",
    norm_epsilon=hf.rms_norm_eps,
    ffn="swiglu",
    mlp_bias=bool(getattr(hf, "mlp_bias", False)),
    attention_bias=attention_bias,
    sliding_window=sliding_window,
    pad_id=-1 if hf.pad_token_id is None else hf.pad_token_id,
    **rope_options(hf),
  )


def tied_in_hf(m: ModelConfig) -> bool:
  """Whether the Hugging Face model ties its input and output embeddings: ours tied and unscaled."""
  return m.tie_embeddings and not m.embedding_scale


def output_links(m: ModelConfig, embed: str, head: str, basis: L.Basis) -> list[L.Link]:
  """The token embedding (times sqrt(d_model) when ours are scaled: Hugging Face's are not) and the
  output layer `[vocab, d_model]`. Tied in Hugging Face too (`tied_in_hf`): the head is derived (a
  checkpoint may leave it out). Tied only in ours: the head link comes last, so an import reads the
  unscaled matrix exactly."""
  links = [L.embedding("embed/embedding", embed, basis, scale=float(np.sqrt(m.d_model)) if m.embedding_scale else 1.0)]
  if tied_in_hf(m):
    return links + [L.Link(("embed/embedding",), head, lambda w: basis.to_hf(w, 1), None)]
  if m.tie_embeddings:
    return links + [L.embedding("embed/embedding", head, basis)]
  return links + [L.Link(("output_proj",), head, lambda w: basis.to_hf(w.T, 1), lambda y: (basis.from_hf(y, 1).T,))]


def links(m: ModelConfig) -> tuple[list[L.Link], list[L.Const]]:
  """The tensor table of a `LlamaForCausalLM` state dict (Mistral's and Qwen2's are the same names)."""
  b = L.Basis()
  d, n, k, h, f = m.d_model, m.num_heads, m.kv_heads, m.head_dim, m.d_ff
  out = output_links(m, "model.embed_tokens.weight", "lm_head.weight", b)
  out.append(L.vector("final_norm/scale", "model.norm.weight", b))
  for i in range(m.num_decoder_layers):
    ours, hf = f"layer_{i}", f"model.layers.{i}"
    attn = f"{ours}/self_attention"
    out += [
      L.vector(f"{ours}/attention_sublayer/norm/scale", f"{hf}.input_layernorm.weight", b),
      L.linear_in(f"{attn}/query", f"{hf}.self_attn.q_proj.weight", b, (d, n, h)),
      L.linear_in(f"{attn}/key", f"{hf}.self_attn.k_proj.weight", b, (d, k, h)),
      L.linear_in(f"{attn}/value", f"{hf}.self_attn.v_proj.weight", b, (d, k, h)),
      L.linear_out(f"{attn}/out", f"{hf}.self_attn.o_proj.weight", b, (n, h, d)),
      L.vector(f"{ours}/ffn_sublayer/norm/scale", f"{hf}.post_attention_layernorm.weight", b),
      L.linear_in(f"{ours}/ffn/wi_gate", f"{hf}.mlp.gate_proj.weight", b, (d, f)),
      L.linear_in(f"{ours}/ffn/wi", f"{hf}.mlp.up_proj.weight", b, (d, f)),
      L.linear_out(f"{ours}/ffn/wo", f"{hf}.mlp.down_proj.weight", b, (f, d)),
    ]
    if m.attention_bias != "none":
      out += [
        L.reshaped(f"{attn}/{p}_bias", f"{hf}.self_attn.{p[0]}_proj.bias", shape)
        for p, shape in (("query", (n, h)), ("key", (k, h)), ("value", (k, h)))
      ]
    if m.attention_bias == "all":
      out.append(L.vector(f"{attn}/out_bias", f"{hf}.self_attn.o_proj.bias", b))
    if m.mlp_bias:
      out += [
        L.plain(f"{ours}/ffn/bi_gate", f"{hf}.mlp.gate_proj.bias"),
        L.plain(f"{ours}/ffn/bi", f"{hf}.mlp.up_proj.bias"),
        L.vector(f"{ours}/ffn/bo", f"{hf}.mlp.down_proj.bias", b),
      ]
  return out, []
