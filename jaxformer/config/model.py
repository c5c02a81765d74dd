"""The model section of a run's config (`model.*`): the Transformer's shape and architecture
options, checked on their own (`ModelConfig.validate`; the checks that need other sections are
in `config/options.validate_with_data`). `jaxformer.config` re-exports `ModelConfig`.
"""

from __future__ import annotations

import dataclasses

from jaxformer.config.options import ROPE_SCALINGS, validate_architecture
from jaxformer.errors import ConfigError
from jaxformer.layers.remat import POLICY_NAMES as REMAT_POLICIES
from jaxformer.tasks import TASKS

# Valid names of the string-valued model options.
CHOICES: dict[str, tuple[str, ...]] = {
  "position": ("sinusoidal", "learned", "rope", "alibi", "t5", "none"),
  "norm": ("layernorm", "rmsnorm"),
  "ffn": ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_tanh"),
  "attention": ("dense", "blockwise", "linformer", "fused", "splash"),
  "attention_bias": ("none", "qkv", "all"),
  "rope_scaling": ROPE_SCALINGS,
}

MODEL_KINDS = tuple(TASKS)  # the task registry's model kinds


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Transformer shape (Vaswani et al. 2017, Table 3 names).

  `kind`: encoder_decoder (the paper's translation model), decoder_only (causal LM,
  `num_decoder_layers` blocks) or encoder_only (BERT-style masked LM, `num_encoder_layers`).
  """

  kind: str = "encoder_decoder"  # encoder_decoder (translation) | decoder_only (causal LM) | encoder_only (masked LM)
  vocab_size: int = 8000  # shared source/target vocabulary, tokens (data.tokenizer=char: unset = from the data)
  # Not a user key: the loader sets it when data.tokenizer=char leaves model.vocab_size unset, and
  # training sizes the vocabulary from the data (`data.fit_vocab_size`).
  vocab_from_data: bool = dataclasses.field(
    default=False,
    metadata={
      "set_by": "data.tokenizer=char with model.vocab_size unset",
      "example": "model.vocab_size=67, or leave it unset",
    },
  )
  d_model: int = 256  # width of the residual stream and embeddings
  num_heads: int = 4  # attention heads (d_model / num_heads = head_dim)
  attention_head_dim: int = 0  # width of each head; 0 = d_model / num_heads (Llama 3.2 3B-style models set it)
  d_ff: int = 1024  # hidden width of the position-wise feed-forward network
  num_encoder_layers: int = 3  # encoder blocks (encoder_decoder, encoder_only)
  num_decoder_layers: int = 3  # decoder blocks (encoder_decoder, decoder_only)
  dropout_rate: float = 0.1  # residual, embedding (paper section 5.4)
  attention_dropout_rate: float = 0.0  # dropout on the attention weights
  pre_norm: bool = False  # paper: post-LN
  tie_embeddings: bool = True  # one matrix for source, target and output logits
  max_length: int = 256  # longest sequence the positional table covers, tokens
  # Compute dtype read by the modules; not a user key: Config sets it from precision.policy.
  dtype: str = dataclasses.field(
    default="float32",
    metadata={
      "set_by": "precision.policy",
      "example": "precision.policy=params=float32,compute=bfloat16,output=float32",
    },
  )
  # Architecture options beyond the paper (the defaults are the paper's model).
  position: str = "sinusoidal"  # sinusoidal | learned | rope | alibi | t5 | none
  relative_buckets: int = 32  # t5: buckets of the shared relative-position bias table
  relative_max_distance: int = 128  # t5: distance (tokens) from which all keys share the last bucket
  rope_theta: float = 10000.0  # rope: base of the frequencies (Llama 3: 500000)
  rope_scaling: str = "none"  # rope past the trained context: none | linear | ntk | dynamic | yarn | llama3
  rope_scaling_factor: float = 1.0  # rope_scaling: extended / trained context
  rope_trained_length: int = 0  # dynamic/yarn/llama3: the trained context, tokens; 0 = max_length / factor
  rope_low_freq_factor: float = 1.0  # llama3: wavelengths over trained_length / this are interpolated
  rope_high_freq_factor: float = 4.0  # llama3: wavelengths under trained_length / this are kept
  norm: str = "layernorm"  # layernorm | rmsnorm
  norm_epsilon: float = 1e-6  # epsilon of every LayerNorm / RMSNorm (BERT, Marian: 1e-5 or 1e-12)
  ffn: str = "relu"  # relu | gelu | gelu_tanh | silu | swiglu | geglu | geglu_tanh
  mlp_bias: bool = True  # biases in the FFN (Llama, Mistral, Qwen2 and T5 have none)
  attention_bias: str = "none"  # none | qkv (Qwen2) | all (also the output projection: GPT-2, BERT, Marian)
  embedding_scale: bool = True  # token embeddings times sqrt(d_model) (paper 3.4); GPT-2, Llama, BERT: false
  embedding_norm: bool = False  # a norm over the summed embeddings, before dropout (BERT, RoBERTa); not encoder_decoder
  type_vocab_size: int = 0  # rows of a token-type (segment) table; every token is type 0 (BERT: 2); 0 = none
  position_offset: int = 0  # learned: position p reads table row p + offset (RoBERTa: pad_id + 1); 0 = none
  mlm_head: bool = False  # encoder_only: LayerNorm(act(x W + b)) before the logits, plus an output bias (BERT)
  logits_bias: bool = False  # encoder_decoder: a learned [vocab_size] bias added to the logits (Marian)
  pad_id: int = 0  # the id the model masks as padding (and never caches); -1 = none (GPT-2, Llama)
  bos_id: int = 2  # the start token (our decoders start with it; Llama's tokenizer prepends it)
  eos_id: int = 3  # the end token: decoding stops there, data appends it
  decoder_start_id: int = -1  # an encoder-decoder's first decoder input; -1 = bos_id (Marian: its pad)
  mask_id: int = -1  # the masked LM's [MASK] (an imported BERT's); -1 = the last id, beyond the tokenizer's
  num_kv_heads: int = 0  # key/value heads (grouped-query); 0 = num_heads, 1 = multi-query
  attn_logit_softcap: float = 0.0  # c > 0: attention scores become c * tanh(score / c); 0 = off
  sliding_window: int = 0  # causal self-attention sees the last w tokens (itself included); 0 = all
  global_tokens: int = 0  # with sliding_window: positions < N see every key and every query sees them
  attention: str = "dense"  # dense | blockwise (memory-linear) | linformer (encoder) | fused (jax.nn) | splash
  linformer_k: int = 64  # linformer: keys/values projected along the sequence to this many rows
  attention_block_size: int = 128  # blockwise: keys (and causal/window queries) per block; splash: queries, keys
  remat: str = "none"  # per-block rematerialisation: none | full | save_dots | minimal (layers/remat.py)
  scan_layers: bool = False  # nn.scan over each layer stack (shorter compile; params get a leading layers axis)
  num_experts: int = 0  # >0: every FFN becomes a mixture of this many experts (layers/moe.py); 0 = dense
  experts_per_token: int = 2  # experts each token is routed to (top-k)
  expert_capacity_factor: float = 1.25  # an expert takes ceil(f * length * k / E) tokens per row; 0 = no limit
  router_aux_loss: float = 0.01  # weight of the load-balancing loss (Switch Transformer)
  router_z_loss: float = 0.001  # weight of the router z-loss (ST-MoE)
  # LoRA (Hu et al. 2021; layers/lora.py): adapters beside the named projections; only they train.
  # The dtype LoRA's frozen projection kernels are held in; not a user key: precision.policy's params sets it.
  frozen_dtype: str = dataclasses.field(
    default="float32",
    metadata={"set_by": "precision.policy", "example": "precision.policy=params=bfloat16,compute=bfloat16 (with LoRA)"},
  )
  lora_rank: int = 0  # rank r of the adapters; 0 = off (full fine-tuning)
  lora_alpha: float = 16.0  # the adapters add (lora_alpha / lora_rank) * x A B to each target's x W
  lora_targets: tuple[str, ...] = ("query", "value")  # among query, key, value, out, mlp_in (wi, wi_gate), mlp_out

  def validate(self) -> None:
    """Raises ConfigError (one line) for an unknown kind, dtype or option, a size <= 0 or a rate outside [0, 1)."""
    if self.kind not in MODEL_KINDS:
      raise ConfigError(f"model.kind={self.kind!r} is unknown; use one of {', '.join(MODEL_KINDS)}")
    if self.d_model % self.num_heads and not self.attention_head_dim:
      raise ConfigError(
        f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}; "
        f"choose num_heads among {[h for h in range(1, 33) if self.d_model % h == 0]} "
        "or set model.attention_head_dim"
      )
    for name in (
      "vocab_size",
      "d_model",
      "num_heads",
      "d_ff",
      "num_encoder_layers",
      "num_decoder_layers",
      "max_length",
    ):
      if getattr(self, name) <= 0:
        raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
    for name in ("dropout_rate", "attention_dropout_rate"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ConfigError(f"model.dtype={self.dtype!r} is unknown; use float32, bfloat16 or float16")
    for name, valid in CHOICES.items():
      if getattr(self, name) not in valid:
        raise ConfigError(f"model.{name}={getattr(self, name)!r} is unknown; use one of {', '.join(valid)}")
    validate_architecture(self)
    if self.remat not in REMAT_POLICIES:
      raise ConfigError(f"model.remat={self.remat!r} is unknown; use one of {', '.join(REMAT_POLICIES)}")

  @property
  def head_dim(self) -> int:
    """Width of each attention head: `attention_head_dim`, or `d_model // num_heads` when it is 0."""
    return self.attention_head_dim or self.d_model // self.num_heads

  @property
  def special_ids(self):
    """The model's `data.special_ids.SpecialIds` (pad, bos, eos, decoder start, mask; unk is the
    tokenizer's)."""
    from jaxformer.data.special_ids import SpecialIds  # noqa: PLC0415  (the config loads without numpy)

    return SpecialIds(
      pad=self.pad_id, bos=self.bos_id, eos=self.eos_id, decoder_start=self.decoder_start_id, mask=self.mask_id
    )

  @property
  def kv_heads(self) -> int:
    """Key/value heads: `num_kv_heads`, or `num_heads` when it is 0."""
    return self.num_kv_heads or self.num_heads
