"""The paper's encoder-decoder as Hugging Face `MarianMTModel` (post-LN, static sinusoidal
positions, ReLU, GELU or SiLU FFN; Vaswani et al. 2017, sections 3.1-3.5), both ways: our own
models, and published Marian / OPUS-MT models imported exactly.

One table serves both, driven by model options:
  * sinusoids: Marian puts all sines first, then all cosines; ours interleave (sin, cos) per
    frequency (section 3.5). The d_model basis is permuted accordingly (`links.Basis`).
  * pad: Marian keeps its pad token as the last id, and a published model starts its decoder
    from it (`model.pad_id = model.decoder_start_id = vocab_size - 1`, a learned row of its own:
    `models.transformer.start_is_pad`). One of ours whose pad is not the last id (pad 0, the
    Hugging Face token `<blank>`, never generated) gets one extra id at the end of the exported
    vocabulary (a zero row, which CTranslate2's converter drops) as Marian's pad, and its decoder
    starts from our BOS.
  * attention biases (`model.attention_bias=all`) and `final_logits_bias` (`model.logits_bias`):
    a published model's are imported; a model without them exports zeros (`links.Const`).
  * `scale_embedding` is `model.embedding_scale`; `share_encoder_decoder_embeddings` and
    `tie_word_embeddings` both true is our tied model, anything else our untied one (three
    tables, read from whichever tensors the checkpoint holds), exported with neither.
  * EOS is the config's (0 in published Marian); Marian has no BOS in use (`model.bos_id=-1`).
Refused in one line: another target vocabulary (`decoder_vocab_size`), unequal encoder and decoder
head counts or FFN widths, an activation other than relu/gelu/swish/gelu_new, and the `LEGACY`
fields set to another architecture. Marian's LayerNorm epsilon is fixed at 1e-5: an imported model
has `model.norm_epsilon=1e-5`; one of ours with another epsilon (default 1e-6) exports with a
relative change of about 5e-6 in each normalised vector (logits agree to ~1e-5 on trained models).
"""

from __future__ import annotations

import numpy as np

from jaxformer.config import Config, ModelConfig
from jaxformer.interop import links as L
from jaxformer.tasks.translation import Translation

MODEL_TYPE = "marian"
ARCHITECTURE = "MarianMTModel"
EXTRA_PAD = "<pad>"  # our models' extra last id (see the module docstring)
TOKENIZER = {"add_eos": True, "extra_pad": EXTRA_PAD}
HF_COMPUTED = ("embed_positions.weight",)  # Marian's own sinusoid table (ours, permuted: tested)
# transformers' activation_function -> our model.ffn (swish is SiLU)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu", "gelu_new": "gelu_tanh"}
HF_ACTIVATION = {"relu": "relu", "gelu": "gelu", "silu": "swish", "gelu_tanh": "gelu_new"}
# BART-era config.json fields (published OPUS-MT configs carry them) that transformers' Marian code ignores:
# another value describes another architecture than the one it runs (pre-LN, extra norms, learned positions).
LEGACY = {
  "normalize_before": False,
  "normalize_embedding": False,
  "add_final_layer_norm": False,
  "static_position_embeddings": True,
}


def unsupported(m: ModelConfig) -> list[str]:
  """`key=value` of each option of `m` Marian has no counterpart for (empty: it maps)."""
  wanted = {
    "kind": Translation.kind,
    "pre_norm": False,
    "position": "sinusoidal",
    "norm": "layernorm",
    "attn_logit_softcap": 0.0,
    "sliding_window": 0,
    "mlp_bias": True,
    "attention_head_dim": 0,
  }
  return L.mismatches(
    m,
    wanted,
    {
      "ffn": m.ffn in HF_ACTIVATION,
      "num_kv_heads": m.kv_heads == m.num_heads,
      "attention_bias": m.attention_bias != "qkv",
    },
  )


def extra_rows(m: ModelConfig) -> int:
  """1 when Marian's pad is an id appended to our vocabulary (our pad is not the last id), else 0."""
  return int(m.pad_id != m.vocab_size - 1)


def hf_pad(m: ModelConfig) -> int:
  """Marian's `pad_token_id`: the last id of the exported vocabulary."""
  return m.vocab_size - 1 + extra_rows(m)


def sinusoid_basis(d_model: int) -> L.Basis:
  """Marian's feature k is our feature perm[k]: sines (our even features), then cosines (odd)."""
  return L.Basis(np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)]))


def hf_config(config: Config):
  """The `transformers.MarianConfig` of our model config."""
  import transformers  # noqa: PLC0415

  m = config.model
  v = m.vocab_size + extra_rows(m)
  return transformers.MarianConfig(
    vocab_size=v,
    decoder_vocab_size=v,
    d_model=m.d_model,
    encoder_layers=m.num_encoder_layers,
    decoder_layers=m.num_decoder_layers,
    encoder_attention_heads=m.num_heads,
    decoder_attention_heads=m.num_heads,
    encoder_ffn_dim=m.d_ff,
    decoder_ffn_dim=m.d_ff,
    activation_function=HF_ACTIVATION[m.ffn],
    max_position_embeddings=m.max_length,
    scale_embedding=m.embedding_scale,
    share_encoder_decoder_embeddings=m.tie_embeddings,
    tie_word_embeddings=m.tie_embeddings,
    dropout=m.dropout_rate,
    attention_dropout=m.attention_dropout_rate,
    activation_dropout=0.0,
    pad_token_id=hf_pad(m),
    decoder_start_token_id=m.special_ids.start,
    eos_token_id=m.eos_id,
    bos_token_id=m.bos_id if m.bos_id >= 0 else None,
    forced_eos_token_id=None,
    architectures=[ARCHITECTURE],
  )


def generation(m: ModelConfig) -> dict:
  """generation_config.json fields: greedy from the decoder start; no pad is ever generated (our decoding
  excludes `model.pad_id`)."""
  suppress = sorted({i for i in (m.pad_id, hf_pad(m)) if i >= 0})
  return {
    "decoder_start_token_id": m.special_ids.start,
    "eos_token_id": m.eos_id,
    "pad_token_id": hf_pad(m),
    "bos_token_id": m.bos_id if m.bos_id >= 0 else None,
    "suppress_tokens": suppress,
    "num_beams": 1,
    "max_length": m.max_length,
    "forced_eos_token_id": None,
  }


def model_config(hf) -> dict:
  """Our `model.*` fields for a published `MarianConfig` (see the module docstring).

  Raises:
    ValueError: options jaxformer has no counterpart for (named in one line).
  """
  decoder = (hf.decoder_attention_heads, hf.decoder_ffn_dim)
  legacy = [(k, getattr(hf, k, default), getattr(hf, k, default) == default) for k, default in LEGACY.items()]
  bad = [
    f"{k}={v}"
    for k, v, ok in (
      ("activation_function", hf.activation_function, hf.activation_function in ACTIVATIONS),
      *legacy,
      ("pad_token_id", hf.pad_token_id, hf.pad_token_id is not None and 0 <= hf.pad_token_id < hf.vocab_size),
      ("decoder_vocab_size", hf.decoder_vocab_size, (hf.decoder_vocab_size or hf.vocab_size) == hf.vocab_size),
      ("decoder_attention_heads/ffn_dim", decoder, decoder == (hf.encoder_attention_heads, hf.encoder_ffn_dim)),
    )
    if not ok
  ]
  if bad:
    raise ValueError(f"this Marian model has options jaxformer has no counterpart for: {', '.join(bad)}")
  eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, list) else hf.eos_token_id
  start = hf.decoder_start_token_id
  return dict(
    kind=Translation.kind,
    vocab_size=hf.vocab_size,
    d_model=hf.d_model,
    num_heads=hf.encoder_attention_heads,
    d_ff=hf.encoder_ffn_dim,
    num_encoder_layers=hf.encoder_layers,
    num_decoder_layers=hf.decoder_layers,
    dropout_rate=hf.dropout,
    attention_dropout_rate=hf.attention_dropout,
    pre_norm=False,
    tie_embeddings=bool(hf.tie_word_embeddings and hf.share_encoder_decoder_embeddings),
    max_length=hf.max_position_embeddings,
    position="sinusoidal",
    norm="layernorm",
    norm_epsilon=1e-5,
    ffn=ACTIVATIONS[hf.activation_function],
    mlp_bias=True,
    attention_bias="all",
    embedding_scale=bool(hf.scale_embedding),
    logits_bias=True,
    pad_id=hf.pad_token_id,
    eos_id=-1 if eos is None else eos,
    bos_id=-1,
    decoder_start_id=hf.pad_token_id if start is None else start,
  )


def _attention(ours: str, hf: str, m: ModelConfig, basis: L.Basis) -> tuple[list, list]:
  d, n, h = m.d_model, m.num_heads, m.head_dim
  links = [
    L.linear_in(f"{ours}/{name}", f"{hf}.{short}_proj.weight", basis, (d, n, h))
    for name, short in (("query", "q"), ("key", "k"), ("value", "v"))
  ]
  links.append(L.linear_out(f"{ours}/out", f"{hf}.out_proj.weight", basis, (n, h, d)))
  if m.attention_bias == "all":
    links += [
      L.reshaped(f"{ours}/{name}_bias", f"{hf}.{short}_proj.bias", (n, h))
      for name, short in (("query", "q"), ("key", "k"), ("value", "v"))
    ]
    return links + [L.vector(f"{ours}/out_bias", f"{hf}.out_proj.bias", basis)], []
  return links, [
    L.Const(f"{hf}.{s}_proj.bias", np.zeros(n * h if s != "out" else d, np.float32)) for s in ("q", "k", "v", "out")
  ]


def _block(ours: str, hf: str, m: ModelConfig, basis: L.Basis, sublayers: list[tuple[str, str, str]]):
  """Links of one Marian layer: `sublayers` are (our sublayer, its attention module or "ffn", Marian's norm name)."""
  links, consts = [], []
  for sublayer, module, norm in sublayers:
    links += [
      L.vector(f"{ours}/{sublayer}/norm/scale", f"{hf}.{norm}.weight", basis),
      L.vector(f"{ours}/{sublayer}/norm/bias", f"{hf}.{norm}.bias", basis),
    ]
    if module == "ffn":
      links += [
        L.linear_in(f"{ours}/ffn/wi", f"{hf}.fc1.weight", basis, (m.d_model, m.d_ff)),
        L.plain(f"{ours}/ffn/bi", f"{hf}.fc1.bias"),
        L.linear_out(f"{ours}/ffn/wo", f"{hf}.fc2.weight", basis, (m.d_ff, m.d_model)),
        L.vector(f"{ours}/ffn/bo", f"{hf}.fc2.bias", basis),
      ]
    else:
      more, more_consts = _attention(
        f"{ours}/{module}", f"{hf}.{'encoder_attn' if 'cross' in module else 'self_attn'}", m, basis
      )
      links, consts = links + more, consts + more_consts
  return links, consts


def _output(m: ModelConfig, basis: L.Basis) -> tuple[list[L.Link], list[L.Const]]:
  """The token tables, the head and `final_logits_bias`. Untied, each table falls back to the one a
  checkpoint ties it to (shared encoder/decoder tables; a head tied to the decoder's table)."""
  extra = extra_rows(m)
  if m.tie_embeddings:
    out = [L.embedding("embed/embedding", "model.shared.weight", basis, extra_rows=extra)]
  else:
    source = L.embedding("source_embed/embedding", "model.encoder.embed_tokens.weight", basis, extra_rows=extra)
    target = L.embedding("target_embed/embedding", "model.decoder.embed_tokens.weight", basis, extra_rows=extra)
    out = [
      L.Link(link.ours, link.hf, link.to_hf, link.from_hf, fallback="model.shared.weight") for link in (source, target)
    ]
    out.append(
      L.Link(
        ("output_proj",),
        "lm_head.weight",
        lambda w: np.pad(basis.to_hf(w.T, 1), ((0, extra), (0, 0))),
        lambda y: (basis.from_hf(y[: m.vocab_size], 1).T,),
        fallback="model.decoder.embed_tokens.weight",
      )
    )
  if not m.logits_bias:
    return out, [L.Const("final_logits_bias", np.zeros((1, m.vocab_size + extra), np.float32))]
  return out + [
    L.Link(
      ("logits_bias",), "final_logits_bias", lambda b: np.pad(b, (0, extra))[None], lambda y: (y[0, : m.vocab_size],)
    )
  ], []


def links(m: ModelConfig) -> tuple[list[L.Link], list[L.Const]]:
  """The tensor table of a `MarianMTModel` state dict (see `links`)."""
  basis = sinusoid_basis(m.d_model)
  out, consts = _output(m, basis)
  for i in range(m.num_encoder_layers):
    more, c = _block(
      f"encoder_{i}",
      f"model.encoder.layers.{i}",
      m,
      basis,
      [("attention_sublayer", "self_attention", "self_attn_layer_norm"), ("ffn_sublayer", "ffn", "final_layer_norm")],
    )
    out, consts = out + more, consts + c
  for i in range(m.num_decoder_layers):
    more, c = _block(
      f"decoder_{i}",
      f"model.decoder.layers.{i}",
      m,
      basis,
      [
        ("self_attention_sublayer", "self_attention", "self_attn_layer_norm"),
        ("cross_attention_sublayer", "cross_attention", "encoder_attn_layer_norm"),
        ("ffn_sublayer", "ffn", "final_layer_norm"),
      ],
    )
    out, consts = out + more, consts + c
  return out, consts
