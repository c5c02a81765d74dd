"""A decoder-only model with learned positions, LayerNorm and GELU as Hugging Face
`GPT2LMHeadModel` (pre-LN, final LayerNorm `ln_f`).

GPT-2 keeps its kernels as `Conv1D` `[in, out]` (our orientation) and fuses the query, key
and value kernels (and biases) into `c_attn`. An imported GPT-2 has `model.attention_bias=all`,
its activation (`gelu_new`: `model.ffn=gelu_tanh`), LayerNorm epsilon and tied, unscaled
embeddings; one of ours without attention biases exports them as zeros, and with the paper's
embedding scale as `wte` = ours times sqrt(d_model) and an untied `lm_head` (`hf_llama.output_links`).
"""

from __future__ import annotations

import numpy as np

from jaxformer.config import Config, ModelConfig
from jaxformer.interop import links as L
from jaxformer.interop.hf_llama import generation, output_links, pad_token, tied_in_hf  # noqa: F401  (generation: the same)
from jaxformer.tasks.causal_lm import CausalLM

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
TOKENIZER = {"add_eos": False}
HF_COMPUTED = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older GPT-2 code
# transformers' activation_function -> our model.ffn (gelu_new and gelu_pytorch_tanh are both the tanh GELU)
ACTIVATIONS = {
  "gelu": "gelu",
  "gelu_new": "gelu_tanh",
  "gelu_pytorch_tanh": "gelu_tanh",
  "relu": "relu",
  "silu": "silu",
  "swish": "silu",
}


def unsupported(m: ModelConfig) -> list[str]:
  """`key=value` of each option of `m` GPT-2 has no counterpart for (empty: it maps)."""
  wanted = {
    "kind": CausalLM.kind,
    "pre_norm": True,
    "position": "learned",
    "norm": "layernorm",
    "attn_logit_softcap": 0.0,
    "sliding_window": 0,
    "mlp_bias": True,
    "embedding_norm": False,
    "type_vocab_size": 0,
    "position_offset": 0,
  }
  return L.mismatches(
    m,
    wanted,
    {
      "ffn": m.ffn in ACTIVATIONS.values(),
      "attention_bias": m.attention_bias != "qkv",
      "num_kv_heads": m.kv_heads == m.num_heads,
      "attention_head_dim": m.head_dim * m.num_heads == m.d_model,
    },
  )


def hf_config(config: Config):
  """The `transformers.GPT2Config` of our model config."""
  import transformers  # noqa: PLC0415

  m = config.model
  return transformers.GPT2Config(
    vocab_size=m.vocab_size,
    n_positions=m.max_length,
    n_embd=m.d_model,
    n_layer=m.num_decoder_layers,
    n_head=m.num_heads,
    n_inner=m.d_ff,
    activation_function={v: k for k, v in ACTIVATIONS.items()}[m.ffn],
    resid_pdrop=m.dropout_rate,
    embd_pdrop=m.dropout_rate,
    attn_pdrop=m.attention_dropout_rate,
    layer_norm_epsilon=m.norm_epsilon,
    tie_word_embeddings=tied_in_hf(m),
    bos_token_id=m.bos_id,
    eos_token_id=m.eos_id,
    pad_token_id=pad_token(m),
    architectures=[ARCHITECTURE],
  )


def model_config(hf) -> dict:
  """Our `model.*` fields for a `GPT2Config`.

  Raises:
    ValueError: options jaxformer has no counterpart for (named in one line).
  """
  bad = [
    f"{k}={getattr(hf, k)}"
    for k, ok in (
      ("activation_function", hf.activation_function in ACTIVATIONS),
      ("scale_attn_weights", hf.scale_attn_weights),
      ("scale_attn_by_inverse_layer_idx", not hf.scale_attn_by_inverse_layer_idx),
      ("add_cross_attention", not hf.add_cross_attention),
    )
    if not ok
  ]
  if bad:
    raise ValueError(f"this GPT-2 model has options jaxformer has no counterpart for: {', '.join(bad)}")
  return dict(
    kind=CausalLM.kind,
    vocab_size=hf.vocab_size,
    d_model=hf.n_embd,
    num_heads=hf.n_head,
    d_ff=hf.n_inner or 4 * hf.n_embd,
    num_decoder_layers=hf.n_layer,
    dropout_rate=hf.resid_pdrop,
    attention_dropout_rate=hf.attn_pdrop,
    pre_norm=True,
    tie_embeddings=bool(hf.tie_word_embeddings),
    embedding_scale=False,
    max_length=hf.n_positions,
    position="learned",
    norm="layernorm",
    norm_epsilon=hf.layer_norm_epsilon,
    ffn=ACTIVATIONS[hf.activation_function],
    attention_bias="all",
    pad_id=-1 if hf.pad_token_id is None else hf.pad_token_id,
  )


def _fused(*shape: int) -> tuple:
  """GPT-2's `c_attn` (kernel `[d_model, 3 * d_model]` or bias `[3 * d_model]`) from our query, key
  and value tensors of `shape` (`[d_model, heads, head_dim]` or `[heads, head_dim]`), and back."""

  def to_hf(q, k, v):
    return np.concatenate([w.reshape(*shape[:-2], -1) for w in (q, k, v)], axis=-1)

  def from_hf(y):
    return tuple(w.reshape(shape) for w in np.split(y, 3, axis=-1))

  return to_hf, from_hf


def links(m: ModelConfig) -> tuple[list[L.Link], list[L.Const]]:
  """The tensor table of a `GPT2LMHeadModel` state dict (see `links`)."""
  b = L.Basis()
  d, n, h, f = m.d_model, m.num_heads, m.head_dim, m.d_ff
  out = output_links(m, "transformer.wte.weight", "lm_head.weight", b)
  out += [
    L.embedding("positions/embedding", "transformer.wpe.weight", b),
    L.vector("final_norm/scale", "transformer.ln_f.weight", b),
    L.vector("final_norm/bias", "transformer.ln_f.bias", b),
  ]
  consts = []
  for i in range(m.num_decoder_layers):
    ours, hf = f"layer_{i}", f"transformer.h.{i}"
    attn = f"{ours}/self_attention"
    out += [
      L.vector(f"{ours}/attention_sublayer/norm/scale", f"{hf}.ln_1.weight", b),
      L.vector(f"{ours}/attention_sublayer/norm/bias", f"{hf}.ln_1.bias", b),
      L.Link((f"{attn}/query", f"{attn}/key", f"{attn}/value"), f"{hf}.attn.c_attn.weight", *_fused(d, n, h)),
      L.linear_out(f"{attn}/out", f"{hf}.attn.c_proj.weight", b, (n, h, d), transpose=False),
      L.vector(f"{ours}/ffn_sublayer/norm/scale", f"{hf}.ln_2.weight", b),
      L.vector(f"{ours}/ffn_sublayer/norm/bias", f"{hf}.ln_2.bias", b),
      L.linear_in(f"{ours}/ffn/wi", f"{hf}.mlp.c_fc.weight", b, (d, f), transpose=False),
      L.plain(f"{ours}/ffn/bi", f"{hf}.mlp.c_fc.bias"),
      L.linear_out(f"{ours}/ffn/wo", f"{hf}.mlp.c_proj.weight", b, (f, d), transpose=False),
      L.vector(f"{ours}/ffn/bo", f"{hf}.mlp.c_proj.bias", b),
    ]
    if m.attention_bias == "all":
      out += [
        L.Link(
          (f"{attn}/query_bias", f"{attn}/key_bias", f"{attn}/value_bias"), f"{hf}.attn.c_attn.bias", *_fused(n, h)
        ),
        L.vector(f"{attn}/out_bias", f"{hf}.attn.c_proj.bias", b),
      ]
    else:
      consts += [
        L.Const(f"{hf}.attn.c_attn.bias", np.zeros(3 * d, np.float32)),
        L.Const(f"{hf}.attn.c_proj.bias", np.zeros(d, np.float32)),
      ]
  return out, consts
