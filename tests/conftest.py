"""Test set-up: 8 simulated CPU devices, configured before JAX is first imported.

Tests compile many tiny programs; XLA's backend optimisation level 0 makes those compiles
several times faster and changes no values beyond float rounding. A persistent compilation
cache, shared by both pytest-xdist workers and the CLI subprocesses (they inherit the
environment) and removed at exit, compiles each distinct program once per test session:
many tests build the same step again (a resumed run, the same config on another mesh).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="jaxformer-test-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  atexit.register(shutil.rmtree, _cache_dir, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
