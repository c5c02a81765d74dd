"""Test set-up: 8 simulated CPU devices, configured before JAX is first imported.

Tests compile many tiny programs, and compiling is most of the suite's time. XLA's backend
optimisation level 0, the classic loop emitters instead of the MLIR fusion emitters, no expensive
LLVM passes and one codegen module make those compiles several times faster (the last three
about 2.6x on their own) and change no values beyond float rounding. A persistent compilation
cache, shared by the pytest-xdist workers and the CLI subprocesses (they inherit the
environment), compiles each distinct program once: many tests build the same step again (a
resumed run, the same config on another mesh). It lives in `.pytest_cache/` (git-ignored), one
folder per host CPU, and outlasts the session, so `pytest -m slow` after `pytest` (the README's
test command, and CI) reuses the fast suite's programs (few: a clean clone's slow set took
9:18 with an empty cache and 9:24 after the fast suite), and a rerun reuses its own. JAX keys
each entry by the program, the XLA flags and the jaxlib version: an edit that changes a program
misses the cache rather than reading a stale one. A session that finds it over 2 GiB starts
it afresh. Only programs that took 0.1 s or more to compile are written: the other
2,900 of the fast suite's 3,360 (mostly single operations run eagerly) compiled in 10 ms each
and took 6 ms each to write. Likewise one data cache (`multi30k_dir`) prepares Multi30k once
per session (a temporary folder: prepared data is not keyed by the code that prepared it).

Python's cyclic garbage collector is made to run about 14 times less often: a worker's heap
grows to millions of objects (compiled programs, traced jaxprs), every full collection walks
all of them, and tracing allocates enough to trigger one every few seconds. test_lora.py alone
(55 s in one process) spent 4.1 s collecting before (15 full collections), 1.2 s after (one).
"""

import atexit
import contextlib
import fcntl
import gc
import gzip
import hashlib
import itertools
import os
import platform
import shutil
import tempfile
from pathlib import Path

import pytest

# The fast-compile flags alone: CLI subprocesses take these and set their own device count.
COMPILE_FLAGS = (
  "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
  " --xla_llvm_disable_expensive_passes=true --xla_cpu_parallel_codegen_split_count=1"
)
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {COMPILE_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _host_cpu() -> str:
  """A short hash of the host CPU's model and ISA flags: code XLA:CPU compiled for one CPU need
  not run on another, so each gets its own cache folder."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    text = platform.processor()
  lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "CPU part", "Features"))][:4]
  return hashlib.sha256(f"{platform.machine()} {lines}".encode()).hexdigest()[:12]


CACHE_LIMIT = 2 * 1024**3  # bytes of compiled programs kept between sessions
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = Path(__file__).resolve().parent.parent / ".pytest_cache" / f"jax-compilation-cache-{_host_cpu()}"
  if "PYTEST_XDIST_WORKER" not in os.environ:  # the first process, before any reads
    with contextlib.suppress(OSError):  # another session may be clearing it too
      if sum(f.stat().st_size for f in _cache.iterdir() if f.is_file()) > CACHE_LIMIT:
        shutil.rmtree(_cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_cache)
if "JAXFORMER_TEST_DATA_DIR" not in os.environ:
  os.environ["JAXFORMER_TEST_DATA_DIR"] = tempfile.mkdtemp(prefix="jaxformer-test-data-")
  atexit.register(shutil.rmtree, os.environ["JAXFORMER_TEST_DATA_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
gc.set_threshold(10_000, 10, 10)  # Python's default first threshold is 700

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")
SHAKESPEARE = Path(__file__).resolve().parents[1] / "jaxformer" / "data" / "raw" / "tinyshakespeare" / "input.txt.gz"


def pytest_xdist_auto_num_workers(config) -> int:
  """pytest-xdist workers for `-n auto` (pyproject's addopts): three for the fast suite, whose tests
  often wait on a server, a subprocess or a file, so two workers kept 2 cores only 186-188% busy;
  two for the slow set, whose tests start processes of their own."""
  return 3 if config.getoption("markexpr") == "not slow" else 2


def sweep(values, fast: set[str], ids=None) -> list:
  """`pytest.param`s of a parametrized sweep: the cases whose id is in `fast` run in the fast suite,
  the others are marked slow (the marker's "heaviest equivalence checks"). The fast cases were
  chosen so that the fast suite as a whole covers every line of jaxformer/ it covered with the
  whole sweep (pytest-cov's per-test contexts, 2026-12-07). `values`: the cases (tuples for
  several argnames); `ids`: their ids, when the values are not their own (strings)."""
  values = list(values)
  ids = [str(v) for v in values] if ids is None else list(ids)
  assert set(fast) <= set(ids), f"no such cases: {set(fast) - set(ids)}"
  return [
    pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i, marks=() if i in fast else pytest.mark.slow)
    for v, i in zip(values, ids)
  ]


def tiny_config(kind: str | None = None, *overrides: str, **sections: dict):
  """configs/tiny.yaml as a `Config`, the one base of the tests' small models: `kind` sets
  `model.kind` (None keeps the file's encoder-decoder), each keyword is a section whose fields
  replace the file's (`model={"d_model": 16}`), then `overrides` apply as on the command line
  (`"mesh.data=2"`); validated like `--config tiny.yaml`."""
  import yaml

  from jaxformer.config import config_from_dict  # here: JAX must be imported after the flags above

  tree = yaml.safe_load(Path(TINY).read_text())
  for section, fields in sections.items():
    tree[section] = {**tree.get(section, {}), **fields}
  if kind is not None:
    tree["model"]["kind"] = kind
  return config_from_dict(tree, overrides)


def fine_tune_on_pair_files(
  workdir: Path, tmp_path: Path, source: list[str], target: list[str], source_lang: str, target_lang: str
) -> dict:
  """Trains an imported translation `workdir` 3 steps on `source`/`target` written as aligned
  `train.<lang>` files (`data.dataset=files`, 32-token buckets, batch 8); `jaxformer.fit`'s last record."""
  import jaxformer
  from jaxformer.config import load_config

  files = [tmp_path / f"train.{source_lang}", tmp_path / f"train.{target_lang}"]
  for path, lines in zip(files, (source, target)):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  tuned = load_config(
    workdir / "config.yaml",
    [
      "data.dataset=files",
      f"data.train_files={files[0]},{files[1]}",
      f"data.source_lang={source_lang}",
      f"data.target_lang={target_lang}",
      "data.max_length=32",
      "data.buckets=[32]",
      "train.num_steps=3",
      "train.batch_size=8",
      "train.checkpoint_every=3",
      "train.async_checkpoint=false",
      "train.log_every=1",
      f"data.data_dir={tmp_path / 'cache'}",
    ],
  )
  return jaxformer.fit(tuned, workdir)


def shakespeare_files(directory: Path, validation_chars: int = 2048) -> list[str]:
  """Overrides that train a character LM (configs/shakespeare_char.yaml) on Tiny Shakespeare as
  own text files in `directory`: its last `validation_chars` characters are the validation
  file, the rest the training file, and `data.data_dir` is `directory`/data. A run's closing
  evaluation then reads a few windows instead of the shipped split's 111,540 characters,
  which at the tests' 16-token windows took most of a small run's time."""
  train = directory / f"shakespeare-train-{validation_chars}.txt"
  validation = directory / f"shakespeare-validation-{validation_chars}.txt"
  if not validation.exists():
    directory.mkdir(parents=True, exist_ok=True)
    text = gzip.open(SHAKESPEARE, "rt", encoding="utf-8").read()
    train.write_text(text[:-validation_chars], encoding="utf-8")
    validation.write_text(text[-validation_chars:], encoding="utf-8")
  return [
    "data.dataset=files",
    f"data.train_files={train}",
    f"data.validation_files={validation}",
    f"data.data_dir={directory / 'data'}",
  ]


def shakespeare_lines(n: int) -> list[str]:
  """The first `n` non-empty lines of Tiny Shakespeare (of its first 4000), stripped."""
  with gzip.open(SHAKESPEARE, "rt", encoding="utf-8") as f:
    return [line.strip() for line in itertools.islice(f, 4000) if line.strip()][:n]


@pytest.fixture(scope="session")
def multi30k_dir() -> str:
  """A `data.data_dir` holding Multi30k en-de prepared at configs/tiny.yaml's data settings
  (its 1000-piece tokenizer and three splits; buckets, model size and mesh do not change them).

  Built once per test session (about 10 s of CPU, mostly SentencePiece) and shared by both
  xdist workers and the CLI runs they launch; a flock makes the other worker wait rather than
  build it too. Tests of preparation itself use a fresh data_dir of their own.
  """
  root = Path(os.environ["JAXFORMER_TEST_DATA_DIR"])
  with open(root / "prepare.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    from jaxformer.config import load_config  # here: JAX must be imported after the flags above
    from jaxformer.tasks import get_task

    get_task(load_config(TINY, [f"data.data_dir={root}"])).load_data()
  return str(root)
