"""Mesh construction, logical-axis rules and their errors."""

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec

from jaxformer import sharding as sh
from jaxformer.config import ConfigError, MeshConfig, config_from_dict
from jaxformer.runtime.startup import build_mesh


def test_mesh_fills_minus_one_and_uses_auto_axes():
  mesh = sh.make_mesh(MeshConfig(data=-1, fsdp=2, tensor=1))
  assert dict(mesh.shape) == {"data": 4, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 1}
  assert mesh.axis_types == (AxisType.Auto,) * 6


@pytest.mark.parametrize(
  "sizes, expected",
  [
    ({"stage": 2, "context": 2, "expert": 2}, {"data": 1, "stage": 2, "context": 2, "expert": 2}),
    ({"context": -1, "tensor": 2}, {"data": 1, "context": 4, "tensor": 2}),
    ({"data": 2, "expert": -1}, {"data": 2, "expert": 4}),
  ],
)
def test_any_axis_may_grow_and_any_one_may_be_minus_one(sizes, expected):
  config = MeshConfig(**{"data": 1, **sizes})
  mesh = sh.make_mesh(config)
  assert dict(mesh.shape) == {a: expected.get(a, 1) for a in sh.MESH_AXES}
  assert mesh.axis_names == sh.MESH_AXES and mesh.devices.size == 8


def test_mesh_config_errors_are_one_line():
  with pytest.raises(ConfigError, match="at most one of mesh.data, mesh.stage, mesh.fsdp"):
    config_from_dict({}, ["mesh.data=-1", "mesh.expert=-1"])
  with pytest.raises(ConfigError, match="mesh.context must be a positive size or -1, got 0"):
    config_from_dict({}, ["mesh.context=0"])
  with pytest.raises(ConfigError, match=r"mesh data\*stage\*context = 2\*2\*3 = 12 but there are 8 devices") as err:
    sh.make_mesh(MeshConfig(data=2, stage=2, context=3))
  assert "\n" not in str(err.value)


def test_context_must_divide_the_sequence_lengths_before_compiling():
  config = config_from_dict({}, ["mesh.data=2", "mesh.context=4", "train.batch_size=8"])  # buckets 12, 14, ...
  with pytest.raises(
    ConfigError, match=r"mesh.context=4 does not divide the sequence lengths \[12, 14,.*use mesh.context in \[1, 2\]"
  ):
    build_mesh(config)
  ok = config_from_dict({}, ["mesh.data=4", "mesh.context=2", "train.batch_size=8"])
  assert dict(build_mesh(ok).shape)["context"] == 2


def test_mesh_size_must_match_devices():
  with pytest.raises(ConfigError, match=r"= 6 but there are 8 devices; e.g. use mesh.data=8"):
    sh.make_mesh(MeshConfig(data=3, fsdp=2, tensor=1))
  with pytest.raises(ConfigError, match="3 does not divide 8"):
    sh.make_mesh(MeshConfig(data=-1, fsdp=3, tensor=1))


def test_batch_must_divide_data_parallel_size():
  config = config_from_dict({}, ["mesh.data=8", "train.batch_size=12"])
  with pytest.raises(ConfigError, match=r"train.batch_size=12 is not divisible by the data-parallel size 8"):
    build_mesh(config)


def test_rules_map_logical_axes():
  mesh = sh.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  assert sh.batch_sharding(mesh).spec == PartitionSpec(("data", "fsdp", "expert"), "context")
  specs = {
    "w": PartitionSpec(sh.EMBED, sh.MLP),
    "e": PartitionSpec(sh.VOCAB, sh.EMBED),
    "q": PartitionSpec(sh.EMBED, sh.HEADS, sh.KV),
  }
  out = sh.logical_to_sharding(specs, mesh)
  assert out["w"].spec == PartitionSpec("fsdp", "tensor")
  assert out["e"].spec == PartitionSpec("tensor", "fsdp")
  assert out["q"].spec == PartitionSpec("fsdp", "tensor", None)
  assert sh.data_parallel_size(mesh) == 4
  assert len(jax.devices()) == 8


def test_rules_overrides_parse_and_apply():
  rules = dict(sh.parse_rules("embed=none, act_batch=data+fsdp+tensor ,mlp=fsdp"))
  assert rules[sh.EMBED] is None and rules[sh.MLP] == "fsdp"
  assert rules[sh.ACT_BATCH] == ("data", "fsdp", "tensor") and rules[sh.HEADS] == "tensor"
  assert sh.parse_rules("") == sh.LOGICAL_RULES
  mesh = sh.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  rules = sh.rules_for(MeshConfig(rules="act_batch=data,embed=none,act_length=none"))
  assert sh.batch_sharding(mesh, rules=rules).spec == PartitionSpec("data", None)
  assert sh.data_parallel_size(mesh, rules) == 2
  assert sh.logical_to_sharding(PartitionSpec(sh.EMBED, sh.MLP), mesh, rules).spec == PartitionSpec(None, "tensor")
  assert sh.data_parallel_size(mesh) == 4  # the default rules when none are passed


@pytest.mark.parametrize(
  "text, message",
  [
    ("embd=none", "unknown logical axis 'embd'; valid: act_batch"),
    ("embed=model", "embed='model' names no mesh axis"),
    ("embed", "is not logical=mesh_axes"),
    ("embed=", "names no mesh axis"),
  ],
)
def test_bad_rules_overrides_give_one_line_errors(text, message):
  with pytest.raises(ConfigError, match=message) as err:
    sh.parse_rules(text)
  assert "\n" not in str(err.value)


def test_rules_overrides_that_do_not_divide_fail_before_compiling():
  abstract = {"ffn": {"wi": jax.ShapeDtypeStruct((64, 12), "float32")}}
  mesh = sh.make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
  shardings = sh.logical_to_sharding(
    {"ffn": {"wi": PartitionSpec(sh.EMBED, sh.MLP)}}, mesh, sh.parse_rules("mlp=fsdp,embed=none")
  )
  with pytest.raises(
    ConfigError, match=r"\['ffn'\]\['wi'\] dimension 1 of size 12 does not split over mesh axes fsdp = 8"
  ):
    sh.check_divisible(abstract, shardings)


def test_new_axes_in_the_rules_table():
  """Golden specs on a mesh using every axis: context splits the length of activations and
  inputs, expert the experts axis (and the batch outside the experts' buffers), stage the scanned
  layers and the pipeline's stage buffers."""
  mesh = sh.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, stage=2, context=2, expert=2))
  assert sh.batch_sharding(mesh).spec == PartitionSpec(("data", "fsdp", "expert"), "context")
  assert sh.batch_sharding(mesh, stacked=True).spec == PartitionSpec(None, ("data", "fsdp", "expert"), "context")
  specs = {
    "act": PartitionSpec(sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_EMBED),
    "moe": PartitionSpec(sh.EXPERTS, sh.EMBED, sh.MLP),
    "scanned": PartitionSpec(sh.LAYERS, sh.EMBED),
    "buffer": PartitionSpec(sh.ACT_EXPERT_BATCH, sh.ACT_EXPERTS, None, sh.ACT_EMBED),
    "stage_buffer": PartitionSpec(sh.STAGES, sh.ACT_BATCH),
  }
  out = sh.logical_to_sharding(specs, mesh)
  assert out["scanned"].spec == PartitionSpec("stage", "fsdp")
  assert out["stage_buffer"].spec == PartitionSpec("stage", ("data", "fsdp", "expert"))
  assert out["act"].spec == PartitionSpec(("data", "fsdp", "expert"), "context", None)
  assert out["moe"].spec == PartitionSpec("expert", "fsdp", "tensor")
  assert out["buffer"].spec == PartitionSpec(("data", "fsdp"), "expert", None, None)
  assert sh.parse_rules("layers=stage+context")[-2] == (sh.LAYERS, ("stage", "context"))
