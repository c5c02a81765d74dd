"""Pictures: loss curves from metrics files, and attention maps whose weights come from the
model (hand-set weights give known attention, checked exactly). No training here."""

import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import plots
from jaxformer.cli import main
from jaxformer.config import load_config
from jaxformer.data import CharTokenizer
from jaxformer.inference.attention_maps import attention_maps
from jaxformer.inference.restore import Restored
from jaxformer.layers.attention import MultiHeadAttention
from jaxformer.tasks import get_task

ROOT = Path(__file__).parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


def _write_metrics(workdir: Path, rows) -> None:
  workdir.mkdir()
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_training_plot_overlays_runs_from_their_metrics(tmp_path, capsys):
  a, b = tmp_path / "run_a", tmp_path / "run_b"
  _write_metrics(
    a,
    [
      {"step": 1, "loss": 5.0, "learning_rate": 1e-4},
      {"step": 2, "loss": 4.5, "learning_rate": 2e-4},
      {"step": 2, "val_loss": 4.75},
    ],
  )
  _write_metrics(
    b,
    [
      {"step": 1, "loss": 6.0, "learning_rate": 3e-4},
      {"step": 2, "loss": 5.5, "learning_rate": 6e-4},
      {"step": 2, "val_loss": 5.25},
    ],
  )
  with (b / "metrics.jsonl").open("a") as f:
    f.write('{"step": 3, "lo')  # a torn last line (a run writing right now) is skipped
  out = tmp_path / "loss.png"
  fig = plots.plot_training([a, b], out)
  assert [ax.get_title() for ax in fig.axes] == ["training loss", "validation loss", "learning rate"]
  expected = {"run_a": ([5.0, 4.5], [4.75], [1e-4, 2e-4]), "run_b": ([6.0, 5.5], [5.25], [3e-4, 6e-4])}
  for panel, ax in enumerate(fig.axes):
    assert {line.get_label(): list(line.get_ydata()) for line in ax.lines} == {
      name: values[panel] for name, values in expected.items()
    }
  assert out.read_bytes().startswith(PNG) and [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []

  # The command: one JSON line last naming the PNG; a workdir without metrics is one error line.
  out2 = tmp_path / "again.png"
  assert main(["plot", "--workdir", str(a), str(b), "--out", str(out2)]) == 0
  assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"out": str(out2), "workdirs": [str(a), str(b)]}
  assert out2.read_bytes().startswith(PNG)
  empty = tmp_path / "empty"
  empty.mkdir()
  assert main(["plot", "--workdir", str(a), str(empty), "--out", str(tmp_path / "no.png")]) == 2
  err = capsys.readouterr().err.strip()
  assert err == f"error: {empty} has no metrics.jsonl; give a workdir that `jaxformer train` has logged to"
  assert not (tmp_path / "no.png").exists()
  missing = tmp_path / "nowhere" / "attn.png"
  assert main(["attention", "--workdir", str(a), "--text", "x", "--out", str(missing)]) == 2
  assert capsys.readouterr().err.strip() == (
    f"error: --out {missing}: its folder {missing.parent} is missing; create it or give another path"
  )
  assert plots.run_names([tmp_path / "x" / "run", tmp_path / "y" / "run", a]) == [
    str(tmp_path / "x" / "run"),
    str(tmp_path / "y" / "run"),
    "run_a",
  ]


def test_attention_layer_sows_the_weights_its_params_give():
  """One-hot queries and keys scaled by 100: query i attends to the key j with perm[j] = i,
  exactly (the other scores are 5000 lower); without the "intermediates" collection the
  layer returns the same output and sows nothing."""
  perm = np.array([2, 0, 3, 1])
  eye = np.eye(4, dtype=np.float32)
  layer = MultiHeadAttention(num_heads=1, head_dim=4)
  x = jnp.asarray(eye[None])  # [1, 4, 4]: token j is e_j
  params = jax.tree.map(np.asarray, nn.unbox(layer.init(jax.random.key(0), x, None, deterministic=True)["params"]))
  params["query"] = 100 * eye[:, None, :]  # q_i = 100 e_i
  params["key"] = 100 * eye[perm][:, None, :]  # k_j = 100 e_perm[j]
  out, state = layer.apply({"params": params}, x, None, deterministic=True, mutable=["intermediates"])
  (weights,) = state["intermediates"]["attention_weights"]
  np.testing.assert_array_equal(np.asarray(weights)[0, 0], eye[perm].T)
  plain = layer.apply({"params": params}, x, None, deterministic=True)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(out))


def _hand_set(config_path: str, overrides: list[str]) -> Restored:
  """A model of `config_path` with every query kernel zero (all scores 0: attention is uniform
  over the keys each query may see), with a character tokenizer whose ids avoid BOS/EOS."""
  config = load_config(config_path, overrides)
  model = get_task(config).make_model()
  tokens = jnp.ones((1, 4), jnp.int32)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens, tokens)["params"])
  params = jax.tree_util.tree_map_with_path(lambda path, x: jnp.zeros_like(x) if path[-1].key == "query" else x, params)
  return Restored(config, CharTokenizer("0123abcdefgh"), model, None, params, 7, ())


def test_attention_maps_of_a_hand_set_translation_model_are_exact(tmp_path):
  small = [
    "model.num_heads=2",
    "model.num_encoder_layers=2",
    "model.num_decoder_layers=1",
    "model.d_model=16",
    "model.d_ff=16",
    "model.vocab_size=37",
    "model.scan_layers=true",
  ]
  restored = _hand_set(str(ROOT / "configs" / "tiny.yaml"), small)
  result = attention_maps(restored, "abc", target="de")
  maps = result.maps
  assert result.target == "de"
  assert [m.title for m in maps] == ["encoder self-attention", "decoder self-attention", "encoder-decoder attention"]
  assert [m.weights.shape for m in maps] == [(2, 2, 4, 4), (1, 2, 3, 3), (1, 2, 3, 4)]
  assert maps[0].queries == maps[0].keys == maps[2].keys == ["a", "b", "c", "</s>"]
  assert maps[1].queries == maps[1].keys == maps[2].queries == ["<s>", "d", "e"]
  causal = np.tril(np.ones((3, 3), np.float32))
  expected = [
    np.full((4, 4), 0.25, np.float32),
    causal / causal.sum(1, keepdims=True),
    np.full((3, 4), 0.25, np.float32),
  ]
  for m, want in zip(maps, expected):
    np.testing.assert_array_equal(m.weights, np.broadcast_to(want, m.weights.shape))
  fig = plots.plot_attention(maps, tmp_path / "attn.png")
  assert len(fig.axes) == (2 + 1 + 1) * 2  # a panel per layer and head of each map
  np.testing.assert_array_equal(fig.axes[-1].images[0].get_array(), maps[2].weights[0, 1])
  assert (tmp_path / "attn.png").read_bytes().startswith(PNG)


@pytest.mark.parametrize(
  "name, title, causal",
  [("shakespeare_char", "decoder self-attention", True), ("shakespeare_mlm", "encoder self-attention", False)],
)
def test_attention_maps_of_a_language_model_have_only_its_self_attention(name, title, causal):
  restored = _hand_set(
    str(ROOT / "configs" / f"{name}.yaml"),
    [
      "model.num_encoder_layers=1",
      "model.num_decoder_layers=1",
      "model.num_heads=2",
      "model.d_model=16",
      "model.d_ff=16",
    ],
  )
  result = attention_maps(restored, "ab0")
  (self_attention,) = result.maps
  assert result.target is None and self_attention.title == title and self_attention.queries == ["a", "b", "0"]
  seen = np.tril(np.ones((3, 3), np.float32)) if causal else np.ones((3, 3), np.float32)
  np.testing.assert_array_equal(self_attention.weights[0, 1], seen / seen.sum(1, keepdims=True))
  with pytest.raises(ValueError, match="--target is for translation models"):
    attention_maps(restored, "ab", target="ba")
  limit = min(restored.config.data.max_length, restored.config.model.max_length)
  with pytest.raises(ValueError, match=f"--text is {limit + 1} tokens but the model reads at most {limit}"):
    attention_maps(restored, "a" * (limit + 1))
