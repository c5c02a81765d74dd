"""A pre-LN encoder-only masked LM (learned positions, LayerNorm, GELU) as Hugging Face
`XLMRobertaXLForMaskedLM`, the BERT-family model whose layout fits ours: pre-LN blocks, a
final LayerNorm and no LayerNorm on the embeddings (BERT and RoBERTa normalise the
embeddings and are post-LN, which no weights can undo).

Layout differences, made exact:
  * positions: RoBERTa numbers tokens from `pad_token_id + 1`, so our row t is its row t + 1.
  * the token-type embedding and attention biases are zero (`links.Const`).
  * the LM head computes LayerNorm(GELU(dense(u))) before the output matrix; ours applies
    the output matrix to the final LayerNorm's output y = scale * z + bias (z standardised)
    directly. With dense(u) = (u - bias) / scale + C = z + C and C > sqrt(d_model) + 10, GELU
    is the identity in float32 (every input exceeds 10), the head's LayerNorm standardises
    z + C back to z, and its scale and bias (ours) give y again. So the head is derived from
    our final norm (its scale must have no zero), and an import reads that norm.
  * embeddings are not scaled in RoBERTa: `word_embeddings` hold ours times sqrt(d_model).
"""

from __future__ import annotations

import numpy as np

from jaxformer.config import Config, ModelConfig
from jaxformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from jaxformer.interop import links as L
from jaxformer.interop.hf_llama import output_links
from jaxformer.tasks.masked_lm import MaskedLM

MODEL_TYPE = "xlm-roberta-xl"
ARCHITECTURE = "XLMRobertaXLForMaskedLM"
TOKENIZER = {"add_eos": False, "mask": True}
EPSILON = 1e-6  # our LayerNorm's


def unsupported(m: ModelConfig) -> list[str]:
  """`key=value` of each option of `m` the BERT-style model has no counterpart for (empty: it maps)."""
  wanted = {
    "kind": MaskedLM.kind,
    "pre_norm": True,
    "position": "learned",
    "norm": "layernorm",
    "ffn": "gelu",
    "attn_logit_softcap": 0.0,
    "attention_bias": "none",
    "mlp_bias": True,
    "embedding_scale": True,
    "attention_head_dim": 0,
    "pad_id": 0,
    "embedding_norm": False,
    "type_vocab_size": 0,
    "position_offset": 0,
    "mlm_head": False,
  }
  return L.mismatches(m, wanted, {"num_kv_heads": m.kv_heads == m.num_heads})


def hf_config(config: Config):
  """The `transformers.XLMRobertaXLConfig` of our model config."""
  import transformers  # noqa: PLC0415

  m = config.model
  return transformers.XLMRobertaXLConfig(
    vocab_size=m.vocab_size,
    hidden_size=m.d_model,
    num_hidden_layers=m.num_encoder_layers,
    num_attention_heads=m.num_heads,
    intermediate_size=m.d_ff,
    hidden_act="gelu",
    hidden_dropout_prob=m.dropout_rate,
    attention_probs_dropout_prob=m.attention_dropout_rate,
    max_position_embeddings=m.max_length + PAD_ID + 1,
    type_vocab_size=1,
    layer_norm_eps=EPSILON,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
    architectures=[ARCHITECTURE],
  )


def generation(m: ModelConfig) -> dict:
  """A masked LM does not generate: no generation settings."""
  return {}


def model_config(hf) -> dict:
  """Our `model.*` fields for an `XLMRobertaXLConfig` (its LM head must be of the derived form
  the module docstring gives; the import checks that the weights round-trip).

  Raises:
    ValueError: options jaxformer has no counterpart for (named in one line).
  """
  bad = [
    f"{k}={getattr(hf, k)}"
    for k, ok in (
      ("hidden_act", hf.hidden_act == "gelu"),
      ("type_vocab_size", hf.type_vocab_size == 1),
      ("position_embedding_type", getattr(hf, "position_embedding_type", "absolute") == "absolute"),
    )
    if not ok
  ]
  if bad:
    raise ValueError(f"this XLM-RoBERTa-XL model has options jaxformer has no counterpart for: {', '.join(bad)}")
  return dict(
    kind=MaskedLM.kind,
    vocab_size=hf.vocab_size,
    d_model=hf.hidden_size,
    num_heads=hf.num_attention_heads,
    d_ff=hf.intermediate_size,
    num_encoder_layers=hf.num_hidden_layers,
    dropout_rate=hf.hidden_dropout_prob,
    attention_dropout_rate=hf.attention_probs_dropout_prob,
    pre_norm=True,
    tie_embeddings=False,
    max_length=hf.max_position_embeddings - hf.pad_token_id - 1,
    position="learned",
    norm="layernorm",
    ffn="gelu",
  )


def _head(m: ModelConfig) -> list[L.Link]:
  """The LM head derived from our final norm (module docstring); import reads the norm elsewhere."""
  shift = np.float32(np.ceil(np.sqrt(m.d_model)) + 10.0)
  norm = ("final_norm/scale", "final_norm/bias")
  return [
    L.Link(norm[:1], "lm_head.dense.weight", lambda g: np.diag(1.0 / g), None),
    L.Link(norm, "lm_head.dense.bias", lambda g, b: shift - b / g, None),
    L.Link(norm[:1], "lm_head.layer_norm.weight", lambda g: g, None),
    L.Link(norm[1:], "lm_head.layer_norm.bias", lambda b: b, None),
  ]


def links(m: ModelConfig) -> tuple[list[L.Link], list[L.Const]]:
  """The tensor table of an `XLMRobertaXLForMaskedLM` state dict (see `links`)."""
  b = L.Basis()
  d, n, h, f = m.d_model, m.num_heads, m.head_dim, m.d_ff
  emb = "roberta.embeddings"
  out = output_links(m, f"{emb}.word_embeddings.weight", "lm_head.decoder.weight", b)
  out += [
    L.embedding("positions/embedding", f"{emb}.position_embeddings.weight", b, row_offset=PAD_ID + 1),
    L.vector("final_norm/scale", "roberta.encoder.LayerNorm.weight", b),
    L.vector("final_norm/bias", "roberta.encoder.LayerNorm.bias", b),
    *_head(m),
  ]
  consts = [
    L.Const(f"{emb}.token_type_embeddings.weight", np.zeros((1, d), np.float32)),
    L.Const("lm_head.bias", np.zeros(m.vocab_size, np.float32)),
    L.Const("lm_head.decoder.bias", np.zeros(m.vocab_size, np.float32)),
  ]
  for i in range(m.num_encoder_layers):
    ours, hf = f"layer_{i}", f"roberta.encoder.layer.{i}"
    attn = f"{hf}.attention"
    out += [
      L.vector(f"{ours}/attention_sublayer/norm/scale", f"{attn}.self_attn_layer_norm.weight", b),
      L.vector(f"{ours}/attention_sublayer/norm/bias", f"{attn}.self_attn_layer_norm.bias", b),
      L.linear_in(f"{ours}/self_attention/query", f"{attn}.self.query.weight", b, (d, n, h)),
      L.linear_in(f"{ours}/self_attention/key", f"{attn}.self.key.weight", b, (d, n, h)),
      L.linear_in(f"{ours}/self_attention/value", f"{attn}.self.value.weight", b, (d, n, h)),
      L.linear_out(f"{ours}/self_attention/out", f"{attn}.output.dense.weight", b, (n, h, d)),
      L.vector(f"{ours}/ffn_sublayer/norm/scale", f"{hf}.LayerNorm.weight", b),
      L.vector(f"{ours}/ffn_sublayer/norm/bias", f"{hf}.LayerNorm.bias", b),
      L.linear_in(f"{ours}/ffn/wi", f"{hf}.intermediate.dense.weight", b, (d, f)),
      L.plain(f"{ours}/ffn/bi", f"{hf}.intermediate.dense.bias"),
      L.linear_out(f"{ours}/ffn/wo", f"{hf}.output.dense.weight", b, (f, d)),
      L.vector(f"{ours}/ffn/bo", f"{hf}.output.dense.bias", b),
    ]
    consts += [L.Const(f"{attn}.self.{s}.bias", np.zeros(d, np.float32)) for s in ("query", "key", "value")]
    consts.append(L.Const(f"{attn}.output.dense.bias", np.zeros(d, np.float32)))
  return out, consts
