"""A post-LN encoder-only masked LM with BERT's embeddings and head as Hugging Face
`BertForMaskedLM`; `hf_roberta` is the same table for `RobertaForMaskedLM`.

The published layout, expressed by model options so that every tensor round-trips exactly:
  * blocks: post-LN (`model.pre_norm=false`), LayerNorm epsilon `layer_norm_eps`
    (`model.norm_epsilon`), biases everywhere (`model.attention_bias=all`, `model.mlp_bias`),
    the activation `hidden_act` (gelu: exact; gelu_new and kin: `model.ffn=gelu_tanh`).
  * embeddings: word + position + token type, unscaled (`model.embedding_scale=false`), then a
    LayerNorm (`model.embedding_norm`), then dropout. Our inputs carry no token-type ids, so
    every token is type 0: the whole token-type table is the param `token_types`
    `[type_vocab_size, d_model]` (`model.type_vocab_size`), of which row 0 is added to every
    token; the other rows do nothing in our model and are kept so export writes them back.
  * positions: learned, `max_position_embeddings` rows. RoBERTa numbers real tokens from
    `pad_token_id + 1` (padding gets `pad_token_id`): `model.position_offset=pad_token_id + 1`,
    so our position p reads its row p + offset and the table keeps every row. Our positions
    count from each row's start, so padding goes at the end (as tokenizers pad it).
  * padding: our model masks keys equal to `model.pad_id` (`pad_token_id`), as transformers
    does where its `attention_mask` is 0.
  * head (`model.mlm_head`): dense with bias, the activation, LayerNorm, then the decoder (the
    word embeddings when `tie_word_embeddings`, else `output_proj`) plus its bias
    `mlm_head/output_bias`. Tied, transformers ties the decoder's bias to the head's `bias` and
    saves that one; untied, it saves both and the forward pass reads only the decoder's, so the
    head's `bias` is never read: import ignores it, export leaves transformers' value (`HF_UNUSED`).
    RoBERTa's head applies the exact GELU whatever `hidden_act`, ours the FFN's activation, so
    a RoBERTa model has `hidden_act=gelu`.
Refused in one line (no counterpart): `position_embedding_type` other than absolute,
`is_decoder`, `add_cross_attention`, other activations, `type_vocab_size=0`.
"""

from __future__ import annotations

from jaxformer.config import Config, ModelConfig
from jaxformer.interop import links as L
from jaxformer.interop.hf_llama import output_links, pad_token, tied_in_hf
from jaxformer.tasks.masked_lm import MaskedLM

MODEL_TYPE = "bert"
ARCHITECTURE = "BertForMaskedLM"
TOKENIZER = {"add_eos": False, "mask": True}
HF_UNUSED = ("cls.predictions.bias",)  # see the module docstring
# transformers' hidden_act -> our model.ffn; export writes the first name of each
ACTIVATIONS = {
  "gelu": "gelu",
  "gelu_python": "gelu",
  "gelu_new": "gelu_tanh",
  "gelu_pytorch_tanh": "gelu_tanh",
  "gelu_fast": "gelu_tanh",
  "relu": "relu",
  "silu": "silu",
  "swish": "silu",
}
HF_ACTIVATION = {ours: hf for hf, ours in reversed(ACTIVATIONS.items())}


def unsupported(m: ModelConfig, offset: int = 0, activations: tuple[str, ...] = tuple(HF_ACTIVATION)) -> list[str]:
  """`key=value` of each option of `m` BERT has no counterpart for (empty: it maps). RoBERTa
  passes its position `offset` (`model.pad_id + 1`) and its one activation."""
  wanted = {
    "kind": MaskedLM.kind,
    "pre_norm": False,
    "position": "learned",
    "position_offset": offset,
    "norm": "layernorm",
    "attention_bias": "all",
    "mlp_bias": True,
    "embedding_norm": True,
    "mlm_head": True,
    "attn_logit_softcap": 0.0,
  }
  return L.mismatches(
    m,
    wanted,
    {
      "ffn": m.ffn in activations,
      "type_vocab_size": m.type_vocab_size > 0,
      "attention": m.attention != "linformer",
      "num_kv_heads": m.kv_heads == m.num_heads,
      "attention_head_dim": m.head_dim * m.num_heads == m.d_model,
    },
  )


def hf_config(config: Config, cls: str = "BertConfig", max_positions: int | None = None):
  """The `transformers.BertConfig` (RoBERTa: `cls`, with its table's `max_positions`) of our model config."""
  import transformers  # noqa: PLC0415

  m = config.model
  return getattr(transformers, cls)(
    vocab_size=m.vocab_size,
    hidden_size=m.d_model,
    num_hidden_layers=m.num_encoder_layers,
    num_attention_heads=m.num_heads,
    intermediate_size=m.d_ff,
    hidden_act=HF_ACTIVATION[m.ffn],
    hidden_dropout_prob=m.dropout_rate,
    attention_probs_dropout_prob=m.attention_dropout_rate,
    max_position_embeddings=max_positions or m.max_length,
    type_vocab_size=m.type_vocab_size,
    layer_norm_eps=m.norm_epsilon,
    pad_token_id=pad_token(m),
    bos_token_id=m.bos_id if m.bos_id >= 0 else None,
    eos_token_id=m.eos_id if m.eos_id >= 0 else None,
    tie_word_embeddings=tied_in_hf(m),
    architectures=[cls[:-6] + "ForMaskedLM"],
  )


def generation(m: ModelConfig) -> dict:
  """A masked LM does not generate: no generation settings."""
  return {}


def model_config(hf, family: str = "BERT", offset: int = 0, activations: tuple[str, ...] = tuple(ACTIVATIONS)) -> dict:
  """Our `model.*` fields for a `BertConfig` (RoBERTa passes its `family` name, position `offset`
  and activations).

  Raises:
    ValueError: options jaxformer has no counterpart for (named in one line).
  """
  bad = [
    f"{k}={getattr(hf, k, None)}"
    for k, ok in (
      ("hidden_act", hf.hidden_act in activations),
      ("position_embedding_type", getattr(hf, "position_embedding_type", "absolute") == "absolute"),
      ("is_decoder", not hf.is_decoder),
      ("add_cross_attention", not hf.add_cross_attention),
      ("type_vocab_size", hf.type_vocab_size > 0),
      ("max_position_embeddings", hf.max_position_embeddings > offset),
    )
    if not ok
  ]
  if bad:
    raise ValueError(f"this {family} model has options jaxformer has no counterpart for: {', '.join(bad)}")
  return dict(
    kind=MaskedLM.kind,
    vocab_size=hf.vocab_size,
    d_model=hf.hidden_size,
    num_heads=hf.num_attention_heads,
    d_ff=hf.intermediate_size,
    num_encoder_layers=hf.num_hidden_layers,
    dropout_rate=hf.hidden_dropout_prob,
    attention_dropout_rate=hf.attention_probs_dropout_prob,
    pre_norm=False,
    tie_embeddings=bool(hf.tie_word_embeddings),
    embedding_scale=False,
    embedding_norm=True,
    mlm_head=True,
    type_vocab_size=hf.type_vocab_size,
    max_length=hf.max_position_embeddings - offset,
    position="learned",
    position_offset=offset,
    norm="layernorm",
    norm_epsilon=hf.layer_norm_eps,
    ffn=ACTIVATIONS[hf.hidden_act],
    attention_bias="all",
    mlp_bias=True,
    pad_id=-1 if hf.pad_token_id is None else hf.pad_token_id,
  )


def _transposed(ours: str, hf: str) -> L.Link:
  """Our `[d_model, d_model]` kernel as a torch `Linear` weight (the head's dense layer)."""
  return L.Link((ours,), hf, lambda w: w.T, lambda y: (y.T,))


def links(m: ModelConfig, prefix: str = "bert", head: dict[str, str] | None = None) -> tuple[list[L.Link], list]:
  """The tensor table of a `BertForMaskedLM` state dict (RoBERTa: its `prefix` and `head` names:
  the keys dense, norm, decoder and bias)."""
  head = head or {
    "dense": "cls.predictions.transform.dense",
    "norm": "cls.predictions.transform.LayerNorm",
    "decoder": "cls.predictions.decoder",
    "bias": "cls.predictions.bias",
  }
  b = L.Basis()
  d, n, h, f = m.d_model, m.num_heads, m.head_dim, m.d_ff
  emb = f"{prefix}.embeddings"
  out = output_links(m, f"{emb}.word_embeddings.weight", f"{head['decoder']}.weight", b)
  out += [
    L.embedding("positions/embedding", f"{emb}.position_embeddings.weight", b),
    L.embedding("token_types", f"{emb}.token_type_embeddings.weight", b),
    L.vector("embedding_norm/scale", f"{emb}.LayerNorm.weight", b),
    L.vector("embedding_norm/bias", f"{emb}.LayerNorm.bias", b),
    _transposed("mlm_head/dense_kernel", f"{head['dense']}.weight"),
    L.vector("mlm_head/dense_bias", f"{head['dense']}.bias", b),
    L.vector("mlm_head/norm/scale", f"{head['norm']}.weight", b),
    L.vector("mlm_head/norm/bias", f"{head['norm']}.bias", b),
    L.plain("mlm_head/output_bias", head["bias"] if tied_in_hf(m) else f"{head['decoder']}.bias"),
  ]
  for i in range(m.num_encoder_layers):
    ours, hf = f"layer_{i}", f"{prefix}.encoder.layer.{i}"
    attn, sub = f"{ours}/self_attention", f"{hf}.attention"
    out += [
      L.linear_out(f"{attn}/out", f"{sub}.output.dense.weight", b, (n, h, d)),
      L.vector(f"{attn}/out_bias", f"{sub}.output.dense.bias", b),
      L.vector(f"{ours}/attention_sublayer/norm/scale", f"{sub}.output.LayerNorm.weight", b),
      L.vector(f"{ours}/attention_sublayer/norm/bias", f"{sub}.output.LayerNorm.bias", b),
      L.linear_in(f"{ours}/ffn/wi", f"{hf}.intermediate.dense.weight", b, (d, f)),
      L.plain(f"{ours}/ffn/bi", f"{hf}.intermediate.dense.bias"),
      L.linear_out(f"{ours}/ffn/wo", f"{hf}.output.dense.weight", b, (f, d)),
      L.vector(f"{ours}/ffn/bo", f"{hf}.output.dense.bias", b),
      L.vector(f"{ours}/ffn_sublayer/norm/scale", f"{hf}.output.LayerNorm.weight", b),
      L.vector(f"{ours}/ffn_sublayer/norm/bias", f"{hf}.output.LayerNorm.bias", b),
    ]
    for p in ("query", "key", "value"):
      out += [
        L.linear_in(f"{attn}/{p}", f"{sub}.self.{p}.weight", b, (d, n, h)),
        L.reshaped(f"{attn}/{p}_bias", f"{sub}.self.{p}.bias", (n, h)),
      ]
  return out, []
