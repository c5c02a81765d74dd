"""Language models: causal and masked LM models, Tiny Shakespeare data, cosine/AdamW, eval and
generation, and the CLI end to end (train -> eval -> generate)."""

import dataclasses
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sweep
from test_cli import run_cli

from jaxformer.config import ConfigError, ModelConfig, OptimConfig, config_from_dict
from jaxformer.data import CharTokenizer, WindowBatches, window_eval_batches
from jaxformer.data.sources.tinyshakespeare import read_text, split_text
from jaxformer.inference import cache as kv
from jaxformer.inference.restore import Restored
from jaxformer.layers.kv_cache import join_segments
from jaxformer.models.decoder_only import DecoderOnly
from jaxformer.models.encoder_only import EncoderOnly
from jaxformer.tasks.masked_lm import mlm_mask, random_ids
from jaxformer.train.optim import cosine_schedule, decay_mask, make_optimizer

V, T = 37, 11
CFG = ModelConfig(
  vocab_size=V,
  d_model=24,
  num_heads=3,
  d_ff=40,
  num_encoder_layers=2,
  num_decoder_layers=2,
  dropout_rate=0.0,
  pre_norm=True,
  max_length=16,
)


@pytest.fixture(scope="module")
def decoder():
  model = DecoderOnly(CFG)
  tokens = jax.random.randint(jax.random.key(1), (3, T), 1, V)
  # Jitted inits throughout: one compile each rather than one per op (the same values).
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens)["params"])
  return model, params, tokens


def test_decoder_only_is_causal(decoder):
  model, params, tokens = decoder
  changed = tokens.at[:, 6:].set((tokens[:, 6:] + 5) % (V - 1) + 1)
  a, b = model.apply({"params": params}, tokens), model.apply({"params": params}, changed)
  np.testing.assert_array_equal(np.asarray(a[:, :6]), np.asarray(b[:, :6]))
  assert np.abs(np.asarray(a[:, 6:] - b[:, 6:])).max() > 1e-3


def _cached_logits(model, params, tokens, first):
  """Logits `[batch, T, vocab]` of `tokens` fed through the KV cache: `first` tokens as one
  chunk (`extend` on an empty cache), then one `step` per token; and the prefill's
  next-token logits `[batch, vocab]` of the first chunk, and the final cache. Each call is
  jitted on its own, so the one-token step compiles once for every position."""
  empty = kv.contiguous_cache(model, params, tokens.shape[0], first)
  prefilled, _ = jax.jit(lambda p, c, x: kv.prefill(model, p, c, x))(params, empty, tokens[:, :first])
  logits, cache = jax.jit(lambda p, c, x: kv.extend(model, p, c, x))(params, empty, tokens[:, :first])
  step = jax.jit(lambda p, c, x: kv.step(model, p, c, x))
  steps = [logits]
  for t in range(first, tokens.shape[1]):
    logits, cache = step(params, cache, tokens[:, t])
    steps.append(logits[:, None])
  return jnp.concatenate(steps, axis=1), prefilled, cache


def test_cached_decoding_equals_full_forward(decoder):
  model, params, tokens = decoder
  full = model.apply({"params": params}, tokens)
  cached, prefilled, cache = _cached_logits(model, params, tokens, 4)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(prefilled), np.asarray(full[:, 3]), atol=1e-5, rtol=0)
  np.testing.assert_array_equal(cache.state.lengths, [T] * tokens.shape[0])
  joined = join_segments(cache.layers["layer_0"]["self_attention"]["key"])
  assert joined.shape == (3, CFG.kv_heads, CFG.max_length, CFG.head_dim)


OPTION_CASES = {
  "rope": dict(position="rope"),
  "alibi-window3": dict(position="alibi", sliding_window=3),
  "mqa-swiglu-rmsnorm": dict(num_kv_heads=1, ffn="swiglu", norm="rmsnorm"),
  "blockwise-learned": dict(attention="blockwise", attention_block_size=4, position="learned"),
  "softcap-geglu-nopos-untied": dict(attn_logit_softcap=5.0, ffn="geglu", position="none", tie_embeddings=False),
  "scan-remat-rope": dict(scan_layers=True, remat="full", position="rope"),
  "moe-no-capacity-limit": dict(num_experts=4, experts_per_token=2, expert_capacity_factor=0.0),
}


@pytest.mark.parametrize("options", sweep(OPTION_CASES.values(), {"alibi-window3"}, ids=OPTION_CASES))
def test_every_option_is_causal_and_decodes_like_the_full_forward(options):
  """The decoder-only LM under each architecture option: future tokens never change past
  logits, and prefill + one-token cached steps give the full forward's logits."""
  model = DecoderOnly(dataclasses.replace(CFG, **options))
  tokens = jax.random.randint(jax.random.key(3), (2, T), 1, V)
  params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
  forward = jax.jit(lambda p, x: model.apply({"params": p}, x))
  full = forward(params, tokens)
  changed = forward(params, tokens.at[:, 6:].set((tokens[:, 6:] + 5) % (V - 1) + 1))
  np.testing.assert_allclose(np.asarray(changed[:, :6]), np.asarray(full[:, :6]), atol=1e-6, rtol=0)

  cached, prefilled, _ = _cached_logits(model, params, tokens, 4)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(prefilled), np.asarray(full[:, 3]), atol=1e-5, rtol=0)


def test_encoder_only_ignores_appended_padding():
  model = EncoderOnly(CFG)
  tokens = jax.random.randint(jax.random.key(2), (2, 7), 1, V)
  params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
  padded = jnp.pad(tokens, ((0, 0), (0, 4)))
  a, b = model.apply({"params": params}, tokens), model.apply({"params": params}, padded)
  np.testing.assert_allclose(np.asarray(b[:, :7]), np.asarray(a), atol=1e-5, rtol=0)


def test_split_is_90_10_by_position():
  train, val = split_text("abcdefghij" * 3)
  assert (train, val) == ("abcdefghij" * 2 + "abcdefg", "hij")
  text = read_text()
  train, val = split_text(text)
  assert len(text) == 1115394 and len(train) == 1003854 and train + val == text


def test_char_tokenizer_round_trip_and_pad():
  tok = CharTokenizer.from_text("hello world")
  assert tok.chars == " dehlorw" and tok.vocab_size == 9
  assert tok.encode("howl") == [4, 6, 8, 5]
  assert tok.decode([0, 4, 6, 0, 8, 5]) == "howl"
  assert CharTokenizer.from_bytes(tok.serialized).chars == tok.chars
  with pytest.raises(ValueError, match="'z'"):
    tok.encode("z")


def test_window_batches_values_and_determinism():
  tokens = np.arange(100, 200, dtype=np.int32)
  batches = WindowBatches(tokens, batch_size=4, context=5, seed=3)
  b = batches[7]
  starts = np.random.default_rng((3, 7)).integers(0, 95, 4)
  np.testing.assert_array_equal(b["inputs"], 100 + starts[:, None] + np.arange(5))
  np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
  np.testing.assert_array_equal(WindowBatches(tokens, 4, 5, seed=3)[7]["inputs"], b["inputs"])
  assert not np.array_equal(batches[8]["inputs"], b["inputs"])
  rows = [WindowBatches(tokens, 4, 5, seed=3, process_index=i, process_count=2)[7]["inputs"] for i in range(2)]
  np.testing.assert_array_equal(np.concatenate(rows), b["inputs"])
  masked = WindowBatches(tokens, 4, 5, seed=3, shift=False)[7]
  np.testing.assert_array_equal(masked["targets"], masked["inputs"])


def test_eval_windows_cover_the_split_once():
  tokens = np.arange(1, 15, dtype=np.int32)  # 14 tokens -> 13 predictions
  batches = window_eval_batches(tokens, batch_size=2, context=4)
  inputs = np.concatenate([b["inputs"] for b in batches])
  targets = np.concatenate([b["targets"] for b in batches])
  np.testing.assert_array_equal(inputs[:3], [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
  np.testing.assert_array_equal(targets[:4], [[2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13], [14, 0, 0, 0]])
  np.testing.assert_array_equal(targets[targets > 0], np.arange(2, 15))
  masked = window_eval_batches(tokens, batch_size=2, context=4, shift=False)
  assert sum(int((b["targets"] > 0).sum()) for b in masked) == 14


def test_cosine_schedule_values():
  schedule = cosine_schedule(1e-3, warmup_steps=100, decay_steps=2000, min_value=1e-4)
  value = lambda c: float(schedule(c))  # noqa: E731
  assert value(0) == pytest.approx(1e-5)
  assert value(49) == pytest.approx(5e-4)
  assert value(99) == pytest.approx(1e-3) and value(100) == pytest.approx(1e-3)
  assert value(1050) == pytest.approx(5.5e-4, rel=1e-5)  # halfway: (peak + min) / 2
  assert value(2000) == pytest.approx(1e-4) and value(5000) == pytest.approx(1e-4)


def test_adamw_decays_only_matrices_not_embeddings_biases_norms(decoder):
  _, params, _ = decoder
  mask = decay_mask(params)
  assert mask["layer_0"]["self_attention"]["query"] and mask["layer_0"]["self_attention"]["out"]
  assert mask["layer_0"]["ffn"]["wi"]
  assert not mask["embed"]["embedding"]
  assert not mask["layer_0"]["ffn"]["bi"]
  assert not mask["final_norm"]["scale"] and not mask["layer_1"]["attention_sublayer"]["norm"]["bias"]
  # With zero gradients only the masked weights move: by -lr * wd * w.
  opt = OptimConfig(optimizer="adamw", schedule="constant", learning_rate=0.1, weight_decay=0.5, warmup_steps=1)
  tx = make_optimizer(opt, CFG.d_model)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  for decays, u, p in zip(jax.tree.leaves(mask), jax.tree.leaves(updates), jax.tree.leaves(params)):
    np.testing.assert_allclose(np.asarray(u), -0.05 * np.asarray(p) if decays else 0.0, rtol=1e-6, atol=1e-7)


def test_weight_decay_needs_adamw():
  with pytest.raises(ConfigError, match="adamw"):
    config_from_dict({"optim": {"weight_decay": 0.1}})
  with pytest.raises(ConfigError, match="decay_steps"):
    config_from_dict({"optim": {"schedule": "cosine", "warmup_steps": 10}})
  with pytest.raises(ConfigError, match="data.tokenizer=char is for language models"):
    config_from_dict({"data": {"tokenizer": "char"}})


def test_mlm_masking_proportions_and_weights():
  tokens = jax.random.randint(jax.random.key(0), (64, 512), 1, 60).at[:, 400:].set(0)  # 400 real per row
  keys = jax.random.split(jax.random.key(1), 64)
  corrupted, weights = mlm_mask(keys, tokens, mask_id=60, vocab_size=61, never_drawn=(0, 60))
  tokens, corrupted, weights = map(np.asarray, (tokens, corrupted, weights))
  real = tokens > 0
  selected = weights > 0
  assert not selected[~real].any()
  np.testing.assert_array_equal(corrupted[~selected], tokens[~selected])  # only selected positions change
  assert selected[real].mean() == pytest.approx(0.15, abs=0.005)
  n = selected.sum()
  is_mask = corrupted[selected] == 60
  kept = corrupted[selected] == tokens[selected]
  assert is_mask.mean() == pytest.approx(0.8, abs=0.01)
  # Random replacements are uniform in [1, 60), so 1/59 of them equal the original token.
  assert kept.mean() == pytest.approx(0.1 + 0.1 / 59, abs=0.01)
  assert ((~is_mask) & (~kept)).sum() / n == pytest.approx(0.1 * 58 / 59, abs=0.01)
  assert corrupted.min() >= 0 and corrupted.max() <= 60


def test_random_replacements_skip_special_ids_uniformly():
  # A BERT vocabulary: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103 among 120 ids.
  never = (0, 100, 101, 102, 103)
  ids = np.asarray(random_ids(jax.random.key(0), (200_000,), 120, never))
  counts = np.bincount(ids, minlength=120)
  assert counts[list(never)].sum() == 0 and ids.max() == 119
  allowed = np.delete(counts, never)
  assert allowed.min() > 0 and np.abs(allowed / len(ids) - 1 / 115).max() < 0.001  # uniform over the other 115


@pytest.fixture(scope="module")
def uniform_lm(tmp_path_factory):
  """A char LM with zero parameters: zero logits, i.e. a uniform next-character distribution."""
  from jaxformer import sharding as sh

  config = config_from_dict(
    {
      "model": {
        "kind": "decoder_only",
        "vocab_size": 66,
        "d_model": 8,
        "num_heads": 2,
        "d_ff": 8,
        "num_decoder_layers": 1,
        "max_length": 64,
        "pre_norm": True,
      },
      "optim": {"schedule": "constant", "learning_rate": 0.1},
      "data": {
        "dataset": "tinyshakespeare",
        "tokenizer": "char",
        "max_length": 16,
        "data_dir": str(tmp_path_factory.mktemp("data")),
      },
      "train": {"batch_size": 2048},
      "mesh": {"data": 1},
    }
  )
  model = DecoderOnly(config.model)
  params = jax.tree.map(jnp.zeros_like, jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"])
  tokenizer = CharTokenizer.from_text(read_text())
  return Restored(config, tokenizer, model, sh.make_mesh(config.mesh, jax.devices()[:1]), params, 0, sh.LOGICAL_RULES)


def test_perplexity_is_exp_mean_nll_of_uniform_model(uniform_lm):
  from jaxformer.tasks import get_task
  from jaxformer.tasks.base import EvalOptions

  result = get_task(uniform_lm.config).evaluate(lambda: uniform_lm, EvalOptions())  # NLL ln(66) on every token
  assert result["num_tokens"] == 1115394 - 1003854 - 1
  assert result["loss"] == pytest.approx(math.log(66), rel=1e-6)
  assert result["perplexity"] == pytest.approx(66.0, rel=1e-5)


def test_generate_is_seeded_and_spans_several_context_windows(uniform_lm):
  from jaxformer.inference.generate import generate

  # 40 new characters with a 16-token context: three prefill + sample rounds.
  a, b = (generate(uniform_lm, "ROMEO:", 40, seed=3, num_samples=2) for _ in range(2))
  assert a == b and len(a[0]) == len(a[1]) == 40 and a[0] != a[1]
  assert generate(uniform_lm, "ROMEO:", 40, seed=4, num_samples=2) != a
  with pytest.raises(ValueError, match="vocabulary"):
    generate(uniform_lm, "\u00e9", 5)


def test_generate_keeps_the_space_between_prompt_and_sentencepiece_continuation():
  """A continuation is decoded behind its prompt: the word-initial piece "▁we" after "First
  Citizen:" reads " we" (decoded alone, SentencePiece drops its leading space: "Citizen:we").
  shakespeare_bpe's data settings; a zero model whose final LayerNorm bias points at "▁we"'s
  (tied) embedding, so top-1 sampling always picks it."""
  from jaxformer import sharding as sh
  from jaxformer.config import load_config
  from jaxformer.data.tokenizer import train_tokenizer
  from jaxformer.inference.generate import generate

  config = load_config(
    "configs/shakespeare_bpe.yaml",
    ["model.d_model=8", "model.num_heads=2", "model.d_ff=8", "model.num_decoder_layers=1", "mesh.data=1"],
  )
  tokenizer = train_tokenizer(
    split_text(read_text())[0].splitlines()[:8000], config.model.vocab_size, config.data.tokenizer
  )
  [we] = tokenizer.encode("we")
  model = DecoderOnly(config.model)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 4), jnp.int32))["params"])
  params = jax.tree.map(jnp.zeros_like, params)
  params["final_norm"]["bias"] = jnp.ones(8)
  params["embed"]["embedding"] = params["embed"]["embedding"].at[we].set(1.0)
  restored = Restored(
    config, tokenizer, model, sh.make_mesh(config.mesh, jax.devices()[:1]), params, 0, sh.LOGICAL_RULES
  )
  assert generate(restored, "First Citizen:", 3, top_k=1) == [" we we we"]


def _tiny_run(layers_key: str, length: int, steps: int) -> list[str]:
  """Overrides for a one-layer d_model 32 run of `steps` steps on `length`-token windows."""
  return [
    "model.d_model=32",
    "model.num_heads=2",
    "model.d_ff=48",
    f"model.{layers_key}=1",
    f"model.max_length={length}",
    f"data.max_length={length}",
    "train.batch_size=8",
    f"train.num_steps={steps}",
    f"train.log_every={steps // 2}",
    f"train.eval_every={steps}",
    f"train.checkpoint_every={steps}",
    "optim.warmup_steps=2",
    f"optim.decay_steps={steps}",
  ]


@pytest.mark.slow
def test_cli_causal_lm_train_eval_generate(tmp_path):
  workdir = str(tmp_path / "lm")
  tiny = _tiny_run("num_decoder_layers", length=16, steps=6)
  run_cli("train", "--config", "configs/shakespeare_char.yaml", "--workdir", workdir, *tiny)
  result = json.loads(run_cli("eval", "--workdir", workdir).stdout.strip().splitlines()[-1])
  assert result["step"] == 6 and result["num_tokens"] == 1115394 - 1003854 - 1
  assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)
  assert result["loss"] < math.log(66) + 1.0
  text = run_cli(
    "generate", "--workdir", workdir, "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "3", "--top-k", "5"
  ).stdout
  assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 40 + 1


@pytest.mark.slow
def test_cli_masked_lm_train_eval(tmp_path):
  workdir = str(tmp_path / "mlm")
  tiny = _tiny_run("num_encoder_layers", length=32, steps=4)
  run_cli("train", "--config", "configs/shakespeare_mlm.yaml", "--workdir", workdir, *tiny)
  result = json.loads(run_cli("eval", "--workdir", workdir).stdout.strip().splitlines()[-1])
  assert result["step"] == 4 and result["kind"] == "encoder_only"
  val_tokens = 1115394 - 1003854
  assert 0.14 * val_tokens < result["num_tokens"] < 0.16 * val_tokens  # about 15% of tokens masked
  assert 0.0 <= result["accuracy"] <= 1.0 and result["loss"] > 0
