"""The PyTorch peers of the benchmark, built to the same model as ours and trained the same way,
so tokens/s can be compared at one shape: `torch.nn.Transformer` for `EncoderDecoder`, and a
causal `torch.nn.TransformerEncoder` for `DecoderOnly` (the GPT stack nanoGPT writes by hand:
its attention is the same `scaled_dot_product_attention` call with `is_causal`).

Same as ours: d_model, heads, d_ff, layers, ReLU, post-LN (or pre-LN), LayerNorm epsilon,
residual and embedding dropout, attention dropout, one embedding matrix shared by source,
target and output logits (or separate ones), embeddings × √d_model plus sinusoidal
positions, padding and causal masks, label-smoothed cross-entropy over non-padding tokens,
Adam with the config's betas and epsilon (and global-norm clipping / weight decay when set).
To make the two the same model, the torch defaults that the paper's model lacks are
removed: attention projection biases, the dropout inside the FFN and the final encoder and
decoder LayerNorms of post-LN stacks. The decoder-only peer reads `inputs` and scores its
logits against `targets` (the inputs shifted by one), as the causal LM task does. The learning
rate is held at the schedule's first value (the schedule's cost is negligible). Imported only
when torch is installed.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch
from torch import nn

from jaxformer.config import Config, ModelConfig
from jaxformer.layers.embedding import sinusoid_table
from jaxformer.models.transformer import BOS_ID, PAD_ID
from jaxformer.train.optim import make_schedule


def _strip_to_paper(layers: list[nn.Module], m: ModelConfig) -> None:
  """Removes the torch-only parts of `layers` listed in the module docstring, in place."""
  for layer in layers:
    attentions = [layer.self_attn] + ([layer.multihead_attn] if hasattr(layer, "multihead_attn") else [])
    for attn in attentions:
      attn.in_proj_bias = None
      attn.out_proj.bias = None
      attn.dropout = m.attention_dropout_rate
    layer.dropout = nn.Identity()  # the FFN's hidden dropout


def _layer_options(m: ModelConfig) -> dict:
  """The torch layers' arguments for `m`: sizes, ReLU, dropout, `model.norm_epsilon`, pre- or post-LN."""
  return dict(
    d_model=m.d_model,
    nhead=m.num_heads,
    dim_feedforward=m.d_ff,
    dropout=m.dropout_rate,
    activation="relu",
    layer_norm_eps=m.norm_epsilon,
    batch_first=True,
    norm_first=m.pre_norm,
  )


class _Peer(nn.Module):
  """What both peers share: the config, the sinusoidal table `positions` `[max_length, d_model]`
  and the embedding dropout."""

  def __init__(self, m: ModelConfig):
    super().__init__()
    self.config = m
    self.dropout = nn.Dropout(m.dropout_rate)
    table = np.array(sinusoid_table(m.max_length, m.d_model))
    self.register_buffer("positions", torch.from_numpy(table), persistent=False)

  def _embed(self, embed: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """Embeddings × √d_model plus positions, then dropout: `[batch, length, d_model]`."""
    x = embed(ids) * self.config.d_model**0.5 + self.positions[: ids.shape[1]]
    return self.dropout(x)

  def _logits(self, y: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
    """`[batch, length, vocab_size]` logits of the final states `y`: tied to `embed`, or the
    untied `output_proj`."""
    return y @ embed.weight.T if self.output_proj is None else self.output_proj(y)


class PeerTransformer(_Peer):
  """`torch.nn.Transformer` (batch_first) with embeddings and tied logits.

  forward(inputs int64 `[batch, src_len]`, targets int64 `[batch, tgt_len]`) -> float32
  logits `[batch, tgt_len, vocab_size]`, teacher-forced on targets shifted right with BOS.
  """

  def __init__(self, m: ModelConfig):
    super().__init__(m)
    self.source_embed = nn.Embedding(m.vocab_size, m.d_model)
    self.target_embed = self.source_embed if m.tie_embeddings else nn.Embedding(m.vocab_size, m.d_model)
    self.output_proj = None if m.tie_embeddings else nn.Linear(m.d_model, m.vocab_size, bias=False)
    for embed in dict.fromkeys([self.source_embed, self.target_embed]):  # as jaxformer's Embed: N(0, 1/d_model)
      nn.init.normal_(embed.weight, std=m.d_model**-0.5)
    with warnings.catch_warnings():  # pre-LN: a note that inference fast paths are off (we train)
      warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
      self.transformer = nn.Transformer(
        num_encoder_layers=m.num_encoder_layers, num_decoder_layers=m.num_decoder_layers, **_layer_options(m)
      )
    _strip_to_paper([*self.transformer.encoder.layers, *self.transformer.decoder.layers], m)
    if not m.pre_norm:
      self.transformer.encoder.norm = None
      self.transformer.decoder.norm = None

  def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logits `[batch, tgt_len, vocab_size]` of int `inputs` `[batch, src_len]` and `targets`
    `[batch, tgt_len]` (teacher forcing: the decoder reads BOS + targets shifted right)."""
    decoder_inputs = torch.cat([torch.full_like(targets[:, :1], BOS_ID), targets[:, :-1]], dim=1)
    decoder_inputs = decoder_inputs.masked_fill(targets == PAD_ID, PAD_ID)
    src_pad, tgt_pad = inputs == PAD_ID, decoder_inputs == PAD_ID  # True = masked out
    length = targets.shape[1]
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    y = self.transformer(
      self._embed(self.source_embed, inputs),
      self._embed(self.target_embed, decoder_inputs),
      tgt_mask=causal,
      src_key_padding_mask=src_pad,
      tgt_key_padding_mask=tgt_pad,
      memory_key_padding_mask=src_pad,
    )
    return self._logits(y, self.target_embed)


class PeerDecoderOnly(_Peer):
  """A causal `torch.nn.TransformerEncoder` (batch_first) with tied embeddings: `DecoderOnly`
  with the paper's options (pre-LN closes with a LayerNorm, as ours does).

  forward(inputs int64 `[batch, length]`) -> float32 logits `[batch, length, vocab_size]`.
  """

  def __init__(self, m: ModelConfig):
    super().__init__(m)
    self.embed = nn.Embedding(m.vocab_size, m.d_model)
    nn.init.normal_(self.embed.weight, std=m.d_model**-0.5)
    self.output_proj = None if m.tie_embeddings else nn.Linear(m.d_model, m.vocab_size, bias=False)
    layer = nn.TransformerEncoderLayer(**_layer_options(m))
    final_norm = nn.LayerNorm(m.d_model, eps=m.norm_epsilon) if m.pre_norm else None
    with warnings.catch_warnings():  # pre-LN: a note that inference fast paths are off (we train)
      warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
      self.stack = nn.TransformerEncoder(layer, m.num_decoder_layers, norm=final_norm)
    _strip_to_paper(list(self.stack.layers), m)

  def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token logits `[batch, length, vocab_size]` of int `inputs` `[batch, length]` (no
    padding: the benchmark's batches have none); `targets` is ignored."""
    length = inputs.shape[1]
    causal = torch.triu(torch.full((length, length), float("-inf")), diagonal=1)
    y = self.stack(self._embed(self.embed, inputs), mask=causal, is_causal=True)
    return self._logits(y, self.embed)


def count_parameters(model: nn.Module) -> int:
  """Trainable scalars, each shared tensor counted once."""
  return sum(p.numel() for p in model.parameters())


class TorchTrainer:
  """One fixed batch and a training step on it; calling the trainer runs a step and returns
  its loss per target token. Uses as many threads as the process may use cores."""

  def __init__(self, config: Config, inputs: np.ndarray, targets: np.ndarray, translates: bool = True):
    self.threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(self.threads)
    torch.manual_seed(config.runtime.seed)
    self.model = (PeerTransformer if translates else PeerDecoderOnly)(config.model).train()
    self.inputs = torch.from_numpy(inputs.astype(np.int64))
    self.targets = torch.from_numpy(targets.astype(np.int64))
    o = config.optim
    lr = float(make_schedule(o, config.model.d_model)(0))
    optim_cls = torch.optim.AdamW if o.weight_decay > 0 else torch.optim.Adam
    self.optimizer = optim_cls(
      self.model.parameters(), lr=lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay
    )
    self.clip_grad_norm = o.clip_grad_norm
    self.label_smoothing = o.label_smoothing
    self.losses: list[float] = []

  def __call__(self) -> float:
    """Runs one training step on the fixed batch; returns its loss (float)."""
    self.optimizer.zero_grad(set_to_none=True)
    logits = self.model(self.inputs, self.targets)
    loss = nn.functional.cross_entropy(
      logits.reshape(-1, logits.shape[-1]),
      self.targets.reshape(-1),
      ignore_index=PAD_ID,
      label_smoothing=self.label_smoothing,
    )
    loss.backward()
    if self.clip_grad_norm > 0:
      nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
    self.optimizer.step()
    self.losses.append(loss.item())
    return self.losses[-1]

  def info(self) -> dict:
    """`torch_version`, `torch_threads` and `torch_parameters` (trainable scalars) for the bench report."""
    return {
      "torch_version": torch.__version__,
      "torch_threads": self.threads,
      "torch_parameters": count_parameters(self.model),
    }
