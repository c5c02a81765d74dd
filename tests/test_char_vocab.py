"""A character LM on a user's own text: `model.vocab_size` left unset is sized from the data's
characters (and said so in one line); an explicit value too small for them is a one-line ConfigError."""

import pytest
import yaml

from jaxformer.config import ConfigError, load_config
from jaxformer.tasks import get_task
from jaxformer.train.loop import train

TEXT = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind to suffer\n" * 20
TINY = [
  "model.kind=decoder_only",
  "data.tokenizer=char",
  "data.dataset=files",
  "model.d_model=16",
  "model.num_heads=2",
  "model.d_ff=16",
  "model.num_decoder_layers=1",
  "model.max_length=16",
  "data.max_length=16",
  "train.batch_size=8",
  "train.num_steps=1",
  "train.log_every=1",
  "train.eval_every=1",
  "train.checkpoint_every=1",
  "train.async_checkpoint=false",
  "optim.warmup_steps=1",
]


@pytest.fixture
def overrides(tmp_path):
  path = tmp_path / "own.txt"
  path.write_text(TEXT)
  return [f"data.train_files={path}", f"data.data_dir={tmp_path / 'cache'}", *TINY]


def _ids():
  return len(set(TEXT)) + 1  # one id per character, plus PAD


def _config(tmp_path, overrides):
  preset = tmp_path / "char.yaml"
  preset.write_text(yaml.safe_dump({"name": "char"}))  # every model.* default, so model.vocab_size is unset
  return load_config(preset, overrides)


def test_unset_vocab_size_is_the_number_of_character_ids(tmp_path, overrides, capsys):
  config = _config(tmp_path, overrides)
  assert config.model.vocab_from_data
  sized, vocab = get_task(config).fit_vocab_size()
  assert sized.model.vocab_size == vocab.target.vocab_size == _ids() and not sized.model.vocab_from_data
  line = capsys.readouterr().err.strip()
  assert (
    line == f"model.vocab_size={_ids()}: sized from the data ({_ids() - 1} characters + PAD); "
    "set model.vocab_size to fix it"
  )
  workdir = tmp_path / "run"
  train(config, workdir)
  saved = yaml.safe_load((workdir / "config.yaml").read_text())
  assert saved["model"]["vocab_size"] == _ids() and "vocab_from_data" not in saved["model"]
  assert (workdir / "metrics.jsonl").read_text().count('"step": 1') >= 1


def test_explicit_too_small_vocab_size_is_one_config_error(tmp_path, overrides):
  config = _config(tmp_path, [*overrides, f"model.vocab_size={_ids() - 1}"])
  assert not config.model.vocab_from_data
  with pytest.raises(ConfigError) as info:
    get_task(config).fit_vocab_size()
  message = str(info.value)
  assert "\n" not in message and f"has {_ids()} ids but model.vocab_size={_ids() - 1}" in message
  assert f"set model.vocab_size={_ids()}, or leave it unset" in message
  with pytest.raises(ConfigError, match=f"set model.vocab_size={_ids()}"):
    train(config, tmp_path / "run")
