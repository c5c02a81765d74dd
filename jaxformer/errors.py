"""Errors a user's mistake raises, importable without JAX (the CLI catches them before any
heavy import). Each message is one line naming the problem and the fix."""


class CheckpointError(ValueError):
  """A workdir has no usable checkpoint; the message is one line."""
