"""The run files beside a workdir's checkpoints: the resolved config and the tokenizer models, which
make a workdir (or a folder of derived params: averaged, best) enough for eval, translate, generate
and serve. Each is replaced atomically, so a crash leaves the old file or the new one.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from jaxformer.errors import CheckpointError

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.model"
SOURCE_TOKENIZER_FILE = "source_tokenizer.model"  # only with separate source/target vocabularies


def _write_atomic(path: Path, data: bytes) -> None:
  tmp = path.with_name(path.name + ".tmp")
  try:
    tmp.write_bytes(data)
    tmp.replace(path)
  except OSError:
    with contextlib.suppress(OSError):  # leave no half-written temp file (a read-only folder has none)
      tmp.unlink()
    raise


def copy_run_files(workdir: str | Path, destination: str | Path) -> None:
  """Copies `workdir`'s config and tokenizer files into `destination`, making a folder of
  derived params (averaged, best) a workdir that eval, translate and generate read."""
  for name in (CONFIG_FILE, TOKENIZER_FILE, SOURCE_TOKENIZER_FILE):
    if (Path(workdir) / name).is_file():
      shutil.copyfile(Path(workdir) / name, Path(destination) / name)


def save_run_files(
  workdir: str | Path, config_yaml: str, tokenizer_bytes: bytes, source_tokenizer_bytes: bytes | None = None
) -> None:
  """Writes the resolved config and the tokenizer model (the target's, and the source's
  when the vocabularies are separate) next to the checkpoints, so `eval`/`translate` need
  only the workdir. Each file is replaced atomically.

  Raises:
    CheckpointError: a file cannot be written (the workdir is a file, read-only, full), in
      one line naming the path and the cause.
  """
  workdir = Path(workdir)
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    _write_atomic(workdir / CONFIG_FILE, config_yaml.encode())
    _write_atomic(workdir / TOKENIZER_FILE, tokenizer_bytes)
    if source_tokenizer_bytes is not None:
      _write_atomic(workdir / SOURCE_TOKENIZER_FILE, source_tokenizer_bytes)
  except OSError as e:
    raise CheckpointError(
      f"cannot write the run files in --workdir {workdir}: {e.strerror} ({e.filename}); pass a writable directory"
    ) from None


def load_vocabulary(workdir: str | Path):
  """The workdir's `data.Vocabulary` (`tokenizer.model`, and `source_tokenizer.model` when the
  vocabularies are separate), or None before the first run has written it."""
  from jaxformer.data import Vocabulary, tokenizer_from_bytes  # noqa: PLC0415

  workdir = Path(workdir)
  if not (workdir / TOKENIZER_FILE).is_file():
    return None
  target = tokenizer_from_bytes((workdir / TOKENIZER_FILE).read_bytes())
  source_file = workdir / SOURCE_TOKENIZER_FILE
  return Vocabulary(tokenizer_from_bytes(source_file.read_bytes()) if source_file.is_file() else target, target)


def run_file(workdir: str | Path, name: str) -> Path:
  """Path of a run file in `workdir`.

  Raises:
    CheckpointError: the file does not exist (not a training workdir).
  """
  path = Path(workdir) / name
  if not path.is_file():
    raise CheckpointError(
      f"{path} is missing: {workdir} is not a jaxformer workdir; pass the --workdir of a `jaxformer train` run"
    )
  return path
