"""Supervised fine-tuning rows for causal LMs (`data.prompt_field`/`completion_field`,
`data.messages_field`): the loss weights of a prompt/completion pair and of a 3-turn chat against
hand-computed ones, through preparation, windows and packing; and the one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import TINY

from jaxformer.config import ConfigError, load_config
from jaxformer.data import prepare as prep
from jaxformer.data.sft import encode_example, masked_ids, unmask
from jaxformer.data.sources import make_source
from jaxformer.data.windows import ArrayStream, _batch
from jaxformer.errors import DataError

pytest.importorskip("tokenizers")

WORDS = [
  "<pad>",
  "<s>",
  "</s>",
  "<|user|>",
  "<|assistant|>",
  "hello",
  "there",
  "general",
  "kenobi",
  "you",
  "are",
  "a",
  "bold",
  "one",
  "!",
  "?",
  "<unk>",
]
TEMPLATE = (
  "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {{ eos_token }} {% endfor %}"
  "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
ID = {w: i for i, w in enumerate(WORDS)}


def _tokenizer(tmp_path, template=TEMPLATE):
  """A word-level Hugging Face tokenizer that prepends <s>, with `template` as its chat template."""
  import tokenizers
  from tokenizers import models, pre_tokenizers, processors

  tok = tokenizers.Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", ID["<s>"])])
  folder = tmp_path / "tok"
  folder.mkdir(parents=True)
  (folder / "tokenizer.json").write_text(tok.to_str())
  (folder / "tokenizer_config.json").write_text(
    json.dumps(
      {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": template}
    )
  )
  from jaxformer.data.tokenizer_hf import HFTokenizer

  return HFTokenizer.load(folder)


def test_prompt_completion_counts_the_completion_and_eos(tmp_path):
  tok = _tokenizer(tmp_path)
  values = encode_example({"prompt": "hello there", "completion": "general kenobi"}, tok, ID["</s>"])
  ids, counted = unmask(values)
  assert ids.tolist() == [1, 5, 6, 7, 8, 2]  # <s> hello there | general kenobi </s>
  assert counted.tolist() == [False, False, False, True, True, True]
  # As a causal LM window: targets are the next tokens, the prompt's (here: "there", "general"...) weighed by hand.
  batch = _batch(ArrayStream(np.concatenate([values, values[:1]]), masked=True), np.array([0]), 6, True, False, 0)
  assert batch["inputs"].tolist() == [[1, 5, 6, 7, 8, 2]]
  assert batch["targets"].tolist() == [[0, 0, 7, 8, 2, 0]]  # predicted: general, kenobi, </s>; the rest padding


def test_three_turn_chat_counts_the_assistant_turns(tmp_path):
  tok = _tokenizer(tmp_path)
  chat = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "general kenobi"},
    {"role": "user", "content": "you are ?"},
    {"role": "assistant", "content": "a bold one"},
    {"role": "user", "content": "hello !"},
    {"role": "assistant", "content": "kenobi !"},
  ]
  ids, counted = unmask(encode_example({"messages": chat}, tok, ID["</s>"]))
  words = [WORDS[i] for i in ids]
  assert words == [
    "<|user|>",
    "hello",
    "there",
    "</s>",
    "<|assistant|>",
    "general",
    "kenobi",
    "</s>",
    "<|user|>",
    "you",
    "are",
    "?",
    "</s>",
    "<|assistant|>",
    "a",
    "bold",
    "one",
    "</s>",
    "<|user|>",
    "hello",
    "!",
    "</s>",
    "<|assistant|>",
    "kenobi",
    "!",
    "</s>",
  ]
  expected = [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
  assert counted.astype(int).tolist() == expected


def _files_config(tmp_path, rows, *extra):
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return load_config(
    TINY,
    [
      "model.kind=decoder_only",
      "data.dataset=files",
      f"data.train_files={path}",
      f"data.data_dir={tmp_path / 'cache'}",
      *extra,
    ],
  ), path


def test_prepared_rows_keep_their_masks_in_windows_and_packing(tmp_path):
  tok = _tokenizer(tmp_path)
  rows = [{"q": "hello there", "a": "general kenobi"}, {"q": "you are ?", "a": "a bold one"}] * 3
  config, _ = _files_config(tmp_path, rows, "data.prompt_field=q", "data.completion_field=a")
  source = make_source(config.data, "text")
  stream = prep.prepare_text(source, "train", tok, tmp_path / "cache", eos_id=ID["</s>"])
  assert stream.masked
  first = [1, 5, 6, 7, 8, 2]  # <s> hello there general kenobi </s>
  second = [1, 9, 10, 15, 11, 12, 13, 2]  # <s> you are ? a bold one </s>
  ids, counted = unmask(stream.read())
  assert ids.tolist() == (first + second) * 3
  assert counted.astype(int).tolist() == ([0, 0, 0, 1, 1, 1] + [0, 0, 0, 0, 1, 1, 1, 1]) * 3
  # Packing: a window over the first two rows; the row boundary and the prompts are not targets.
  batch = _batch(stream, np.array([0]), 13, True, True, -1)
  assert batch["targets"].tolist() == [[-1, -1, 7, 8, 2, -1, -1, -1, -1, 11, 12, 13, 2]]
  assert batch["inputs_segment_ids"].tolist() == [[1] * 6 + [2] * 7]


def test_sft_rows_errors_are_one_line(tmp_path):
  _tokenizer(tmp_path)
  config, path = _files_config(
    tmp_path, [{"q": "hello", "a": "there"}, {"q": "hello"}], "data.prompt_field=q", "data.completion_field=a"
  )
  with pytest.raises(DataError, match=rf"{path}:2: no field 'a'; the fields are q; set data.prompt_field"):
    list(make_source(config.data, "text").examples("train"))
  config, path = _files_config(tmp_path, [{"chat": "hello"}], "data.messages_field=chat")
  with pytest.raises(DataError, match=rf"{path}:1: field 'chat' must be a non-empty list"):
    list(make_source(config.data, "text").examples("train"))
  bad = _tokenizer(tmp_path / "b", "{% for m in messages %}{{ raise_exception('no ' + m.role) }}{% endfor %}")
  with pytest.raises(DataError, match=r"chat_template failed to render a chat \(no user\)") as info:
    encode_example({"messages": [{"role": "user", "content": "hello"}]}, bad, 2)
  assert "\n" not in str(info.value)
  from jaxformer.data.tokenizer import CharTokenizer

  with pytest.raises(DataError, match="data.messages_field needs a tokenizer with a chat_template"):
    encode_example({"messages": [{"role": "user", "content": "ab"}]}, CharTokenizer("ab"), None)
  with pytest.raises(ConfigError, match="data.prompt_field and data.completion_field go together"):
    load_config(TINY, ["data.dataset=files", "data.train_files=x.jsonl", "data.prompt_field=q"])
  with pytest.raises(ConfigError, match="set data.dataset=files"):
    load_config(TINY, ["data.messages_field=chat"])


def test_masked_ids_round_trip():
  ids = np.array([0, 5, 7, 2])
  counted = np.array([True, False, True, False])
  values = masked_ids(ids, counted)
  assert values.tolist() == [0, -6, 7, -3]
  back, again = unmask(values)
  assert back.tolist() == ids.tolist() and again.tolist() == counted.tolist()


@pytest.mark.slow
def test_fit_on_chat_rows_with_a_hf_tokenizer(tmp_path):
  import jaxformer

  tok = _tokenizer(tmp_path)
  chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi !"}]
  path = tmp_path / "chats.jsonl"
  path.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(64)))
  config = load_config(
    TINY,
    [
      "model.kind=decoder_only",
      "model.vocab_size=32",
      "model.pad_id=0",
      "model.bos_id=1",
      "model.eos_id=2",
      "model.position=rope",
      "model.pre_norm=true",
      "model.num_decoder_layers=1",
      "data.dataset=files",
      f"data.train_files={path}",
      "data.messages_field=messages",
      "data.tokenizer=hf",
      f"data.tokenizer_model={tmp_path / 'tok'}",
      "data.max_length=16",
      "data.packing=true",
      "train.num_steps=2",
      "train.batch_size=8",
      "train.log_every=1",
      f"data.data_dir={tmp_path / 'cache'}",
      "runtime.deterministic=false",
    ],
  )
  assert tok.vocab_size == len(WORDS)
  last = jaxformer.fit(config, tmp_path / "run")
  assert last["step"] == 2 and np.isfinite(last["loss"])
  model = jaxformer.restore(tmp_path / "run", overrides=["runtime.deterministic=false"])
  assert model.tokenizer.chat_template == TEMPLATE  # the workdir keeps the tokenizer with its template
