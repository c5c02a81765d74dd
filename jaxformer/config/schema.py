"""Trees of frozen dataclasses from nested dicts, and back: the machinery under `config/loader.py`.

`build(cls, tree)` checks every key against the dataclass fields (an unknown key gets the
nearest valid one as a hint) and every value against its annotation (int, float, str, bool,
tuples of those, nested dataclasses), raising `ConfigError` with one line on bad input.
Fields whose metadata has `set_by` are derived: they are not user keys, `to_plain` leaves
them out and `build` refuses them, naming the key that sets them.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

import yaml

from jaxformer.errors import ConfigError


def _type_name(tp: Any) -> str:
  return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
  """Checks `value` against the annotation `tp`, converting ints to floats and lists to tuples."""
  origin = typing.get_origin(tp)
  if origin is tuple:
    (elem, _) = typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{where} must be a list of {_type_name(elem)}, got {value!r}")
    return tuple(_coerce(v, elem, f"{where}[{i}]") for i, v in enumerate(value))
  if tp is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-9" (no dot) as a string
    try:
      return float(value)
    except ValueError:
      pass
  if tp in (int, float, str, bool):
    if type(value) is not tp:
      raise ConfigError(f"{where} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value
  raise ConfigError(f"{where} has an unsupported type {tp}")


def build(cls: type, values: dict[str, Any], where: str = "") -> Any:
  """`cls(**values)` with nested dataclasses built from nested dicts; `where` prefixes the
  dotted key names in error messages.

  Raises:
    ConfigError: an unknown or derived key, or a value of the wrong type.
  """
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  names = [name for name, f in fields.items() if "set_by" not in f.metadata]
  kwargs = {}
  for key, value in values.items():
    path = f"{where}{key}"
    if key in fields and key not in names:
      meta = fields[key].metadata
      raise ConfigError(f"{path} is not a config key: {meta['set_by']} sets it; write e.g. {meta['example']}")
    if key not in names:
      close = difflib.get_close_matches(key, names, n=1)
      hint = f"; did you mean {where}{close[0]}?" if close else f"; valid keys: {', '.join(names)}"
      raise ConfigError(f"unknown config key {path!r}{hint}")
    tp = hints[key]
    if dataclasses.is_dataclass(tp):
      if not isinstance(value, dict):
        raise ConfigError(f"{path} must be a mapping of {tp.__name__} fields, got {value!r}")
      kwargs[key] = build(tp, value, f"{path}.")
    else:
      kwargs[key] = _coerce(value, tp, path)
  return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
  """Splits `a.b=value` and parses the value as YAML (so 3, 0.5, true, [1,2] are typed)."""
  if "=" not in text or text.startswith("="):
    raise ConfigError(f"override {text!r} is not of the form section.key=value")
  key, raw = text.split("=", 1)
  try:
    value = yaml.safe_load(raw) if raw else ""
  except yaml.YAMLError:
    value = raw
  return key.strip(), value


def apply_overrides(tree: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
  """A copy of the nested dict `tree` with each `a.b=value` override set (the input is unchanged)."""
  tree = _deep_copy(tree)
  for text in overrides:
    dotted, value = parse_override(text)
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
    node[leaf] = value
  return tree


def _deep_copy(tree: dict[str, Any]) -> dict[str, Any]:
  return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def to_plain(x: Any) -> Any:
  """A dataclass tree's user keys as plain YAML-safe types (tuples become lists; derived
  `set_by` fields are left out)."""
  if dataclasses.is_dataclass(x):
    return {f.name: to_plain(getattr(x, f.name)) for f in dataclasses.fields(x) if "set_by" not in f.metadata}
  if isinstance(x, (list, tuple)):
    return [to_plain(v) for v in x]
  return x


def _field_comments(cls: type) -> dict[str, str]:
  """The trailing `# comment` of each field line in `cls`'s source (its description)."""
  import inspect  # noqa: PLC0415
  import re  # noqa: PLC0415

  try:
    source = inspect.getsource(cls)
  except (OSError, TypeError):
    return {}
  found = re.findall(r"^\s+(\w+): [^=\n]+=.*?#\s*(.+)$", source, re.MULTILINE)
  return {name: text.strip() for name, text in found}


def describe(config: Any, prefix: str = "") -> list[dict[str, Any]]:
  """One row per user key of a dataclass tree: dotted `key`, `value`, `type`, `default` and
  `description` (the field's source comment), nested dataclasses expanded."""
  rows = []
  hints = typing.get_type_hints(type(config))
  comments = _field_comments(type(config))
  for f in dataclasses.fields(config):
    if "set_by" in f.metadata:
      continue
    value = getattr(config, f.name)
    key = f"{prefix}{f.name}"
    if dataclasses.is_dataclass(value):
      rows += describe(value, key + ".")
      continue
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    rows.append(
      {
        "key": key,
        "value": to_plain(value),
        "type": _type_name(hints[f.name]).replace("typing.", ""),
        "default": to_plain(default),
        "description": comments.get(f.name, ""),
      }
    )
  return rows
