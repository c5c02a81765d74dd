"""The public Python API (`import jaxformer`) end to end on a tiny model trained in-process for
two steps, and `jaxformer attention` / `jaxformer plot` on that run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import jaxformer
from jaxformer import plots
from jaxformer.cli import main
from jaxformer.inference.attention_maps import attention_maps
from jaxformer.tasks import evaluate

ROOT = Path(__file__).parent.parent
SOURCES = ["A man is riding a bike.", "Two dogs play in the snow."]
REFERENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]


@pytest.fixture(scope="module")
def run(tmp_path_factory, multi30k_dir):
  """(workdir, what `fit` returned): 2 steps of a one-layer tiny model on the 8 test devices."""
  config = jaxformer.load_config(
    ROOT / "configs" / "tiny.yaml",
    [
      f"data.data_dir={multi30k_dir}",
      "data.buckets=[64]",
      "model.d_model=16",
      "model.num_heads=2",
      "model.d_ff=32",
      "model.num_encoder_layers=1",
      "model.num_decoder_layers=1",
      "train.batch_size=8",
      "train.num_steps=2",
      "train.log_every=1",
      "train.checkpoint_every=2",
      "train.eval_batches=2",
      "train.async_checkpoint=false",
      "runtime.deterministic=false",
    ],
  )  # in-process: leave this process's XLA flags alone
  workdir = tmp_path_factory.mktemp("api")
  return workdir, jaxformer.fit(config, workdir)


def test_import_is_lazy_and_exports_the_api():
  code = "import sys, jaxformer; print(sorted(jaxformer.__all__)); print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
  assert out.split("\n")[:2] == [
    "['export', 'fit', 'generate', 'load_config', 'logits', 'restore', 'score', 'translate']",
    "False",
  ]
  with pytest.raises(AttributeError, match="has no attribute 'nope'"):
    jaxformer.nope  # noqa: B018


def test_fit_restore_translate_score(run, tmp_path, capsys):
  workdir, last = run
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert last == [r for r in rows if "loss" in r][-1] and last["step"] == 2
  model = jaxformer.restore(workdir, overrides=["mesh.data=8", "runtime.deterministic=false"])
  assert model.step == 2 and model.config.model.d_model == 16
  hyps = jaxformer.translate(model, SOURCES, batch_size=8)
  assert len(hyps) == 2 and hyps == evaluate.translate(model, SOURCES, 8)[0]
  src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
  src.write_text("\n".join(SOURCES) + "\n")
  ref.write_text("\n".join(REFERENCES) + "\n")
  result = jaxformer.score(model, src=str(src), ref=str(ref), batch_size=8)
  assert result["step"] == 2 and result["hypotheses"] is None and result["num_sentences"] == 2
  assert result["bleu"] == evaluate.score(hyps, REFERENCES)["bleu"]
  assert result["loss"] == pytest.approx(evaluate.reference_loss(model, SOURCES, REFERENCES, 8)["loss"], rel=1e-6)
  with pytest.raises(ValueError, match="beam size 2 cannot be combined with sampling"):
    jaxformer.translate(model, SOURCES, beam_size=2, temperature=0.5)
  with pytest.raises(ValueError, match="split='validation'; use 'val' or 'test'"):
    jaxformer.score(model, split="validation")

  # Attention maps: the default target is the greedy translation (decoded tokens, here up to
  # model.max_length of them: two steps of training do not reach EOS).
  greedy = attention_maps(model, SOURCES[0])
  assert greedy.target == hyps[0] and greedy.maps[2].weights.shape[:2] == (1, 2)
  out = tmp_path / "attn.png"
  args = [
    "attention",
    "--workdir",
    str(workdir),
    "--text",
    SOURCES[0],
    "--target",
    REFERENCES[0],
    "--out",
    str(out),
    "runtime.deterministic=false",
  ]
  capsys.readouterr()
  assert main(args) == 0  # one JSON line last
  assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {
    "out": str(out),
    "step": 2,
    "text": SOURCES[0],
    "target": REFERENCES[0],
  }
  assert out.read_bytes().startswith(b"\x89PNG")
  fig = plots.plot_training([workdir], tmp_path / "loss.png")
  assert list(fig.axes[0].lines[0].get_ydata()) == [r["loss"] for r in rows if "loss" in r]


def test_logits_are_the_teacher_forced_forward(run):
  import jax
  import numpy as np

  from jaxformer.models.transformer import shift_right

  model = jaxformer.restore(run[0], overrides=["mesh.data=8", "runtime.deterministic=false"])
  src = np.array([[5, 9, 17, 3, 0], [7, 3, 0, 0, 0]])
  tgt = np.array([[11, 4, 3], [6, 3, 0]])
  decoder_inputs = np.asarray(shift_right(tgt))
  ours = jaxformer.logits(model, src, decoder_inputs)
  assert ours.dtype == np.float32 and ours.shape == (2, 3, model.config.model.vocab_size)
  forced = jax.jit(lambda p, x, y: model.model.apply({"params": p}, x, y))  # shifts y right itself
  np.testing.assert_allclose(ours, np.asarray(forced(jax.device_get(model.params), src, tgt)), atol=1e-5)
  with pytest.raises(ValueError, match="targets are required for an encoder_decoder model"):
    jaxformer.logits(model, src)
  with pytest.raises(ValueError, match=r"inputs holds ids outside \[0, 1000\)"):
    jaxformer.logits(model, [[1, 1000]], [[2]])
  with pytest.raises(ValueError, match="inputs must be a non-empty 2-D array"):
    jaxformer.logits(model, [1, 2], [[2]])


def test_export_writes_the_run_as_a_marian_directory(run, tmp_path):
  workdir, _ = run
  out = jaxformer.export(workdir, tmp_path / "hf", overrides=["runtime.deterministic=false"])
  assert out["architecture"] == "MarianMTModel" and out["step"] == 2 and out["out"] == str(tmp_path / "hf")
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(out["files"])
