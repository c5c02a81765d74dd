"""T5 as Hugging Face `T5ForConditionalGeneration` (Raffel et al. 2020): pre-LN with RMSNorm and no
biases, one bucketed relative-position bias table per stack (`model.position=t5`), unscaled
embeddings shared by encoder and decoder, ReLU (v1.0) or gated-GELU (v1.1, Flan-T5) FFNs.

Differences made exact by folding them into weights, so no model option is needed:
  * T5 does not scale attention scores by 1/sqrt(head_dim); ours do. Our query kernel is T5's
    `q` times sqrt(head_dim) (`_attention`).
  * T5 v1.0 (`scale_decoder_outputs`: a tied head) multiplies the decoder's final hidden state by
    d_model**-0.5 before the head; it is folded into our `decoder_norm/scale` (the only reader
    of that norm's output), so our tied head reads the table unchanged.
  * T5 v1.1 has a head of its own (`lm_head.weight`), not scaled: our untied model. Its input
    embedding is still shared by both stacks (`shared.weight`): imported into our
    `source_embed` and `target_embed` alike; export refuses them once they differ. transformers 5
    ties T5's head to `shared.weight` whenever a checkpoint leaves `lm_head.weight` out (what its
    `save_pretrained` does for a freshly built v1.1): the head is then read from `shared.weight`.
  * T5's relative bias table lives in layer 0 of each stack (`relative_attention_bias`);
    cross-attention has none. Its bucket function is ours (`layers.positions.t5_buckets`, tested).
  * The decoder starts from pad (id 0): `model.decoder_start_id=0`, a real token at position 0
    (`models.transformer.start_is_pad`). T5 has no BOS (`model.bos_id=-1`).
Training only: T5 applies `dropout_rate` to the attention weights (ours: `attention_dropout_rate`,
set equal on import) and inside the FFN (ours has no FFN-internal dropout).
"""

from __future__ import annotations

import numpy as np

from jaxformer.config import Config, ModelConfig
from jaxformer.interop import links as L
from jaxformer.tasks.translation import Translation

MODEL_TYPE = "t5"
ARCHITECTURE = "T5ForConditionalGeneration"
TOKENIZER = {"add_eos": True}  # T5 appends EOS to every input
BASE_MODEL_PREFIX = ""  # the state dict's names are `shared.`, `encoder.`, `decoder.`, `lm_head.` (not `transformer.`)
# (T5's dense_act_fn, is_gated_act) -> our model.ffn; `feed_forward_proj` is "gated-" + act for gated ones.
FFNS = {
  ("relu", False): "relu",
  ("gelu", False): "gelu",
  ("gelu_new", False): "gelu_tanh",
  ("silu", False): "silu",
  ("gelu_new", True): "geglu_tanh",
  ("silu", True): "swiglu",
}
PROJ = {
  "relu": "relu",
  "gelu": "gelu",
  "gelu_tanh": "gelu_new",
  "silu": "silu",
  "geglu_tanh": "gated-gelu",
  "swiglu": "gated-silu",
}


def unsupported(m: ModelConfig) -> list[str]:
  """`key=value` of each option of `m` T5 has no counterpart for (empty: it maps)."""
  wanted = {
    "kind": Translation.kind,
    "pre_norm": True,
    "position": "t5",
    "norm": "rmsnorm",
    "mlp_bias": False,
    "attention_bias": "none",
    "embedding_scale": False,
    "attn_logit_softcap": 0.0,
    "sliding_window": 0,
    "global_tokens": 0,
    "embedding_norm": False,
    "type_vocab_size": 0,
  }
  return L.mismatches(m, wanted, {"ffn": m.ffn in PROJ, "num_kv_heads": m.kv_heads == m.num_heads})


def hf_config(config: Config):
  """The `transformers.T5Config` of our model config (tied: v1.0's scaled head; untied: v1.1's)."""
  import transformers  # noqa: PLC0415

  m = config.model
  ids = m.special_ids
  return transformers.T5Config(
    vocab_size=m.vocab_size,
    d_model=m.d_model,
    d_kv=m.head_dim,
    d_ff=m.d_ff,
    num_layers=m.num_encoder_layers,
    num_decoder_layers=m.num_decoder_layers,
    num_heads=m.num_heads,
    relative_attention_num_buckets=m.relative_buckets,
    relative_attention_max_distance=m.relative_max_distance,
    dropout_rate=m.dropout_rate,
    layer_norm_epsilon=m.norm_epsilon,
    feed_forward_proj=PROJ[m.ffn],
    tie_word_embeddings=m.tie_embeddings,
    pad_token_id=ids.pad if ids.pad >= 0 else None,
    eos_token_id=ids.eos,
    decoder_start_token_id=ids.start,
    architectures=[ARCHITECTURE],
  )


def prepare(model, m: ModelConfig) -> None:
  """Gives an untied model's `T5ForConditionalGeneration` a head of its own (transformers 5 ties it)."""
  import torch  # noqa: PLC0415

  if not m.tie_embeddings:
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())


def generation(m: ModelConfig) -> dict:
  """generation_config.json fields: greedy from the decoder start (pad) to EOS; pad is never generated
  (our decoding excludes it)."""
  ids = m.special_ids
  pad = ids.pad if ids.pad >= 0 else None
  return {
    "decoder_start_token_id": ids.start,
    "eos_token_id": ids.eos,
    "pad_token_id": pad,
    "num_beams": 1,
    "suppress_tokens": [pad] if pad is not None else None,
  }


def model_config(hf) -> dict:
  """Our `model.*` fields for a `T5Config` (special ids: T5's pad 0 starts the decoder; no BOS).

  Raises:
    ValueError: options jaxformer has no counterpart for (named in one line).
  """
  act = (hf.dense_act_fn, bool(hf.is_gated_act))
  start = getattr(hf, "decoder_start_token_id", None)
  start = hf.pad_token_id if start is None else start
  bad = [
    f"{k}={v}"
    for k, v, ok in (
      ("feed_forward_proj", hf.feed_forward_proj, act in FFNS),
      ("decoder_start_token_id", start, start is not None),
    )
    if not ok
  ]
  if bad:
    raise ValueError(f"this T5 model has options jaxformer has no counterpart for: {', '.join(bad)}")
  per_head = hf.d_model // hf.num_heads
  return dict(
    kind=Translation.kind,
    vocab_size=hf.vocab_size,
    d_model=hf.d_model,
    num_heads=hf.num_heads,
    attention_head_dim=0 if hf.d_kv == per_head and hf.d_model % hf.num_heads == 0 else hf.d_kv,
    d_ff=hf.d_ff,
    num_encoder_layers=hf.num_layers,
    num_decoder_layers=hf.num_decoder_layers,
    dropout_rate=hf.dropout_rate,
    attention_dropout_rate=hf.dropout_rate,
    pre_norm=True,
    tie_embeddings=bool(getattr(hf, "scale_decoder_outputs", hf.tie_word_embeddings)),
    max_length=getattr(hf, "n_positions", None) or 512,
    position="t5",
    relative_buckets=hf.relative_attention_num_buckets,
    relative_max_distance=hf.relative_attention_max_distance,
    norm="rmsnorm",
    norm_epsilon=hf.layer_norm_epsilon,
    ffn=FFNS[act],
    mlp_bias=False,
    attention_bias="none",
    embedding_scale=False,
    pad_id=hf.pad_token_id if hf.pad_token_id is not None else -1,
    eos_id=hf.eos_token_id if isinstance(hf.eos_token_id, int) else hf.eos_token_id[0],
    bos_id=-1,
    decoder_start_id=start,
  )


def _attention(ours: str, hf: str, m: ModelConfig) -> list[L.Link]:
  """Self- or cross-attention: T5's unscaled scores folded into our query kernel (module docstring)."""
  d, n, h = m.d_model, m.num_heads, m.head_dim
  root = np.float32(np.sqrt(h))
  b = L.Basis()
  query = L.linear_in(f"{ours}/query", f"{hf}.q.weight", b, (d, n, h))
  return [
    L.Link(query.ours, query.hf, lambda x: query.to_hf(x / root), lambda y: (query.from_hf(y)[0] * root,)),
    L.linear_in(f"{ours}/key", f"{hf}.k.weight", b, (d, n, h)),
    L.linear_in(f"{ours}/value", f"{hf}.v.weight", b, (d, n, h)),
    L.linear_out(f"{ours}/out", f"{hf}.o.weight", b, (n, h, d)),
  ]


def _ffn(ours: str, hf: str, m: ModelConfig) -> list[L.Link]:
  """T5's `DenseReluDense`: `wi` (or gated: `wi_0` through the activation times `wi_1`) and `wo`."""
  b, d, f = L.Basis(), m.d_model, m.d_ff
  if m.ffn in ("geglu_tanh", "swiglu"):
    wi = [
      L.linear_in(f"{ours}/wi_gate", f"{hf}.wi_0.weight", b, (d, f)),
      L.linear_in(f"{ours}/wi", f"{hf}.wi_1.weight", b, (d, f)),
    ]
  else:
    wi = [L.linear_in(f"{ours}/wi", f"{hf}.wi.weight", b, (d, f))]
  return wi + [L.linear_out(f"{ours}/wo", f"{hf}.wo.weight", b, (f, d))]


def _shared(source: np.ndarray, target: np.ndarray) -> np.ndarray:
  if not np.array_equal(source, target):
    raise ValueError(
      "T5 shares one input embedding: this model's source_embed and target_embed differ, so it "
      "cannot be exported as T5ForConditionalGeneration"
    )
  return source


def links(m: ModelConfig) -> tuple[list[L.Link], list[L.Const]]:
  """The tensor table of a `T5ForConditionalGeneration` state dict (see `links`)."""
  b = L.Basis()
  if m.tie_embeddings:  # v1.0: the head's d_model**-0.5 lives in our decoder norm's scale
    out = [L.plain("embed/embedding", "shared.weight")]
    head_scale = np.float32(m.d_model**-0.5)
  else:
    out = [
      L.Link(("source_embed/embedding", "target_embed/embedding"), "shared.weight", _shared, lambda y: (y, y.copy())),
      L.Link(("output_proj",), "lm_head.weight", lambda w: w.T, lambda y: (y.T,), fallback="shared.weight"),
    ]
    head_scale = np.float32(1.0)
  out += [
    L.vector("encoder_norm/scale", "encoder.final_layer_norm.weight", b),
    L.Link(
      ("decoder_norm/scale",), "decoder.final_layer_norm.weight", lambda x: x / head_scale, lambda y: (y * head_scale,)
    ),
    L.plain("encoder_relative_bias", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
    L.plain("decoder_relative_bias", "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
  ]
  for i in range(m.num_encoder_layers):
    ours, hf = f"encoder_{i}", f"encoder.block.{i}.layer"
    out += [
      L.vector(f"{ours}/attention_sublayer/norm/scale", f"{hf}.0.layer_norm.weight", b),
      *_attention(f"{ours}/self_attention", f"{hf}.0.SelfAttention", m),
      L.vector(f"{ours}/ffn_sublayer/norm/scale", f"{hf}.1.layer_norm.weight", b),
      *_ffn(f"{ours}/ffn", f"{hf}.1.DenseReluDense", m),
    ]
  for i in range(m.num_decoder_layers):
    ours, hf = f"decoder_{i}", f"decoder.block.{i}.layer"
    out += [
      L.vector(f"{ours}/self_attention_sublayer/norm/scale", f"{hf}.0.layer_norm.weight", b),
      *_attention(f"{ours}/self_attention", f"{hf}.0.SelfAttention", m),
      L.vector(f"{ours}/cross_attention_sublayer/norm/scale", f"{hf}.1.layer_norm.weight", b),
      *_attention(f"{ours}/cross_attention", f"{hf}.1.EncDecAttention", m),
      L.vector(f"{ours}/ffn_sublayer/norm/scale", f"{hf}.2.layer_norm.weight", b),
      *_ffn(f"{ours}/ffn", f"{hf}.2.DenseReluDense", m),
    ]
  return out, []
