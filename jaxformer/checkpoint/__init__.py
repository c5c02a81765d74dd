"""Checkpoints: the Orbax manager with damage detection and the run files (`manager`), and averaging
the params of a run's last checkpoints (`average`)."""
