"""The package layout's rules (docs/inside.md): a small root, no upward imports from tasks/ and
inference/ into train/, and model kinds named only where the registries and configs are."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jaxformer"


def _sources(folder: Path):
  return [p for p in folder.rglob("*.py") if "__pycache__" not in p.parts]


def test_root_holds_few_modules():
  root = sorted(p.name for p in PACKAGE.glob("*.py"))
  assert root == ["__init__.py", "__main__.py", "api.py", "errors.py", "plots.py", "sharding.py"]


def test_tasks_and_inference_never_import_train():
  upward = re.compile(r"^\s*(from jaxformer\.train\b|from jaxformer import train\b|import jaxformer\.train\b)", re.M)
  offenders = [
    str(p.relative_to(PACKAGE))
    for folder in ("tasks", "inference")
    for p in _sources(PACKAGE / folder)
    if upward.search(p.read_text())
  ]
  assert offenders == []


def test_model_kinds_are_named_only_by_tasks_sources_and_config():
  kinds = re.compile(r'"(encoder_decoder|decoder_only|encoder_only)"')
  allowed = ("tasks", "data/sources", "config")
  offenders = [
    f"{p.relative_to(PACKAGE)}: {m.group(0)}"
    for p in _sources(PACKAGE)
    if not str(p.relative_to(PACKAGE)).startswith(allowed)
    for m in kinds.finditer(p.read_text())
  ]
  assert offenders == []


def test_error_classes_live_in_errors_py():
  defined = re.compile(r"^class (\w+)\((\w*Error|ValueError|Exception|FloatingPointError)\b", re.M)
  offenders = [
    f"{p.relative_to(PACKAGE)}: {m.group(1)}"
    for p in _sources(PACKAGE)
    if p.name != "errors.py"
    for m in defined.finditer(p.read_text())
  ]
  assert offenders == []
