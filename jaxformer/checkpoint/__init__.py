"""Checkpoints: the Orbax manager with damage detection (`manager`), the run files beside them
(`run_files`: the config and tokenizers), and averaging the params of a run's last checkpoints (`average`)."""
