"""The process around a run: start-up (devices, numerics, the mesh), multi-process `jax.distributed`,
preemption and Ctrl-C, and the one-run-per-workdir lock."""
