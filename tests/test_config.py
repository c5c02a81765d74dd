"""Config loading, overrides and validation errors."""

from pathlib import Path

import pytest

from jaxformer.config import Config, ConfigError, config_from_dict, dump_config, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_loads_and_round_trips(path, tmp_path):
  config = load_config(path)
  assert isinstance(config, Config)
  assert config.model.d_model % config.model.num_heads == 0
  dumped = tmp_path / "resolved.yaml"
  dumped.write_text(dump_config(config))
  assert load_config(dumped) == config


def test_presets_have_paper_shapes():
  base = load_config(Path(__file__).parent.parent / "configs/multi30k_base.yaml").model
  big = load_config(Path(__file__).parent.parent / "configs/multi30k_big.yaml").model
  assert (base.d_model, base.num_heads, base.d_ff, base.num_encoder_layers, base.dropout_rate) == (512, 8, 2048, 6, 0.1)
  assert (big.d_model, big.num_heads, big.d_ff, big.num_decoder_layers, big.dropout_rate) == (1024, 16, 4096, 6, 0.3)


def test_overrides_are_typed():
  config = config_from_dict(
    {}, ["train.num_steps=7", "optim.learning_rate=2", "data.buckets=[8, 64]", "model.pre_norm=true", "optim.eps=1e-9"]
  )
  assert config.train.num_steps == 7
  assert config.optim.learning_rate == 2.0 and isinstance(config.optim.learning_rate, float)
  assert config.data.buckets == (8, 64)
  assert config.model.pre_norm is True
  assert config.optim.eps == 1e-9


@pytest.mark.parametrize(
  "override, message",
  [
    ("train.num_step=5", "unknown config key 'train.num_step'; did you mean train.num_steps?"),
    ("trian.num_steps=5", "did you mean train?"),
    ("train.num_steps=abc", "train.num_steps must be int, got str 'abc'"),
    ("model.pre_norm=3", "model.pre_norm must be bool"),
    ("model.num_heads=3", "not divisible by model.num_heads=3"),
    ("data.buckets=[32, 16]", "strictly increasing"),
    ("data.max_length=16", "must equal data.max_length (16); e.g. data.buckets=[12,14,16]"),
    ("train.steps_per_call=0", "train.steps_per_call must be >= 1, got 0"),
    ("train.eval_batches=-1", "train.eval_batches must be >= 0 (0 = the whole validation split), got -1"),
    ("mesh.data=0", "mesh.data must be a positive size or -1"),
    ("train.num_steps", "not of the form section.key=value"),
    (
      "model.position=relative",
      "model.position='relative' is unknown; use one of sinusoidal, learned, rope, alibi, t5, none",
    ),
    ("model.norm=batchnorm", "use one of layernorm, rmsnorm"),
    ("model.ffn=swish", "use one of relu, gelu, gelu_tanh, silu, swiglu, geglu, geglu_tanh"),
    ("model.attention=flash", "use one of dense, blockwise"),
    ("model.num_kv_heads=3", "model.num_kv_heads=3 must divide model.num_heads=4; use one of [1, 2, 4]"),
    ("model.sliding_window=-2", "model.sliding_window must be >= 0"),
    ("model.attn_logit_softcap=-1", "model.attn_logit_softcap must be >= 0"),
    ("train.z_loss=-0.1", "train.z_loss must be a finite number >= 0, got -0.1"),
    ("train.z_loss=nan", "train.z_loss must be a finite number >= 0, got nan"),
    ("precision.growth_factor=nan", "precision.growth_factor must be a finite number > 1, got nan"),
    ("precision.growth_factor=1", "precision.growth_factor must be a finite number > 1, got 1"),
    ("model.share_embeddings=false", "did you mean model.tie_embeddings?"),
  ],
)
def test_bad_overrides_give_one_line_errors(override, message):
  with pytest.raises(ConfigError) as info:
    config_from_dict({}, [override])
  assert message in str(info.value)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize(
  "override, message",
  [
    ("optim.learning_rate=nan", "optim.learning_rate must be a finite number, got nan"),
    ("optim.learning_rate=inf", "optim.learning_rate must be a finite number, got inf"),
    ("optim.weight_decay=nan", "optim.weight_decay must be a finite number"),
    ("optim.b1=1.5", "optim.b1 (an Adam decay rate) must be in [0, 1), got 1.5"),
    ("optim.b2=1.0", "optim.b2 (an Adam decay rate) must be in [0, 1), got 1.0"),
    ("optim.b1=-0.1", "optim.b1 (an Adam decay rate) must be in [0, 1)"),
    ("optim.eps=-1", "optim.eps must be > 0"),
    ("optim.eps=0", "optim.eps must be > 0"),
    ("optim.clip_grad_norm=-1", "optim.clip_grad_norm must be >= 0"),
    ("optim.min_learning_rate=-1e-4", "optim.min_learning_rate must be >= 0"),
    ("runtime.platform=foo", "runtime.platform='foo' is unknown; use cpu | gpu | tpu"),
    ("runtime.platform=cuda", "runtime.platform='cuda' is unknown"),
  ],
)
def test_optimizer_numbers_and_platform_names_are_checked(override, message):
  """Every optim float is finite and in its range (NaN passed the old `x <= 0` checks), and
  runtime.platform names a JAX platform."""
  with pytest.raises(ConfigError) as info:
    config_from_dict({}, [override])
  assert message in str(info.value) and "\n" not in str(info.value)
  config_from_dict({}, ["optim.b1=0", "optim.b2=0.999", "optim.eps=1e-12", "runtime.platform=cpu"])  # in range


def test_a_data_dir_that_is_a_file_is_refused(tmp_path):
  file = tmp_path / "cache"
  file.write_text("not a folder")
  for data_dir in (file, file / "below"):
    with pytest.raises(ConfigError, match=f"data.data_dir={data_dir}: {file} is a file, not a directory"):
      config_from_dict({}, [f"data.data_dir={data_dir}"])
  assert config_from_dict({}, [f"data.data_dir={tmp_path / 'new' / 'dir'}"]).data.data_dir.endswith("new/dir")


def test_architecture_options_parse():
  config = config_from_dict(
    {},
    [
      "model.position=rope",
      "model.norm=rmsnorm",
      "model.ffn=swiglu",
      "model.num_kv_heads=2",
      "model.attn_logit_softcap=30",
      "model.sliding_window=64",
      "model.attention=blockwise",
      "model.tie_embeddings=false",
      "train.z_loss=1e-4",
    ],
  )
  m = config.model
  assert (m.position, m.norm, m.ffn, m.attention) == ("rope", "rmsnorm", "swiglu", "blockwise")
  assert (m.num_kv_heads, m.kv_heads, m.sliding_window, m.tie_embeddings) == (2, 2, 64, False)
  assert m.attn_logit_softcap == 30.0 and config.train.z_loss == 1e-4
  assert config_from_dict({}).model.kv_heads == config_from_dict({}).model.num_heads  # 0 = num_heads
  with pytest.raises(ConfigError, match="blockwise does not support attention dropout"):
    config_from_dict({}, ["model.attention=blockwise", "model.attention_dropout_rate=0.1"])


def test_missing_and_malformed_files(tmp_path):
  with pytest.raises(ConfigError, match="does not exist"):
    load_config(tmp_path / "nope.yaml")
  bad = tmp_path / "bad.yaml"
  bad.write_text("- just\n- a list\n")
  with pytest.raises(ConfigError, match="must hold a mapping"):
    load_config(bad)


def test_a_config_typo_fails_before_jax_is_imported():
  """`jaxformer train` checks the config first: a mistyped key costs no JAX import."""
  import subprocess
  import sys

  code = (
    "import sys; from jaxformer.cli import main; "
    "rc = main(['train', '--config', 'configs/tiny.yaml', '--workdir', 'unused', 'train.num_step=3']); "
    "print(rc, sorted(m for m in ('jax', 'flax', 'orbax', 'grain', 'tensorflow_datasets') if m in sys.modules))"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=120
  )
  assert out.stdout.split("\n")[0] == "2 []", out.stdout + out.stderr
  assert out.stderr.strip() == "error: unknown config key 'train.num_step'; did you mean train.num_steps?"


def test_overrides_anywhere_and_shipped_names_from_any_directory(tmp_path, monkeypatch, capsys):
  from jaxformer.cli import _parser
  from jaxformer.cli.args import CONFIGS_DIR, config_path, parse_command_line

  monkeypatch.chdir(tmp_path)  # no configs/ here
  args = parse_command_line(
    _parser(), ["train", "--config", "tiny", "model.position=t5", "--workdir", "W", "train.num_steps=3"]
  )
  assert (args.workdir, args.overrides) == ("W", ["model.position=t5", "train.num_steps=3"])
  config = load_config(config_path(args.config), args.overrides)
  assert (config.model.position, config.train.num_steps) == ("t5", 3)
  assert Path(config_path("tiny")) == CONFIGS_DIR / "tiny.yaml" and (CONFIGS_DIR / "tiny.yaml").is_file()
  for stray in ("--bogus", "bogus"):  # after a run of overrides: neither a flag nor key=value
    with pytest.raises(SystemExit):
      parse_command_line(_parser(), ["train", "--config", "tiny", "model.position=t5", "--workdir", "W", stray])
    assert f"unrecognized arguments: {stray}" in capsys.readouterr().err
