"""Errors a user's mistake raises, importable without JAX (the CLI catches them before any
heavy import). Each message is one line naming the problem and the fix."""


class CheckpointError(ValueError):
  """A workdir has no usable checkpoint, a checkpoint could not be written, or another run
  holds the workdir; the message is one line."""


class NonFiniteError(FloatingPointError):
  """Training met a non-finite loss or gradient (`train.nan_policy`): the message is one line
  naming the step; no state from that step on was checkpointed."""


class CompileError(ValueError):
  """The XLA compiler rejected a program for a reason other than running out of device memory
  (`jaxformer compile` reports that as `fits: false`); the message is one line."""
