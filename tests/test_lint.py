"""The whole tree passes `ruff check` and `ruff format --check` with the `[tool.ruff]` settings in
pyproject.toml (CI runs this): the package, scripts, benchmarks and these tests."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e .[test])")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_passes(command):
  result = subprocess.run(
    [sys.executable, "-m", "ruff", *command, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, f"ruff {' '.join(command)} . failed:\n{result.stdout}{result.stderr}"
