"""Training on your own data from the command line: aligned files in another language pair,
de->en Multi30k, a JSONL corpus for the masked LM, a plain-text file for the causal LM, a
TFDS dataset by name, and packed batches."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import ROOT, run_cli

TINY_MODEL = [
  "model.vocab_size=96",
  "model.d_model=32",
  "model.num_heads=2",
  "model.d_ff=48",
  "model.num_encoder_layers=1",
  "model.num_decoder_layers=1",
  "model.max_length=64",
  "data.tokenizer=bpe",
  "optim.warmup_steps=2",
]
WORDS = "cat dog bird fish horse cow sheep goat duck frog".split()


def _steps(n):
  return [
    f"train.num_steps={n}",
    f"train.log_every={n // 2}",
    f"train.eval_every={n}",
    "train.eval_batches=2",
    f"train.checkpoint_every={n}",
    "train.batch_size=8",
  ]


def _reverse(sentence):  # the "yy" language: every word spelled backwards
  return " ".join(w[::-1] for w in sentence.split())


def _sentences(n, offset=0):
  return [" ".join(WORDS[(i * k + offset) % len(WORDS)] for k in range(1, 2 + i % 5)) for i in range(n)]


def _metrics(workdir):
  return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus")
  for split, n, offset in (("train", 400, 0), ("valid", 24, 3), ("test", 16, 5)):
    src = _sentences(n, offset)
    (path / f"{split}.xx").write_text("".join(s + "\n" for s in src))
    (path / f"{split}.yy").write_text("".join(_reverse(s) + "\n" for s in src))
  docs = ["\n".join(_sentences(3, i)) for i in range(150)]
  (path / "docs.txt").write_text("\n\n".join(docs) + "\n")
  (path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  return path


@pytest.mark.slow
def test_aligned_files_in_another_pair_train_translate_eval_and_resume(corpus, tmp_path):
  """Train, eval, translate; then lines are added to the train files and the run resumes with
  the workdir's tokenizer (the ids its checkpoint was trained on), its paths saved absolute."""
  src, tgt = tmp_path / "train.xx", tmp_path / "train.yy"
  shutil.copy(corpus / "train.xx", src)
  shutil.copy(corpus / "train.yy", tgt)
  workdir = str(tmp_path / "xx_yy")
  data = [
    "data.dataset=files",
    f"data.train_files={src},{tgt}",
    f"data.validation_files={corpus}/valid.xx,{corpus}/valid.yy",
    f"data.test_files={corpus}/test.xx,{corpus}/test.yy",
    "data.source_lang=xx",
    "data.target_lang=yy",
    f"data.data_dir={tmp_path}/cache",
    "data.packing=true",
  ]
  proc = run_cli("train", "--config", "configs/tiny.yaml", "--workdir", workdir, *TINY_MODEL, *data, *_steps(6))
  # Redirected output: plain lines (no progress bar, no escape codes), and the totals, not the table.
  assert "\r" not in proc.stderr + proc.stdout and "\x1b" not in proc.stderr + proc.stdout
  assert "PartitionSpec" not in proc.stderr and "parameters" in proc.stderr and "per device:" in proc.stderr
  # Preparation says what it prepares, from which files and where it is cached (nothing is downloaded).
  assert f"preparing train pairs from {src}, {tgt} into {tmp_path}/cache/prepared/" in proc.stderr
  assert "Downloading" not in proc.stderr
  assert [json.loads(line)["step"] for line in proc.stdout.splitlines() if '"loss"' in line] == [3, 6]
  logged = [m for m in _metrics(workdir) if "loss" in m]
  assert logged[-1]["step"] == 6 and 0.0 <= logged[-1]["padding_fraction"] < 0.5
  result = json.loads(run_cli("eval", "--workdir", workdir).stdout.strip().splitlines()[-1])
  assert result["split"] == "test" and result["num_sentences"] == 16
  assert result["hypotheses"] == f"{workdir}/hypotheses.test.greedy.txt"
  beam = json.loads(run_cli("eval", "--workdir", workdir, "--beam-size", "2").stdout.strip().splitlines()[-1])
  assert beam["hypotheses"] == f"{workdir}/hypotheses.test.beam2.txt"
  assert len(Path(result["hypotheses"]).read_text().splitlines()) == 16
  translated = subprocess.run(
    [sys.executable, "-m", "jaxformer", "translate", "--workdir", workdir],
    input="cat dog\nbird\n",
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=600,
  )
  assert translated.returncode == 0 and len(translated.stdout.splitlines()) == 2
  garbled = subprocess.run(
    [sys.executable, "-m", "jaxformer", "translate", "--workdir", workdir],
    input=b"cat\n\xff dog\n",
    capture_output=True,
    cwd=ROOT,
    timeout=600,
  )
  assert garbled.returncode == 2 and b"stdin line 2 is not valid UTF-8 (byte 0xff at column 1)" in garbled.stderr

  tokenizer = (tmp_path / "xx_yy" / "tokenizer.model").read_bytes()
  with open(src, "a") as f:
    f.write("".join(f"goat{i} frog{i}\n" for i in range(300)))
  with open(tgt, "a") as f:
    f.write("".join(f"{i}taog {i}gorf\n" for i in range(300)))
  resumed = run_cli(
    "train",
    "--config",
    "configs/tiny.yaml",
    "--workdir",
    workdir,
    *TINY_MODEL,
    *data,
    *_steps(6)[1:],
    "train.num_steps=8",
  )
  assert "using the tokenizer saved in" in resumed.stderr and "resuming from the step-6 checkpoint" in resumed.stderr
  assert [m["step"] for m in _metrics(workdir) if "loss" in m] == [3, 6, 8]
  assert (tmp_path / "xx_yy" / "tokenizer.model").read_bytes() == tokenizer
  saved = (tmp_path / "xx_yy" / "config.yaml").read_text()
  assert f"train_files: {src},{tgt}" in saved and f"data_dir: {tmp_path}/cache" in saved


@pytest.mark.slow
def test_separate_vocabularies_train_and_translate(corpus, tmp_path):
  workdir = tmp_path / "separate"
  run_cli(
    "train",
    "--config",
    "configs/tiny.yaml",
    "--workdir",
    str(workdir),
    *TINY_MODEL,
    "data.dataset=files",
    f"data.train_files={corpus}/train.xx,{corpus}/train.yy",
    "data.source_lang=xx",
    "data.target_lang=yy",
    "data.shared_vocab=false",
    "model.tie_embeddings=false",
    f"data.data_dir={tmp_path}/cache",
    "data.buckets=[64]",
    *_steps(4),
  )
  assert (workdir / "source_tokenizer.model").read_bytes() != (workdir / "tokenizer.model").read_bytes()
  result = json.loads(run_cli("eval", "--workdir", str(workdir), "--split", "val").stdout.strip().splitlines()[-1])
  assert result["split"] == "val" and result["num_sentences"] == 40 and result["num_tokens"] > 40


@pytest.mark.slow
def test_multi30k_trains_de_to_en(tmp_path):
  workdir = str(tmp_path / "de_en")
  # SentencePiece learns from 4000 of the 58,000 sentences: the other tests share a tokenizer
  # prepared once, this one trains its own.
  run_cli(
    "train",
    "--config",
    "configs/tiny.yaml",
    "--workdir",
    workdir,
    "data.source_lang=de",
    "data.target_lang=en",
    f"data.data_dir={tmp_path}/cache",
    "data.buckets=[64]",
    "data.input_sentence_size=4000",
    "model.num_encoder_layers=1",
    "model.num_decoder_layers=1",
    *_steps(4),
  )
  src, ref = tmp_path / "src.de", tmp_path / "ref.en"
  src.write_text("Ein Hund läuft.\nZwei Männer.\n")
  ref.write_text("A dog runs.\nTwo men.\n")
  result = json.loads(
    run_cli("eval", "--workdir", workdir, "--src", str(src), "--ref", str(ref)).stdout.strip().splitlines()[-1]
  )
  assert result["split"] == "custom" and result["num_sentences"] == 2
  prepared = sorted(p.name for p in (tmp_path / "cache" / "prepared").iterdir())
  assert len(prepared) == 3 and all(p.startswith("multi30k-") for p in prepared)


@pytest.mark.slow
@pytest.mark.parametrize(
  "kind,config,file",
  [("encoder_only", "shakespeare_mlm", "docs.jsonl"), ("decoder_only", "shakespeare_char", "docs.txt")],
)
def test_language_models_train_on_own_text(corpus, tmp_path, kind, config, file):
  workdir = str(tmp_path / kind)
  run_cli(
    "train",
    "--config",
    f"configs/{config}.yaml",
    "--workdir",
    workdir,
    *TINY_MODEL,
    "data.dataset=files",
    f"data.train_files={corpus}/{file}",
    f"data.data_dir={tmp_path}/cache",
    "data.max_length=16",
    "model.max_length=16",
    "optim.schedule=constant",
    "optim.learning_rate=0.003",
    "data.packing=true",
    *_steps(4),
  )
  result = json.loads(run_cli("eval", "--workdir", workdir).stdout.strip().splitlines()[-1])
  assert result["kind"] == kind and result["step"] == 4 and result["num_tokens"] > 0 and result["split"] == "val"
  if kind == "decoder_only":
    assert "no test split" in run_cli("eval", "--workdir", workdir, "--split", "test", check=False).stderr
    src = corpus / "test.xx"
    assert (
      "--src/--ref score translations"
      in run_cli("eval", "--workdir", workdir, "--src", str(src), "--ref", str(src), check=False).stderr
    )
    wrong = subprocess.run(
      [sys.executable, "-m", "jaxformer", "translate", "--workdir", workdir],
      input="cat\n",
      capture_output=True,
      text=True,
      cwd=ROOT,
      timeout=600,
    )
    assert wrong.returncode == 2 and "translate needs a translation model" in wrong.stderr
    text = run_cli("generate", "--workdir", workdir, "--prompt", "cat", "--max-new-tokens", "5").stdout
    assert text.startswith("cat")


@pytest.mark.slow
def test_tfds_dataset_trains_by_name(tmp_path):
  from test_tfds_source import JaxformerToyPairs

  tfds_dir = tmp_path / "tfds"
  JaxformerToyPairs(data_dir=str(tfds_dir), file_format="array_record").download_and_prepare(file_format="array_record")
  workdir = str(tmp_path / "tfds_run")
  run_cli(
    "train",
    "--config",
    "configs/tiny.yaml",
    "--workdir",
    workdir,
    *TINY_MODEL,
    "data.dataset=tfds:jaxformer_toy_pairs",
    f"data.tfds_data_dir={tfds_dir}",
    "data.source_lang=xx",
    "data.target_lang=yy",
    f"data.data_dir={tmp_path}/cache",
    "data.buckets=[64]",
    *_steps(4),
  )
  assert [m["step"] for m in _metrics(workdir) if "val_loss" in m] == [4]
