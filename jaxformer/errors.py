"""Errors a user's mistake raises, importable without JAX (the CLI catches them before any
heavy import). Each message is one line naming the problem and the fix."""


class ConfigError(ValueError):
  """A user mistake in a config file or override; the message is one line."""


class DataError(ValueError):
  """A problem with the user's data or data settings; the message is one line naming the fix."""


class VocabularyTooLarge(ValueError):
  """SentencePiece found fewer pieces in the text than ``vocab_size``;
  ``limit`` is its estimate of the largest size that works."""

  def __init__(self, vocab_size: int, limit: int):
    super().__init__(
      f"the training text supports at most about {limit} "
      f"pieces, fewer than vocab_size={vocab_size}; lower "
      "model.vocab_size or add text"
    )
    self.vocab_size, self.limit = vocab_size, limit


class CheckpointError(ValueError):
  """A workdir has no usable checkpoint, a checkpoint could not be written, or another run
  holds the workdir; the message is one line."""


class NonFiniteError(FloatingPointError):
  """Training met a non-finite loss or gradient (`train.nan_policy`): the message is one line
  naming the step; no state from that step on was checkpointed."""


class CompileError(ValueError):
  """The XLA compiler rejected a program for a reason other than running out of device memory
  (`jaxformer compile` reports that as `fits: false`); the message is one line."""
