"""Multi-process training on one machine: 2 processes x 4 CPU devices behave like 1 x 8.

Launches `scripts/launch_local_multihost.sh`, compares the loss with a single-process run on
the same mesh (both run two steps per jitted call, `train.steps_per_call=2`, so each process
feeds its rows of a stacked `[steps, batch, length]` global array), restores the multi-process
checkpoint in a single-device `eval`, and checks that the launcher fails fast and leaves no
process behind. (That each process loads only its rows of the global batch is tested in
test_data_pipeline.py::test_process_shards_union.)
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import COMPILE_FLAGS, shakespeare_files

from jaxformer.runtime import distributed

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
LAUNCH = str(ROOT / "scripts" / "launch_local_multihost.sh")
MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
STEPS = 4
PER_CALL = 2  # steps per jitted call, and per logged interval


def _env(tmp: Path) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = COMPILE_FLAGS  # devices come from runtime.num_cpu_devices
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHON"] = sys.executable
  env["JAXFORMER_LOG_DIR"] = str(tmp / "logs")
  for k in (
    distributed.ENV_COORDINATOR,
    distributed.ENV_NUM_PROCESSES,
    distributed.ENV_PROCESS_ID,
    "SLURM_NTASKS",
    "SLURM_PROCID",
  ):
    env.pop(k, None)
  return env


def _group_members(pgid: int) -> list[int]:
  """Live (non-zombie) processes in process group `pgid`."""
  members = []
  for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if fields[0] != "Z" and int(fields[2]) == pgid:
      members.append(int(stat.parent.name))
  return members


def _run(cmd: list[str], env: dict, timeout: float = 1800) -> tuple[subprocess.CompletedProcess, int]:
  """Runs `cmd` in a new process group (killed as a whole on timeout); returns (result, pgid)."""
  proc = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True
  )
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    raise
  return subprocess.CompletedProcess(cmd, proc.returncode, out, err), proc.pid


def _check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
  if result.returncode != 0:
    raise AssertionError(f"{' '.join(result.args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
  return result


def _train_args(data_dir, workdir) -> list[str]:
  # SentencePiece learns from a sample of 4000 sentences: the data_dir is prepared afresh here.
  return [
    "--config",
    TINY,
    "--workdir",
    str(workdir),
    f"data.data_dir={data_dir}",
    "data.buckets=[64]",
    "data.input_sentence_size=4000",
    "model.num_encoder_layers=1",
    "model.num_decoder_layers=1",
    "train.batch_size=16",
    f"train.log_every={PER_CALL}",
    f"train.num_steps={STEPS}",
    "train.eval_every=1000",
    "train.eval_batches=2",
    f"train.steps_per_call={PER_CALL}",
    "train.checkpoint_every=1000",
    *MESH,
  ]


def _losses(workdir) -> dict[int, tuple[float, float]]:
  """step -> (loss, grad_norm) of each logged training interval."""
  lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
  return {m["step"]: (m["loss"], m["grad_norm"]) for m in map(json.loads, lines) if "loss" in m}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("multihost")
  env, data_dir = _env(tmp), tmp / "data"
  # Both processes start on an unprepared data_dir: process 0 builds it, process 1 waits.
  multi, pgid = _run(
    ["bash", LAUNCH, "2", "--", "train", *_train_args(data_dir, tmp / "multi"), "runtime.num_cpu_devices=4"], env
  )
  _check(multi)
  assert _group_members(pgid) == []
  single, _ = _run(
    [sys.executable, "-m", "jaxformer", "train", *_train_args(data_dir, tmp / "single"), "runtime.num_cpu_devices=8"],
    env,
  )
  _check(single)
  return tmp, env, multi


@pytest.mark.slow
def test_two_processes_match_one_process(runs):
  tmp, _, multi = runs
  multi_losses, single_losses = _losses(tmp / "multi"), _losses(tmp / "single")
  assert sorted(multi_losses) == sorted(single_losses) == list(range(PER_CALL, STEPS + 1, PER_CALL))
  # Same global batches and same dropout bits (the masks hash each element's global position,
  # so they do not depend on which process holds a shard); only reduction order may differ.
  for step, values in single_losses.items():
    assert multi_losses[step] == pytest.approx(values, rel=1e-5), step
  # Only process 0 printed metrics / wrote run files; process 1's log holds no JSON lines.
  assert [json.loads(line)["step"] for line in multi.stdout.splitlines() if '"loss"' in line] == list(
    range(PER_CALL, STEPS + 1, PER_CALL)
  )
  assert not [line for line in (tmp / "logs" / "process_1.log").read_text().splitlines() if line.startswith("{")]
  assert (tmp / "multi" / "config.yaml").is_file() and (tmp / "multi" / "tokenizer.model").is_file()


@pytest.mark.slow
def test_multiprocess_checkpoint_restores_in_single_process_eval(runs):
  tmp, env, _ = runs
  assert sorted(int(p.name) for p in (tmp / "multi" / "checkpoints").iterdir()) == [STEPS]
  src, ref = tmp / "src.en", tmp / "ref.de"
  src.write_text("A man is riding a bike.\nTwo dogs play in the snow.\n")
  ref.write_text("Ein Mann fährt Fahrrad.\nZwei Hunde spielen im Schnee.\n")
  result, _ = _run(
    [
      sys.executable,
      "-m",
      "jaxformer",
      "eval",
      "--workdir",
      str(tmp / "multi"),
      "--src",
      str(src),
      "--ref",
      str(ref),
      "--max-length",
      "4",
      "runtime.num_cpu_devices=1",
      "mesh.data=1",
      "mesh.fsdp=1",
      "mesh.tensor=1",
    ],
    env,
  )
  out = json.loads(_check(result).stdout.strip().splitlines()[-1])
  assert out["step"] == STEPS and out["num_sentences"] == 2


@pytest.mark.slow
def test_launcher_config_error_fails_fast(tmp_path):
  start = time.monotonic()
  result, pgid = _run(
    ["bash", LAUNCH, "2", "--", "train", "--config", TINY, "--workdir", str(tmp_path / "w"), "train.no_such_key=1"],
    _env(tmp_path),
    timeout=120,
  )
  assert result.returncode == 2
  assert "error:" in result.stderr and "no_such_key" in result.stderr
  assert _group_members(pgid) == []
  assert time.monotonic() - start < 60


def test_launcher_kills_the_others_when_one_fails(tmp_path):
  """Process 1 fails while process 0 would hang (as in a collective): the launcher returns
  process 1's status promptly and kills process 0."""
  fake = tmp_path / "fake_python"
  fake.write_text(f"""#!/bin/bash
if [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi
case " $* " in
  *" --process-id 1 "*) sleep 0.5; echo "boom" >&2; exit 3 ;;
  *) exec sleep 300 ;;
esac
""")
  fake.chmod(0o755)
  env = _env(tmp_path)
  env["PYTHON"] = str(fake)
  start = time.monotonic()
  result, pgid = _run(["bash", LAUNCH, "3", "--", "train", "--config", TINY], env, timeout=60)
  assert result.returncode == 3
  assert "process 1 exited with status 3" in result.stderr and "[process 1] boom" in result.stderr
  assert time.monotonic() - start < 30
  assert _group_members(pgid) == []


def test_resolve_layout_from_flags_env_and_slurm():
  assert distributed.resolve(environ={}) is None
  spec = distributed.resolve("127.0.0.1:1234", 2, 1, environ={})
  assert (spec.coordinator, spec.num_processes, spec.process_id, spec.source) == ("127.0.0.1:1234", 2, 1, "flags")
  assert distributed.resolve("h:1", 1, 0, environ={}) is None  # one process: nothing to join
  env = {
    distributed.ENV_COORDINATOR: "host:99",
    distributed.ENV_NUM_PROCESSES: "4",
    distributed.ENV_PROCESS_ID: "3",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "0",
  }
  assert distributed.resolve(environ=env).source == "env"  # explicit variables beat SLURM
  slurm = distributed.resolve(environ={"SLURM_NTASKS": "8", "SLURM_PROCID": "5"})
  assert (slurm.coordinator, slurm.num_processes, slurm.process_id, slurm.source) == (None, 8, 5, "slurm")
  assert distributed.resolve(environ={"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
  with pytest.raises(ValueError, match="together"):
    distributed.resolve("h:1", 2, None, environ={})
  with pytest.raises(ValueError, match="--process-id=2"):
    distributed.resolve("h:1", 2, 2, environ={})
  with pytest.raises(ValueError, match="HOST:PORT"):
    distributed.resolve("nohost", 2, 0, environ={})
  with pytest.raises(ValueError, match=distributed.ENV_COORDINATOR):
    distributed.resolve(environ={distributed.ENV_NUM_PROCESSES: "2", distributed.ENV_PROCESS_ID: "0"})


def _text(path: Path, lines: int, offset: int) -> str:
  words = "cat dog bird fish horse cow sheep goat duck frog".split()
  path.write_text(
    "".join(" ".join(words[(i * k + offset) % 10] for k in range(1, 2 + i % 5)) + "\n" for i in range(lines))
  )
  return str(path)


@pytest.mark.slow
def test_expert_parallel_two_processes_match_one_process(tmp_path):
  """A decoder-only mixture of experts on data=2, fsdp=2, expert=2 (tokens all-to-all between the
  processes): the losses, router losses and per-layer router load of 2 processes x 4 devices equal
  1 x 8, and the load is in metrics.jsonl."""
  env = _env(tmp_path)
  args = [
    "--config",
    str(ROOT / "configs" / "shakespeare_char.yaml"),
    "data.dataset=files",
    f"data.train_files={_text(tmp_path / 'train.txt', 300, 0)}",
    f"data.validation_files={_text(tmp_path / 'val.txt', 10, 3)}",
    f"data.data_dir={tmp_path / 'data'}",
    "model.vocab_size=32",
    "model.d_model=32",
    "model.num_heads=2",
    "model.d_ff=48",
    "model.num_decoder_layers=2",
    "model.max_length=16",
    "data.max_length=16",
    "model.num_experts=4",
    "model.expert_capacity_factor=1.0",
    "train.batch_size=8",
    f"train.num_steps={STEPS}",
    f"train.log_every={PER_CALL}",
    f"train.eval_every={STEPS}",
    "train.eval_batches=2",
    f"train.checkpoint_every={STEPS}",
    f"train.steps_per_call={PER_CALL}",
    "optim.warmup_steps=2",
    f"optim.decay_steps={STEPS}",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.expert=2",
  ]
  _check(
    _run(
      ["bash", LAUNCH, "2", "--", "train", "--workdir", str(tmp_path / "multi"), *args, "runtime.num_cpu_devices=4"],
      env,
    )[0]
  )
  _check(
    _run(
      [
        sys.executable,
        "-m",
        "jaxformer",
        "train",
        "--workdir",
        str(tmp_path / "single"),
        *args,
        "runtime.num_cpu_devices=8",
      ],
      env,
    )[0]
  )
  keys = ("loss", "grad_norm", "router_balance_loss", "router_z_loss", "router_dropped")
  rows = {}
  for run in ("multi", "single"):
    lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
    rows[run] = [m for m in map(json.loads, lines) if "loss" in m]
  assert [m["step"] for m in rows["single"]] == [m["step"] for m in rows["multi"]] == [2, 4]
  for multi, single in zip(rows["multi"], rows["single"]):
    assert [multi[k] for k in keys] == pytest.approx([single[k] for k in keys], rel=1e-5)
    assert len(single["router_load"]) == 2 and all(len(layer) == 4 for layer in single["router_load"])
    assert all(sum(layer) == pytest.approx(1.0, abs=1e-3) for layer in single["router_load"])
    assert sum(multi["router_load"], []) == pytest.approx(sum(single["router_load"], []), abs=1e-4)
    assert single["router_dropped"] > 0 and len(single["router_max_load"]) == 2


@pytest.mark.slow
def test_context_parallel_two_processes_match_one_process(tmp_path):
  """mesh.context=4 x mesh.data=2 over 2 processes x 4 devices: each process holds two context groups' shards of
  a decoder-only model's sequences, attention gathers keys/values over them; losses equal one 8-device process."""
  env = _env(tmp_path)
  overrides = [
    *shakespeare_files(tmp_path),
    "model.d_model=32",
    "model.num_heads=2",
    "model.d_ff=64",
    "model.num_decoder_layers=1",
    "model.position=rope",
    "model.attention=blockwise",
    "model.attention_block_size=16",
    "model.max_length=128",
    "data.max_length=128",
    "train.batch_size=8",
    f"train.num_steps={STEPS}",
    f"train.log_every={PER_CALL}",
    f"train.steps_per_call={PER_CALL}",
    "train.eval_every=1000",
    "train.eval_batches=2",
    "train.checkpoint_every=1000",
    "mesh.data=2",
    "mesh.context=4",
  ]

  def args(name: str, devices: int) -> list[str]:
    return [
      "train",
      "--config",
      str(ROOT / "configs" / "shakespeare_char.yaml"),
      "--workdir",
      str(tmp_path / name),
      *overrides,
      f"runtime.num_cpu_devices={devices}",
    ]

  _check(_run(["bash", LAUNCH, "2", "--", *args("multi", 4)], env)[0])
  _check(_run([sys.executable, "-m", "jaxformer", *args("single", 8)], env)[0])
  multi_losses, single_losses = _losses(tmp_path / "multi"), _losses(tmp_path / "single")
  assert sorted(multi_losses) == sorted(single_losses) == list(range(PER_CALL, STEPS + 1, PER_CALL))
  for step, values in single_losses.items():
    assert multi_losses[step] == pytest.approx(values, rel=1e-5), step
