"""The paper's encoder-decoder as Hugging Face `MarianMTModel` (post-LN, static sinusoidal
positions, embeddings times sqrt(d_model), ReLU or GELU FFN; Vaswani et al. 2017, sections 3.1-3.5).

Layout differences, made exact:
  * sinusoids: Marian puts all sines first, then all cosines; ours interleave (sin, cos) per
    frequency (section 3.5). The d_model basis is permuted accordingly (`links.Basis`).
  * pad: Marian keeps its pad token as one extra id at the end of the vocabulary
    (`vocab_size + 1` rows, a zero embedding), which CTranslate2's converter drops; our pad
    (id 0, never generated) is the Hugging Face token `<blank>`, suppressed in generation.
  * the decoder starts from our BOS (id 2), `decoder_start_token_id`.
  * Marian's attention and `final_logits_bias` exist but are zero in ours (`links.Const`).
One difference cannot be folded into weights: Marian's LayerNorm epsilon is 1e-5 (ours 1e-6),
a relative change of about 5e-6 in each normalised vector (logits agree to ~1e-5 on trained models).
"""

from __future__ import annotations

import numpy as np

from jaxformer.config import Config, ModelConfig
from jaxformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from jaxformer.interop import links as L

MODEL_TYPE = "marian"
ARCHITECTURE = "MarianMTModel"
EXTRA_PAD = "<pad>"   # the extra last id (see the module docstring)
TOKENIZER = {"add_eos": True, "extra_pad": EXTRA_PAD}
HF_COMPUTED = ("embed_positions.weight",)   # Marian's own sinusoid table (ours, permuted: tested)
ACTIVATIONS = ("relu", "gelu")


def unsupported(m: ModelConfig) -> list[str]:
  """`key=value` of each option of `m` Marian has no counterpart for (empty: it maps)."""
  wanted = {"kind": "encoder_decoder", "pre_norm": False, "position": "sinusoidal", "norm": "layernorm",
            "attn_logit_softcap": 0.0, "sliding_window": 0, "attention_bias": "none", "mlp_bias": True,
            "embedding_scale": True, "attention_head_dim": 0, "pad_id": 0}
  return L.mismatches(m, wanted, {"ffn": m.ffn in ACTIVATIONS, "num_kv_heads": m.kv_heads == m.num_heads})


def sinusoid_basis(d_model: int) -> L.Basis:
  """Marian's feature k is our feature perm[k]: sines (our even features), then cosines (odd)."""
  return L.Basis(np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)]))


def hf_config(config: Config):
  """The `transformers.MarianConfig` of our model config."""
  import transformers  # noqa: PLC0415
  m = config.model
  v = m.vocab_size + 1
  return transformers.MarianConfig(
      vocab_size=v, decoder_vocab_size=v, d_model=m.d_model, encoder_layers=m.num_encoder_layers,
      decoder_layers=m.num_decoder_layers, encoder_attention_heads=m.num_heads, decoder_attention_heads=m.num_heads,
      encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff, activation_function=m.ffn, max_position_embeddings=m.max_length,
      scale_embedding=True, share_encoder_decoder_embeddings=m.tie_embeddings, tie_word_embeddings=m.tie_embeddings,
      dropout=m.dropout_rate, attention_dropout=m.attention_dropout_rate, activation_dropout=0.0,
      pad_token_id=m.vocab_size, decoder_start_token_id=BOS_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID,
      forced_eos_token_id=None, architectures=[ARCHITECTURE])


def generation(m: ModelConfig) -> dict:
  """generation_config.json fields: greedy from BOS; neither pad is ever generated (our decoding excludes PAD)."""
  return {"decoder_start_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": m.vocab_size,
          "bos_token_id": BOS_ID, "suppress_tokens": [PAD_ID, m.vocab_size], "num_beams": 1,
          "max_length": m.max_length, "forced_eos_token_id": None}


def model_config(hf) -> dict:
  """Our `model.*` fields for a `MarianConfig` (pad as the last id; see the module docstring).

  Raises:
    ValueError: options jaxformer has no counterpart for (named in one line).
  """
  decoder = (hf.decoder_attention_heads, hf.decoder_ffn_dim)
  bad = [f"{k}={v}" for k, v, ok in (
      ("activation_function", hf.activation_function, hf.activation_function in ACTIVATIONS),
      ("scale_embedding", hf.scale_embedding, hf.scale_embedding),
      ("normalize_before", getattr(hf, "normalize_before", False), not getattr(hf, "normalize_before", False)),
      ("pad_token_id", hf.pad_token_id, hf.pad_token_id == hf.vocab_size - 1),
      # ours starts the decoder from BOS; published Marian models from a zero (pad) embedding
      ("decoder_start_token_id", hf.decoder_start_token_id, hf.decoder_start_token_id == BOS_ID),
      ("decoder_vocab_size", hf.decoder_vocab_size, (hf.decoder_vocab_size or hf.vocab_size) == hf.vocab_size),
      ("decoder_attention_heads/ffn_dim", decoder, decoder == (hf.encoder_attention_heads, hf.encoder_ffn_dim)))
         if not ok]
  if bad:
    raise ValueError(f"this Marian model has options jaxformer has no counterpart for: {', '.join(bad)}")
  return dict(kind="encoder_decoder", vocab_size=hf.vocab_size - 1, d_model=hf.d_model,
              num_heads=hf.encoder_attention_heads, d_ff=hf.encoder_ffn_dim, num_encoder_layers=hf.encoder_layers,
              num_decoder_layers=hf.decoder_layers, dropout_rate=hf.dropout,
              attention_dropout_rate=hf.attention_dropout,
              pre_norm=False, tie_embeddings=bool(hf.tie_word_embeddings and hf.share_encoder_decoder_embeddings),
              max_length=hf.max_position_embeddings, position="sinusoidal", norm="layernorm",
              ffn=hf.activation_function)


def _attention(ours: str, hf: str, m: ModelConfig, basis: L.Basis) -> tuple[list, list]:
  d, n, h = m.d_model, m.num_heads, m.head_dim
  links = [L.linear_in(f"{ours}/{name}", f"{hf}.{short}_proj.weight", basis, (d, n, h))
           for name, short in (("query", "q"), ("key", "k"), ("value", "v"))]
  links.append(L.linear_out(f"{ours}/out", f"{hf}.out_proj.weight", basis, (n, h, d)))
  consts = [L.Const(f"{hf}.{s}_proj.bias", np.zeros(n * h if s != "out" else d, np.float32))
            for s in ("q", "k", "v", "out")]
  return links, consts


def _block(ours: str, hf: str, m: ModelConfig, basis: L.Basis, sublayers: list[tuple[str, str, str]]):
  """Links of one Marian layer: `sublayers` are (our sublayer, its attention module or "ffn", Marian's norm name)."""
  links, consts = [], []
  for sublayer, module, norm in sublayers:
    links += [L.vector(f"{ours}/{sublayer}/norm/scale", f"{hf}.{norm}.weight", basis),
              L.vector(f"{ours}/{sublayer}/norm/bias", f"{hf}.{norm}.bias", basis)]
    if module == "ffn":
      links += [L.linear_in(f"{ours}/ffn/wi", f"{hf}.fc1.weight", basis, (m.d_model, m.d_ff)),
                L.plain(f"{ours}/ffn/bi", f"{hf}.fc1.bias"),
                L.linear_out(f"{ours}/ffn/wo", f"{hf}.fc2.weight", basis, (m.d_ff, m.d_model)),
                L.vector(f"{ours}/ffn/bo", f"{hf}.fc2.bias", basis)]
    else:
      more, more_consts = _attention(f"{ours}/{module}", f"{hf}.{'encoder_attn' if 'cross' in module else 'self_attn'}",
                                     m, basis)
      links, consts = links + more, consts + more_consts
  return links, consts


def links(m: ModelConfig) -> tuple[list[L.Link], list[L.Const]]:
  """The tensor table of a `MarianMTModel` state dict (see `links`)."""
  basis = sinusoid_basis(m.d_model)
  if m.tie_embeddings:
    out = [L.embedding("embed/embedding", "model.shared.weight", basis, extra_rows=1)]
  else:
    out = [L.embedding("source_embed/embedding", "model.encoder.embed_tokens.weight", basis, extra_rows=1),
           L.embedding("target_embed/embedding", "model.decoder.embed_tokens.weight", basis, extra_rows=1),
           L.Link(("output_proj",), "lm_head.weight", lambda w: np.pad(basis.to_hf(w.T, 1), ((0, 1), (0, 0))),
                  lambda y: (basis.from_hf(y[:-1], 1).T,))]
  consts = [L.Const("final_logits_bias", np.zeros((1, m.vocab_size + 1), np.float32))]
  for i in range(m.num_encoder_layers):
    more, c = _block(f"encoder_{i}", f"model.encoder.layers.{i}", m, basis,
                     [("attention_sublayer", "self_attention", "self_attn_layer_norm"),
                      ("ffn_sublayer", "ffn", "final_layer_norm")])
    out, consts = out + more, consts + c
  for i in range(m.num_decoder_layers):
    more, c = _block(f"decoder_{i}", f"model.decoder.layers.{i}", m, basis,
                     [("self_attention_sublayer", "self_attention", "self_attn_layer_norm"),
                      ("cross_attention_sublayer", "cross_attention", "encoder_attn_layer_norm"),
                      ("ffn_sublayer", "ffn", "final_layer_norm")])
    out, consts = out + more, consts + c
  return out, consts
