"""`jaxformer bench`: how fast one training step runs, how much of the device it uses, and
how much memory it needs, on fixed-shape synthetic batches.

Reported per run: compile time, median step time after warm-up, target tokens/s, model
FLOPs per target token (`bench.flops`), achieved FLOP/s, MFU against the device
peak (CPU: a matmul micro-benchmark in the same run; GPU/TPU: vendor data sheets), XLA's
own FLOP count, the pipeline's bubble fraction (`mesh.stage` > 1), the compiled program's
memory (`temp_memory_bytes`: XLA's temporary buffers, the part remat shrinks) and, where the
backend has them, device memory stats.
With PyTorch installed, `jaxformer.bench.torch_peer` times the same model in PyTorch
(`torch.nn.Transformer`, or a causal `torch.nn.TransformerEncoder` for a decoder-only LM) at
the same shape, batch and optimizer, in rounds interleaved with ours so that load from other
processes hits both alike.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import sharding as sh
from jaxformer.aot.train_step import memory_parts
from jaxformer.bench.flops import device_peak, dot_dtypes, time_calls, train_flops_per_step
from jaxformer.config import Config, ConfigError, ModelConfig
from jaxformer.data import global_batch
from jaxformer.models.pipeline import pipeline_for
from jaxformer.runtime.startup import build_mesh
from jaxformer.tasks import TASKS, get_task, task_class
from jaxformer.train.optim import make_optimizer
from jaxformer.train.state import create_state, state_shardings
from jaxformer.train.step import make_train_call

FIRST_WORD_ID = 3  # ids 0..2 are padding, EOS and BOS; synthetic batches use real words only
# The model options the torch peers build (the paper's); any other value skips the peer.
PEER_OPTIONS = {
  "position": "sinusoidal",
  "norm": "layernorm",
  "ffn": "relu",
  "mlp_bias": True,
  "attention": "dense",
  "attention_bias": "none",
  "attention_head_dim": 0,
  "attn_logit_softcap": 0.0,
  "sliding_window": 0,
  "embedding_scale": True,
  "embedding_norm": False,
  "type_vocab_size": 0,
  "logits_bias": False,
  "num_experts": 0,
}


@dataclasses.dataclass(frozen=True)
class BenchOptions:
  """What to time: a global batch of `batch_size` pairs of `src_length` source and
  `tgt_length` target tokens; `warmup` untimed steps, then `steps` timed ones."""

  batch_size: int
  src_length: int = 32
  tgt_length: int = 32
  steps: int = 10
  warmup: int = 3
  peer: bool = True  # also time the same model in PyTorch when it is installed

  def validate(self, model: ModelConfig) -> BenchOptions:
    """These options for `model`: a decoder-only model reads `tgt_length` tokens per row (its
    `src_length` is set to that). Raises ConfigError (one line) for sizes that cannot run, or
    a model kind other than the encoder-decoder and the decoder-only LM."""
    task = task_class(model.kind)
    if not task.benchable:
      timed = " and ".join(kind for kind in TASKS if task_class(kind).benchable)
      raise ConfigError(
        f"jaxformer bench times {timed} train steps, not "
        f"model.kind={model.kind}; use e.g. configs/multi30k_small.yaml or configs/decoder_1b.yaml"
      )
    if not task.translates and self.src_length != self.tgt_length:
      return dataclasses.replace(self, src_length=self.tgt_length).validate(model)
    for name in ("batch_size", "src_length", "tgt_length", "steps"):
      if getattr(self, name) < 1:
        raise ConfigError(f"bench --{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
    if self.warmup < 0:
      raise ConfigError(f"bench --warmup must be >= 0, got {self.warmup}")
    longest = max(self.src_length, self.tgt_length)
    if longest > model.max_length:
      raise ConfigError(
        f"bench length {longest} exceeds model.max_length={model.max_length}; add model.max_length={longest}"
      )
    if model.vocab_size <= FIRST_WORD_ID:
      raise ConfigError(f"model.vocab_size={model.vocab_size} leaves no word ids; use > {FIRST_WORD_ID}")
    return self


def synthetic_batch(
  batch_size: int, src_length: int, tgt_length: int, vocab_size: int, seed: int = 0
) -> dict[str, np.ndarray]:
  """int32 `inputs` `[batch, src_length]` and `targets` `[batch, tgt_length]`: uniform random
  word ids, no padding, the same for a given seed (so runs on different meshes see one batch)."""
  rng = np.random.default_rng(seed)
  return {
    "inputs": rng.integers(FIRST_WORD_ID, vocab_size, (batch_size, src_length), dtype=np.int32),
    "targets": rng.integers(FIRST_WORD_ID, vocab_size, (batch_size, tgt_length), dtype=np.int32),
  }


class _JaxTrainer:
  """The compiled train step on one fixed batch; each call runs one jitted call (one step, or
  `train.steps_per_call` steps on a stack of copies of the batch) and records the loss per
  target token of each step (fetching it waits for the call to finish)."""

  def __init__(self, compiled, state, batch, rng):
    self.compiled, self.state, self.batch, self.rng = compiled, state, batch, rng
    self.losses: list[float] = []

  def __call__(self) -> float:
    self.state, metrics = self.compiled(self.state, self.batch, self.rng)
    losses = np.atleast_1d(np.asarray(metrics["loss"])) / np.atleast_1d(np.asarray(metrics["num_tokens"]))
    self.losses += [float(x) for x in losses]
    return self.losses[-1]


def _memory(compiled) -> dict[str, int]:
  """`aot.memory_parts` under this benchmark's JSON names (`peak_memory_bytes`: their total)."""
  names = {
    "argument_bytes": "argument_memory_bytes",
    "output_bytes": "output_memory_bytes",
    "alias_bytes": "alias_memory_bytes",
    "temp_bytes": "temp_memory_bytes",
    "total_bytes": "peak_memory_bytes",
  }
  return {names[k]: v for k, v in memory_parts(compiled).items()}


def _device_memory() -> dict[str, int]:
  stats = jax.devices()[0].memory_stats()  # None on CPU
  if not stats or "peak_bytes_in_use" not in stats:
    return {}
  return {"device_peak_bytes_in_use": int(stats["peak_bytes_in_use"])}


@dataclasses.dataclass
class PreparedStep:
  """A train step lowered for abstract inputs of the benchmark's shapes (nothing allocated)."""

  config: Config  # with train.batch_size set to the benchmark's batch
  mesh: Any
  create_state: Callable[[], Any]
  lowered: Any
  lower_time_s: float  # tracing and lowering the step to StableHLO


def prepare_step(config: Config, options: BenchOptions) -> PreparedStep:
  """Builds the mesh and lowers the train step for sharded abstract inputs (not compiled).
  Raises ConfigError for sizes the mesh or model cannot take."""
  options = options.validate(config.model)
  config = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=options.batch_size))
  mesh = build_mesh(config)
  model = get_task(config).make_model()
  tx = make_optimizer(config.optim, config.model.d_model)
  rules = sh.rules_for(config.mesh)
  abstract, shardings = state_shardings(model, tx, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  k = config.train.steps_per_call
  lead = (k,) if k > 1 else ()
  batch = {
    name: jax.ShapeDtypeStruct(
      lead + (options.batch_size, length), jnp.int32, sharding=sh.batch_sharding(mesh, stacked=k > 1, rules=rules)
    )
    for name, length in (("inputs", options.src_length), ("targets", options.tgt_length))
  }
  train_step = make_train_call(model, tx, config, mesh, shardings)
  start = time.perf_counter()
  with sh.bind(mesh, rules):
    lowered = train_step.jitted.lower(abstract, batch, jax.random.key(config.runtime.seed))
  lower_time = time.perf_counter() - start
  return PreparedStep(
    config,
    mesh,
    lambda: create_state(model, tx, mesh, config.runtime.seed, shardings, rules=rules),
    lowered,
    lower_time,
  )


def compute_dtype(lowered) -> str:
  """The operand element type of most matmuls in a lowered program ('f32', 'bf16', ...)."""
  dtypes = dot_dtypes(lowered.as_text())
  return dtypes.most_common(1)[0][0] if dtypes else "f32"


def run_bench(config: Config, options: BenchOptions) -> dict[str, Any]:
  """Compiles and times the train step of `config` (see the module docstring).

  Returns a flat dict of JSON-safe values; `tokens_per_sec` counts target tokens, `losses`
  holds the loss per target token of every step run (warm-up first). With
  `train.steps_per_call=k > 1` each call runs k steps, a step's time is the call's over k,
  and `warmup` and `steps` are rounded up to whole calls (`steps` reports the steps run).
  Raises ConfigError for sizes the mesh or model cannot take.
  """
  options = options.validate(config.model)
  prepared = prepare_step(config, options)
  config, mesh, lowered = prepared.config, prepared.mesh, prepared.lowered
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_time = prepared.lower_time_s + time.perf_counter() - start  # trace + lower + XLA compile
  dtype = compute_dtype(lowered)

  host_batch = synthetic_batch(
    options.batch_size, options.src_length, options.tgt_length, config.model.vocab_size, config.runtime.seed
  )
  k = config.train.steps_per_call
  call_batch = {name: np.stack([a] * k) for name, a in host_batch.items()} if k > 1 else host_batch
  trainer = _JaxTrainer(
    compiled,
    prepared.create_state(),
    global_batch(call_batch, mesh, sh.rules_for(config.mesh)),
    jax.random.key(config.runtime.seed),
  )
  peer = _make_peer(config, host_batch) if options.peer else None
  warmup_calls, calls = -(-options.warmup // k), -(-options.steps // k)
  time_calls(trainer, warmup_calls)
  if peer is not None:
    time_calls(peer, warmup_calls * k)
  # Two interleaved rounds when there is a peer, so background load hits both alike.
  rounds = 2 if peer is not None else 1
  times, peer_times = [], []
  for r in range(rounds):
    n = calls // rounds + (r < calls % rounds)
    times += [t / k for t in time_calls(trainer, n)]
    if peer is not None:
      peer_times += time_calls(peer, n * k)

  step_time = statistics.median(times)
  tokens = options.batch_size * options.tgt_length
  flops = train_flops_per_step(config.model, options.batch_size, options.src_length, options.tgt_length)
  peak, peak_source = device_peak(dtype)
  achieved = flops / step_time
  result: dict[str, Any] = {
    "config": config.name,
    "backend": jax.default_backend(),
    "num_devices": jax.device_count(),
    "mesh": dict(mesh.shape),
    "batch_size": options.batch_size,
    "src_length": options.src_length,
    "tgt_length": options.tgt_length,
    "steps": calls * k,
    "warmup": warmup_calls * k,
    "steps_per_call": k,
    "compute_dtype": dtype,
    "lower_time_s": prepared.lower_time_s,
    "compile_time_s": compile_time,
    "step_time_s": step_time,
    "step_time_min_s": min(times),
    "tokens_per_sec": tokens / step_time,
    "model_flops_per_token": flops / tokens,
    "model_flops_per_step": flops,
    # XLA's cost analysis counts a scanned loop's body once, not per step.
    "xla_flops_per_step": float(lowered.cost_analysis().get("flops", float("nan"))) if k == 1 else None,
    "achieved_flops": achieved,
    "peak_flops": peak,
    "peak_source": peak_source,
    "mfu": achieved / peak if peak else None,
    **_memory(compiled),
    **_device_memory(),
    # The idle share of the pipeline schedule the step runs (models/pipeline.py); 0 without mesh.stage.
    "bubble_fraction": pipeline.bubble_fraction if (pipeline := pipeline_for(config, mesh)) else 0.0,
    "losses": trainer.losses,
  }
  if peer is not None:
    peer_step = statistics.median(peer_times)
    result.update(
      torch_step_time_s=peer_step,
      torch_tokens_per_sec=tokens / peer_step,
      torch_mfu=flops / peer_step / peak if peak else None,
      jax_over_torch=peer_step / step_time,
      torch_losses=peer.losses,
      **peer.info(),
    )
  return result


def _make_peer(config: Config, host_batch: dict[str, np.ndarray]):
  """The torch peer when PyTorch is installed, the backend is CPU (it runs on the host) and
  the model is one the torch stacks can express (the paper's options)."""
  if importlib.util.find_spec("torch") is None or jax.default_backend() != "cpu":
    return None
  m = config.model
  other = [f"model.{name}={getattr(m, name)}" for name, value in PEER_OPTIONS.items() if getattr(m, name) != value]
  if m.kv_heads != m.num_heads:
    other.append(f"model.num_kv_heads={m.kv_heads}")
  if other:
    print(f"torch peer skipped: the torch stacks do not build {', '.join(other)}", file=sys.stderr)
    return None
  from jaxformer.bench.torch_peer import TorchTrainer

  return TorchTrainer(config, host_batch["inputs"], host_batch["targets"], task_class(m.kind).translates)


def _si(x: float | None, unit: str) -> str:
  if x is None:
    return "-"
  for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.2f} {prefix}{unit}"
  return f"{x:.3g} {unit}"


def format_table(r: dict[str, Any]) -> str:
  """A human-readable table of a `run_bench` result (jaxformer and, if timed, torch)."""
  peer = "torch_step_time_s" in r
  rows = [
    (
      "shape",
      f"{r['config']}: batch {r['batch_size']}, src {r['src_length']}, tgt {r['tgt_length']}, "
      f"{r['compute_dtype']}, mesh {r['mesh']}, {r['steps_per_call']} step(s) per call",
      None,
    ),
    ("compile", f"{r['compile_time_s']:.1f} s", None),
    (
      "step time (median)",
      f"{r['step_time_s'] * 1e3:.0f} ms",
      f"{r['torch_step_time_s'] * 1e3:.0f} ms" if peer else None,
    ),
    ("target tokens/s", f"{r['tokens_per_sec']:.0f}", f"{r['torch_tokens_per_sec']:.0f}" if peer else None),
    ("model FLOPs/token", _si(r["model_flops_per_token"], "FLOP"), None),
    (
      "achieved",
      _si(r["achieved_flops"], "FLOP/s"),
      _si(r["model_flops_per_step"] / r["torch_step_time_s"], "FLOP/s") if peer else None,
    ),
    ("peak", f"{_si(r['peak_flops'], 'FLOP/s')} ({r['peak_source']})", None),
    (
      "MFU",
      f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
      f"{r['torch_mfu']:.1%}" if peer and r["torch_mfu"] is not None else None,
    ),
    ("pipeline bubble", f"{r['bubble_fraction']:.1%}", None),
    ("temp memory", _si(r.get("temp_memory_bytes"), "B"), None),
    ("peak memory (compiled)", _si(r.get("peak_memory_bytes"), "B"), None),
  ]
  if "device_peak_bytes_in_use" in r:
    rows.append(("device peak in use", _si(r["device_peak_bytes_in_use"], "B"), None))
  if peer:
    rows.append(("jaxformer / torch tokens/s", f"{r['jax_over_torch']:.2f}x", None))
  width = max(len(name) for name, _, _ in rows)
  lines = [f"{'':{width}}  {'jaxformer':>12}" + ("  torch" if peer else "")]
  for name, ours, theirs in rows:
    lines.append(f"{name:{width}}  {ours:>12}" + (f"  {theirs}" if theirs else ""))
  return "\n".join(lines)
