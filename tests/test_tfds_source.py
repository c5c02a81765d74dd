"""`data.dataset=tfds:NAME`: a TFDS dataset prepared offline here trains by name; an unknown
or unprepared dataset and a missing feature get one line each."""

import pytest
import tensorflow_datasets as tfds
from etils import epath

from jaxformer import data as D
from jaxformer.config import config_from_dict
from jaxformer.data.sources import make_source
from jaxformer.errors import DataError
from jaxformer.tasks import get_task

tfds.disable_progress_bar()


class JaxformerToyPairs(tfds.core.GeneratorBasedBuilder):
  """Sentence pairs 'number i' -> 'nummer i', and a text feature, built without any download."""

  VERSION = tfds.core.Version("1.0.0")

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:  # TFDS's default lookup needs importlib_resources
    return epath.Path(__file__)

  def _info(self):
    text = tfds.features.Text()
    return tfds.core.DatasetInfo(
      builder=self, features=tfds.features.FeaturesDict({"xx": text, "yy": text, "body": text}), disable_shuffling=True
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples(0, 300), "dev": self._generate_examples(300, 340)}

  def _generate_examples(self, start, stop):
    for i in range(start, stop):
      yield (
        i,
        {
          "xx": f"number {i % 50} and {i % 7}",
          "yy": f"nummer {i % 50} und {i % 7}",
          "body": f"line {i}\nanother line {i % 3}",
        },
      )


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("tfds")
  JaxformerToyPairs(data_dir=str(path), file_format="array_record").download_and_prepare(file_format="array_record")
  return str(path)


def _config(tfds_dir, tmp_path, name="jaxformer_toy_pairs", kind="encoder_decoder", **data):
  return config_from_dict(
    {
      "model": {
        "kind": kind,
        "vocab_size": 64,
        "d_model": 16,
        "num_heads": 2,
        "d_ff": 32,
        "num_encoder_layers": 1,
        "num_decoder_layers": 1,
        "max_length": 64,
      },
      "data": {
        "dataset": f"tfds:{name}",
        "tfds_data_dir": tfds_dir,
        "source_lang": "xx",
        "target_lang": "yy",
        "tokenizer": "bpe",
        "data_dir": str(tmp_path),
        **data,
      },
    }
  )


def test_a_prepared_dataset_is_read_by_name(tfds_dir, tmp_path):
  vocab, splits = get_task(_config(tfds_dir, tmp_path)).load_data()
  tokenizer = vocab.target
  assert sorted(splits) == ["train", "validation"]  # `dev` serves as the validation split
  assert len(splits["train"]) == 300 and len(splits["validation"]) == 40
  src, tgt = splits["validation"].texts([0])
  assert (src[0], tgt[0]) == ("number 0 and 6", "nummer 0 und 6")
  _, lm_splits = get_task(_config(tfds_dir, tmp_path, kind="decoder_only", text_field="body")).load_data()
  assert tokenizer.vocab_size <= 64 and len(lm_splits["train"]) > 300 * 4


def test_unknown_unprepared_and_missing_feature_errors(tfds_dir, tmp_path):
  with pytest.raises(DataError, match="TFDS has no dataset 'no_such_dataset_xyz'") as info:
    make_source(_config(tfds_dir, tmp_path, "no_such_dataset_xyz").data, D.PAIRS)
  assert "\n" not in str(info.value)
  empty = str(tmp_path / "empty")  # the builder is registered (above) but not prepared there
  with pytest.raises(DataError, match=r"is not prepared in .*tfds build jaxformer_toy_pairs --data_dir .*/empty"):
    make_source(_config(empty, tmp_path).data, D.PAIRS)
  with pytest.raises(DataError, match="no feature 'de'; the features are xx, yy, body; set data.source_field"):
    get_task(_config(tfds_dir, tmp_path, source_field="de")).load_data()
