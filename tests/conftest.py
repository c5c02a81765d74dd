"""Test set-up: 8 simulated CPU devices, configured before JAX is first imported.

Tests compile many tiny programs; XLA's backend optimisation level 0 makes those compiles
several times faster (random-bit generation for dropout especially) and changes no values
beyond float rounding.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
