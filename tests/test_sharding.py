"""Mesh construction, logical-axis rules and their errors."""

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec

from jaxformer import sharding as sh
from jaxformer.config import ConfigError, MeshConfig, config_from_dict
from jaxformer.runtime import build_mesh


def test_mesh_fills_minus_one_and_uses_auto_axes():
  mesh = sh.make_mesh(MeshConfig(data=-1, fsdp=2, tensor=1))
  assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}
  assert mesh.axis_types == (AxisType.Auto,) * 3


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
  assert sh.batch_sharding(mesh).spec == PartitionSpec(("data", "fsdp"), None)
  specs = {"w": PartitionSpec(sh.EMBED, sh.MLP), "e": PartitionSpec(sh.VOCAB, sh.EMBED),
           "q": PartitionSpec(sh.EMBED, sh.HEADS, sh.KV)}
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
  with sh.axis_rules(sh.parse_rules("act_batch=data,embed=none")):
    assert sh.batch_sharding(mesh).spec == PartitionSpec("data", None)
    assert sh.data_parallel_size(mesh) == 2
    assert sh.logical_to_sharding(PartitionSpec(sh.EMBED, sh.MLP), mesh).spec == PartitionSpec(None, "tensor")
  assert sh.data_parallel_size(mesh) == 4  # default rules again outside the context


@pytest.mark.parametrize("text, message", [
    ("embd=none", "unknown logical axis 'embd'; valid: act_batch"),
    ("embed=model", "embed='model' names no mesh axis"),
    ("embed", "is not logical=mesh_axes"),
    ("embed=", "names no mesh axis"),
])
def test_bad_rules_overrides_give_one_line_errors(text, message):
  with pytest.raises(ConfigError, match=message) as err:
    sh.parse_rules(text)
  assert "\n" not in str(err.value)


def test_rules_overrides_that_do_not_divide_fail_before_compiling():
  abstract = {"ffn": {"wi": jax.ShapeDtypeStruct((64, 12), "float32")}}
  mesh = sh.make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
  with sh.axis_rules(sh.parse_rules("mlp=fsdp,embed=none")):
    shardings = sh.logical_to_sharding({"ffn": {"wi": PartitionSpec(sh.EMBED, sh.MLP)}}, mesh)
  with pytest.raises(ConfigError, match=r"\['ffn'\]\['wi'\] dimension 1 of size 12 does not split over mesh axes fsdp = 8"):
    sh.check_divisible(abstract, shardings)
