"""The package, scripts and benchmarks pass ruff with the `[tool.ruff]` settings in pyproject.toml (CI runs this)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e .[test])")
def test_ruff_passes():
  # tests/ are not in the lint target: fixtures and hand-computed tables keep their own layout.
  result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "jaxformer", "scripts", "benchmarks"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, f"ruff check jaxformer scripts benchmarks failed:\n{result.stdout}{result.stderr}"
  assert "All checks passed!" in result.stdout
