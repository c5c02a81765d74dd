"""The paper's encoder-decoder Transformer (Vaswani et al. 2017, Figure 1).

Token id 0 is padding everywhere; padding masks are derived from the ids.

Packed batches put several examples in one row: segment ids, int `[batch, length]`, number
the examples of a row 1, 2, 3, ... (0 on padding) and positions, int `[batch, length]`,
restart at 0 in each example. Attention never crosses segments (target segment k attends
to source segment k), so each example's logits equal those of the example alone.

Layer stacks are either unrolled (params `encoder_0`, `encoder_1`, ...) or, with
`model.scan_layers`, one `nn.scan` per stack (params `encoder`, `decoder`, each leaf with
a leading `[num_layers]` axis named `layers`, and likewise the decoder's `cache`). The
scanned layout is a pure re-layout: the same init, dropout masks and losses
(`models.layout`, which also converts params and checkpoints between the layouts).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import sharding as sh
from jaxformer.config import ModelConfig
from jaxformer.data.special_ids import SpecialIds
from jaxformer.layers import int8
from jaxformer.layers.dropout import Dropout
from jaxformer.layers.embedding import Embed, sinusoidal_positions
from jaxformer.layers.kv_cache import CacheState
from jaxformer.layers.moe import AUX
from jaxformer.layers.norm import make_norm
from jaxformer.layers.positions import LearnedPositions, t5_table
from jaxformer.layers.remat import remat_block
from jaxformer.layers.token_sum import add_bias
from jaxformer.models.blocks import BLOCK_AXES, DecoderBlock, EncoderBlock
from jaxformer.models.layout import StackedInit, layer_rngs

PAD_ID, BOS_ID = SpecialIds().pad, SpecialIds().bos  # our tokenizers' (the defaults of functions below)


def segment_starts(segment_ids: jax.Array) -> jax.Array:
  """bool `[batch, length]`: True where a segment begins (position 0, or the segment id
  differs from the previous position's) for int `[batch, length]` segment ids."""
  previous = jnp.pad(segment_ids, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
  return segment_ids != previous


def shift_right(
  targets: jax.Array, bos_id: int = BOS_ID, segment_ids: jax.Array | None = None, pad_id: int = PAD_ID
) -> jax.Array:
  """Decoder inputs from targets: `[BOS, y1, ..., y_{T-1}]` (int `[batch, length]`; `bos_id`: the
  decoder's start token, `model.special_ids.start`).

  Padding (`pad_id`) stays padding, so the decoder's padding mask equals the target's. With int
  `segment_ids` `[batch, length]` (packed rows) every segment is shifted on its own: its
  first token becomes BOS and no token of one segment moves into the next.
  """
  shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
  if segment_ids is not None:
    shifted = jnp.where(segment_starts(segment_ids), bos_id, shifted)
  return jnp.where(targets == pad_id, pad_id, shifted)


def default_positions(tokens: jax.Array) -> jax.Array:
  """int32 `[batch, length]` positions 0..length-1."""
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """int32 `[batch, length]` positions restarting at 0 at every segment start (see
  `segment_starts`) of int `[batch, length]` segment ids."""
  index = default_positions(segment_ids)
  start = jax.lax.cummax(jnp.where(segment_starts(segment_ids), index, 0), axis=1)
  return index - start


def resolve_positions(
  tokens: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
  """Positions for the embeddings, int `[batch, length]`, and for self-attention (RoPE,
  ALiBi, causal / window masks): the given `positions`; else, for packed rows, the
  per-segment positions; else 0..length-1 and None (attention uses the token index)."""
  if positions is None and segment_ids is not None:
    positions = segment_positions(segment_ids)
  if positions is None:
    return default_positions(tokens), None
  return positions, positions


def layer_stack(block: type[nn.Module], config: ModelConfig, num_layers: int, name: str, pipeline=None, **block_fields):
  """The blocks of one stack, each wrapped in the remat policy: a list of `num_layers`
  modules named `{name}_{i}`, or one `nn.scan` module named `name` (`model.scan_layers`),
  or, scanned with a `models.pipeline.Pipeline`, that pipeline's stack of the same params.
  Call it with `run_stack`."""
  scan = config.scan_layers
  if scan and pipeline is not None:
    return pipeline.stack(block, config, num_layers, name, **block_fields)
  num_args = len(inspect.signature(block.__call__).parameters) - 2  # after self and the carry
  block = remat_block(block, config.remat, block.STATIC_ARGNUMS, prevent_cse=not scan)
  if not scan:
    return [block(config, name=f"{name}_{i}", **block_fields) for i in range(num_layers)]
  # Every argument after the carry (masks, encoder output, flags) is the same for all
  # layers, except the last: the layers' dropout keys. Params are initialised unrolled
  # (`StackedInit`), so no rng is split here.
  scanned = nn.scan(
    block,
    variable_axes={"params": 0, "cache": 0, AUX: 0},
    split_rngs={"params": True},
    in_axes=(nn.broadcast,) * (num_args - 1) + (0,),
    length=num_layers,
    metadata_params={nn.PARTITION_NAME: sh.LAYERS},
  )
  return scanned(config, name=name, **block_fields)


def run_stack(stack, x: jax.Array, *args, rngs: jax.Array | None = None) -> jax.Array:
  """Applies a `layer_stack` to `x` `[batch, length, d_model]`; `args` follow the carry and
  `rngs` are the layers' dropout keys from `layer_rngs` (layer i gets `rngs[i]`), or None."""
  if isinstance(stack, (list, tuple)):
    for i, block in enumerate(stack):
      x = block(x, *args, None if rngs is None else rngs[i])
    return x
  return stack(x, *args, rngs)[0]


def advance(state: CacheState, tokens: jax.Array, pad_id: int = PAD_ID) -> CacheState:
  """`state` after caching int `[batch, T]` tokens: each row's length grows by its non-PAD tokens."""
  return state.replace(lengths=state.lengths + jnp.sum(tokens != pad_id, axis=1, dtype=jnp.int32))


def start_is_pad(config: ModelConfig) -> bool:
  """Whether the decoder's start token is the pad id (T5, published Marian): it is then a real
  token at the first position of each target, not padding."""
  ids = config.special_ids
  return ids.pad >= 0 and ids.start == ids.pad


def cache_positions(state: CacheState, tokens: jax.Array) -> jax.Array:
  """int32 `[batch, length]` positions of `tokens` fed to a cached model: row b's continue
  from the `state.lengths[b]` tokens already cached."""
  return state.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]


def bias_table(module: nn.Module, config: ModelConfig, name: str) -> jax.Array | None:
  """A stack's T5 bias table `[relative_buckets, num_heads]`, the param `name` of `module`,
  shared by the stack's layers (`model.position=t5`); None for other position schemes."""
  if config.position != "t5":
    return None
  return t5_table(module, name, config.relative_buckets, config.num_heads)


def embed_tokens(
  config: ModelConfig, embed: Embed, tokens: jax.Array, positions: jax.Array, learned: LearnedPositions | None = None
) -> jax.Array:
  """Token embeddings plus absolute positions, `[batch, length, d_model]`.

  Sinusoidal (paper section 3.5) or learned (`learned`) positions are added to the
  embedding; rope and alibi act inside self-attention instead, and `none` adds nothing.
  """
  x = embed(tokens)
  if config.position == "sinusoidal":
    x = x + sinusoidal_positions(positions, config.d_model, config.max_length).astype(embed.dtype)
  elif config.position == "learned":
    x = x + learned(positions)
  return x


# Vocabulary-major logits pay a transpose of the [vocab, tokens] product, which XLA fuses
# into the logits' readers: at 32 tokens greedy decoding is about 5% faster, at 128 (beam 4
# over 32 sentences) the beam step's several reads of the transposed logits made it 1.5x slower.
VOCAB_MAJOR_TOKENS = 32


def output_logits(
  config: ModelConfig,
  embed: Embed,
  output_proj: jax.Array | None,
  y: jax.Array,
  decode: bool = False,
  bias: jax.Array | None = None,
) -> jax.Array:
  """float32 logits `[batch, length, vocab_size]` from `y` `[batch, length, d_model]`: the
  tied embedding (`model.tie_embeddings`, section 3.4) or `output_proj` `[d_model, vocab]`,
  plus `bias` `[vocab_size]` when given (`model.logits_bias`). `decode`: a cached step; with at
  most VOCAB_MAJOR_TOKENS tokens, the tied product runs vocabulary-major (`Embed.attend`)."""
  if config.tie_embeddings:
    logits = embed.attend(y, vocab_major=decode and y.shape[0] * y.shape[1] <= VOCAB_MAJOR_TOKENS)
  else:
    dtype = jnp.dtype(config.dtype)
    b, t, d = y.shape  # one 2-D matmul over the tokens (see layers/attention.py `_project`)
    if int8.is_quantized(output_proj):  # decoding with int8 weights (`layers.int8`)
      logits = int8.matmul(y.reshape(b * t, d).astype(dtype), output_proj)
    else:
      logits = jnp.einsum("md,dv->mv", y.reshape(b * t, d).astype(dtype), output_proj.astype(dtype))
    logits = logits.reshape(b, t, -1).astype(jnp.float32)
  if bias is not None:
    logits = add_bias(logits, bias.astype(jnp.float32))
  return sh.constrain(logits, (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_VOCAB))


def untied_output_proj(module: nn.Module, config: ModelConfig) -> jax.Array:
  """The `[d_model, vocab_size]` output projection parameter of an untied model."""
  return sh.param(
    module, "output_proj", nn.initializers.xavier_uniform(), (sh.EMBED, sh.VOCAB), (config.d_model, config.vocab_size)
  )


class EncoderDecoder(StackedInit, nn.Module):
  """Encoder-decoder Transformer.

  Methods:
    encode(inputs) -> `[batch, src_len, d_model]` from int `[batch, src_len]` source ids.
    decode(encoded, inputs, decoder_inputs, ...) -> float32 logits `[batch, tgt_len, vocab_size]`.
    __call__(inputs, targets) -> logits for teacher forcing (targets shifted right with BOS).
  Each takes optional segment ids and per-segment positions for packed rows (module docstring).
  """

  config: ModelConfig
  pipeline: Any = None  # a `models.pipeline.Pipeline` (training and evaluation steps on a stage mesh), or None
  STACKS: ClassVar = (("encoder", "num_encoder_layers"), ("decoder", "num_decoder_layers"))
  ENCODES_SOURCE: ClassVar[bool] = True  # `prefill` caches the encoded source, then BOS

  def setup(self):
    """Creates the embeddings, positions, encoder and decoder stacks for `config`."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    if cfg.tie_embeddings:
      embed = Embed(cfg.vocab_size, cfg.d_model, dtype, cfg.embedding_scale, name="embed")
      self.source_embed = self.target_embed = embed
    else:
      self.source_embed = Embed(cfg.vocab_size, cfg.d_model, dtype, cfg.embedding_scale, name="source_embed")
      self.target_embed = Embed(cfg.vocab_size, cfg.d_model, dtype, cfg.embedding_scale, name="target_embed")
      self.output_proj = untied_output_proj(self, cfg)
    if cfg.logits_bias:  # Marian's final_logits_bias
      self.logits_bias = sh.param(self, "logits_bias", nn.initializers.zeros, (sh.VOCAB,), (cfg.vocab_size,))
    self.encoder_stack = layer_stack(EncoderBlock, cfg, cfg.num_encoder_layers, "encoder", self.pipeline)
    self.decoder_stack = layer_stack(DecoderBlock, cfg, cfg.num_decoder_layers, "decoder", self.pipeline)
    self.encoder_bias = bias_table(self, cfg, "encoder_relative_bias")
    self.decoder_bias = bias_table(self, cfg, "decoder_relative_bias")
    if cfg.pre_norm:  # pre-LN leaves the residual stream unnormalized: close each stack with a norm
      self.encoder_norm = make_norm(cfg.norm, dtype, epsilon=cfg.norm_epsilon)
      self.decoder_norm = make_norm(cfg.norm, dtype, epsilon=cfg.norm_epsilon)
    if cfg.position == "learned":
      self.source_positions = LearnedPositions(cfg.max_length, cfg.d_model, dtype)
      self.target_positions = LearnedPositions(cfg.max_length, cfg.d_model, dtype)
    self.dropout = Dropout(cfg.dropout_rate)

  def _embed(self, embed: Embed, tokens, positions, deterministic, learned=None):
    x = embed_tokens(self.config, embed, tokens, positions, learned)
    return sh.constrain(self.dropout(x, deterministic=deterministic), BLOCK_AXES)

  def encode(
    self,
    inputs: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    deterministic: bool = True,
  ) -> jax.Array:
    """Encoder stack over int `[batch, src_len]` ids -> `[batch, src_len, d_model]`.

    Args:
      inputs: int `[batch, src_len]` source ids, PAD (0) padded.
      segment_ids: int `[batch, src_len]` packed-example ids (1, 2, ..., 0 on padding), or None.
      positions: int `[batch, src_len]` positions, restarting at 0 in each segment; None =
        derived from `segment_ids`, or 0..src_len-1 when unpacked.
    """
    valid = inputs != self.config.pad_id
    positions, attn_positions = resolve_positions(inputs, positions, segment_ids)
    x = self._embed(self.source_embed, inputs, positions, deterministic, getattr(self, "source_positions", None))
    # decode=False is passed positionally: remat needs every static arg.
    x = run_stack(
      self.encoder_stack,
      x,
      valid,
      deterministic,
      False,
      segment_ids,
      attn_positions,
      None,
      self.encoder_bias,
      rngs=layer_rngs(self, self.config.num_encoder_layers, deterministic),
    )
    return self.encoder_norm(x) if self.config.pre_norm else x

  def decode(
    self,
    encoded: jax.Array | None,
    inputs: jax.Array | None,
    decoder_inputs: jax.Array,
    *,
    positions: jax.Array | None = None,
    deterministic: bool = True,
    segment_ids: jax.Array | None = None,
    inputs_segment_ids: jax.Array | None = None,
    cache_state: CacheState | None = None,
  ) -> jax.Array:
    """Decoder stack -> float32 logits `[batch, tgt_len, vocab_size]`.

    Args:
      encoded: encoder output `[batch, src_len, d_model]`; None at cached decode steps
        after the prefill (cross-attention keys/values are then in the cache).
      inputs: int `[batch, src_len]` source ids, for the cross-attention padding mask; None
        when decoding with the cache (the mask comes from `cache_state.source_lengths`).
      decoder_inputs: int `[batch, tgt_len]`, starting with the start token (`special_ids.start`; real
        even when it is the pad id, as in T5: see `start_is_pad`).
      positions: int `[batch, tgt_len]` positions of `decoder_inputs` (restarting at 0 in
        each segment when packed); None = derived from `segment_ids`, or 0..tgt_len-1.
      segment_ids: int `[batch, tgt_len]` packed-example ids of `decoder_inputs` (1, 2, ...,
        0 on padding), or None.
      inputs_segment_ids: int `[batch, src_len]` segment ids of `inputs`: target segment k
        attends to source segment k only. Both or neither of the segment ids.
      cache_state: decode with the KV cache (`jaxformer.inference`): the "cache" collection
        must be mutable; row b's tokens sit at positions `cache_state.lengths[b]`, ... and
        PAD tokens are not cached. No segment ids or positions then.

    Raises:
      ValueError: segment ids or positions with `cache_state`.
    """
    decode = cache_state is not None
    if decode and (segment_ids is not None or inputs_segment_ids is not None or positions is not None):
      raise ValueError("cached decoding (cache_state) takes no segment ids or positions: rows are unpacked")
    tgt_valid = decoder_inputs != self.config.pad_id
    if decode:  # attention takes the positions from the cache state itself
      positions, attn_positions, src_valid = cache_positions(cache_state, decoder_inputs), None, None
    else:
      positions, attn_positions = resolve_positions(decoder_inputs, positions, segment_ids)
      src_valid = inputs != self.config.pad_id
    if start_is_pad(self.config):  # the start token (a pad id) at each target's position 0 is real
      first = positions == 0 if segment_ids is None else (positions == 0) & (segment_ids != 0)
      tgt_valid = tgt_valid | first
    y = self._embed(
      self.target_embed, decoder_inputs, positions, deterministic, getattr(self, "target_positions", None)
    )
    y = run_stack(
      self.decoder_stack,
      y,
      encoded,
      tgt_valid,
      src_valid,
      deterministic,
      decode,
      segment_ids,
      inputs_segment_ids,
      attn_positions,
      cache_state,
      self.decoder_bias,
      rngs=layer_rngs(self, self.config.num_decoder_layers, deterministic),
    )
    if self.config.pre_norm:
      y = self.decoder_norm(y)
    return output_logits(
      self.config, self.target_embed, getattr(self, "output_proj", None), y, decode, getattr(self, "logits_bias", None)
    )

  def __call__(
    self,
    inputs: jax.Array,
    targets: jax.Array,
    *,
    inputs_segment_ids: jax.Array | None = None,
    inputs_positions: jax.Array | None = None,
    targets_segment_ids: jax.Array | None = None,
    targets_positions: jax.Array | None = None,
    deterministic: bool = True,
  ) -> jax.Array:
    """Teacher-forced logits `[batch, tgt_len, vocab_size]` (float32) for `targets` `[batch, tgt_len]`.

    Packed rows pass int segment ids and per-segment positions for the source
    (`[batch, src_len]`) and the targets (`[batch, tgt_len]`); see `encode` and `decode`.
    The targets are shifted right within each segment.
    """
    encoded = self.encode(
      inputs, segment_ids=inputs_segment_ids, positions=inputs_positions, deterministic=deterministic
    )
    ids = self.config.special_ids
    decoder_inputs = shift_right(targets, ids.start, targets_segment_ids, ids.pad)
    return self.decode(
      encoded,
      inputs,
      decoder_inputs,
      positions=targets_positions,
      deterministic=deterministic,
      segment_ids=targets_segment_ids,
      inputs_segment_ids=inputs_segment_ids,
    )

  def prefill(self, inputs: jax.Array, cache_state: CacheState) -> tuple[jax.Array, CacheState]:
    """Starts cached decoding of int `[batch, src_len]` sources (PAD padded at the end):
    encodes them once, stores the cross-attention keys/values, and feeds BOS.

    Returns float32 logits `[batch, vocab_size]` of the first target token and the state
    with `source_lengths` set and one token (BOS) cached per row."""
    ids = self.config.special_ids
    state = cache_state.replace(source_lengths=jnp.sum(inputs != ids.pad, axis=1, dtype=jnp.int32))
    bos = jnp.full((inputs.shape[0], 1), ids.start, jnp.int32)
    logits = self.decode(self.encode(inputs), None, bos, cache_state=state)
    return logits[:, 0], state.replace(lengths=state.lengths + 1)  # the start token is cached even if it is pad

  def extend(self, tokens: jax.Array, cache_state: CacheState) -> tuple[jax.Array, CacheState]:
    """Feeds int `[batch, T]` target tokens after each row's cached ones (PAD: not fed).
    Returns float32 logits `[batch, T, vocab_size]` and the advanced state."""
    return self.decode(None, None, tokens, cache_state=cache_state), advance(cache_state, tokens, self.config.pad_id)
