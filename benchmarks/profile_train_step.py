"""Where a train step's time goes on the CPU, from the JAX profiler and XLA's own HLO.

The compiled step (`jaxformer bench`'s, on a fixed synthetic batch) runs under
`jax.profiler.trace`; XLA:CPU records one event per executed thunk, named by its HLO
instruction. Each instruction of the compiled module (`compiled.as_text()`) is put in a group:
matmuls (a dot, or a fusion around one), then by the name scope of its `op_name` (the root op's,
for a fusion): attention (scores, mask, softmax), layer norm, FFN bias and activation, loss,
optimizer (the `optimizer` scope: clipping, AdamW, the schedule) and the rest (embedding,
residual adds, the step's finiteness norms). A group's time is the sum of its thunks' times;
the host's share is the wall time of the calls not covered by any thunk (dispatch, argument
handling, gaps between thunks); the profiler's own event per thunk slows the step (the table gives
the medians with and without it), so that row is an upper bound and the groups' shares of the
thunk time are the figures to read. They add up where the thunks run one after another on the
calling thread, as in the character LM's step; where XLA runs large matmuls asynchronously on
Eigen's pool (`multi30k_small` at batch 64) a thunk's event ends before its work does, and the
script says so. Matmul FLOP/s are the model's matmul FLOPs per step
(`bench.flops`) over the matmul time, against the float32 matmul peak measured in the same run.

    PYTHONPATH=. python benchmarks/profile_train_step.py --config configs/shakespeare_char.yaml
      --batch-size 12 --length 64 model.vocab_size=66   (one line)

Prints a table, then one JSON line. `runtime.deterministic` (the CLI's default mode) applies.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import statistics
import tempfile
import time

GROUPS = ("matmuls", "attention", "layer norm", "FFN bias + activation", "loss", "optimizer", "other ops")
# op_name scope -> group, first match wins (matmuls are found by opcode before these).
SCOPES = (
  (r"/optimizer/|/optimizer\)", "optimizer"),
  (r"/loss/|\(loss\)", "loss"),
  (r"norm/", "layer norm"),
  (r"self_attention|cross_attention", "attention"),
  (r"/ffn/", "FFN bias + activation"),
)
CONTROL_FLOW = ("while", "conditional", "call")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"[\]}\)] ([a-z][\w\-]*)\(")


def instruction_groups(hlo_text: str) -> dict[str, str | None]:
  """HLO instruction name -> group (`GROUPS`) for every instruction of a compiled module's text;
  None for control flow (`CONTROL_FLOW`), whose thunk events span those of the computations
  they run."""
  computations: dict[str, list[tuple[str, str, str, str]]] = collections.defaultdict(list)
  current = ""
  for line in hlo_text.splitlines():
    if m := _COMPUTATION.match(line):
      current = m.group(1)
    elif m := _INSTRUCTION.match(line):
      opcode = _OPCODE.search(m.group(2))
      op_name = re.search(r'op_name="([^"]*)"', m.group(2))
      calls = re.search(r"calls=%([\w.\-]+)", m.group(2))
      computations[current].append(
        (
          m.group(1),
          opcode.group(1) if opcode else "",
          op_name.group(1) if op_name else "",
          calls.group(1) if calls else "",
        )
      )
  has_dot = {name for name, rows in computations.items() if any(row[1] in ("dot", "convolution") for row in rows)}
  groups = {}
  for rows in computations.values():
    for name, opcode, op_name, called in rows:
      if opcode in CONTROL_FLOW:
        groups[name] = None
      elif opcode in ("dot", "convolution") or called in has_dot:
        groups[name] = "matmuls"
      else:
        groups[name] = next((g for pattern, g in SCOPES if re.search(pattern, op_name)), "other ops")
  return groups


def thunk_events(xspace_path: str) -> list[tuple[str, int, int]]:
  """(HLO instruction, start ns, duration ns) of every thunk event in a profile, on any thread.
  An event spans the thunk's `Execute` call: a thunk that completes asynchronously (a large
  matmul split over Eigen's pool) runs on past it, which `main` detects by a matmul rate above
  the measured peak."""
  import jax

  data = jax.profiler.ProfileData.from_file(xspace_path)
  events = []
  for plane in data.planes:
    for line in plane.lines:
      for e in line.events:
        name = dict(e.stats).get("hlo_op")
        if name:
          events.append((name, int(e.start_ns), int(e.duration_ns)))
  return events


def union_ns(intervals: list[tuple[int, int]]) -> int:
  """Total length of the union of (start, duration) intervals."""
  total, end = 0, None
  for start, duration in sorted(intervals):
    stop = start + duration
    if end is None or start > end:
      total += duration
      end = stop
    elif stop > end:
      total += stop - end
      end = stop
  return total


def main() -> None:
  """Profiles the step of `--config` and prints the table and the JSON line."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="configs/shakespeare_char.yaml")
  parser.add_argument("--batch-size", type=int, default=None, help="default: train.batch_size")
  parser.add_argument(
    "--length", type=int, default=None, help="tokens per row (source and target); default: data.max_length"
  )
  parser.add_argument("--calls", type=int, default=20, help="profiled calls, after 3 warm-up calls")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()

  from jaxformer.config import load_config
  from jaxformer.runtime.startup import init_runtime

  config = load_config(args.config, args.overrides)
  init_runtime(config.runtime)
  import jax
  import numpy as np

  from jaxformer import sharding as sh
  from jaxformer.bench.flops import measure_matmul_peak, train_flops_per_step
  from jaxformer.bench.step import BenchOptions, prepare_step, synthetic_batch
  from jaxformer.data import global_batch

  length = args.length or config.data.max_length
  batch_size = args.batch_size or config.train.batch_size
  options = BenchOptions(batch_size, src_length=length, tgt_length=length).validate(config.model)
  prepared = prepare_step(config, options)
  config, mesh = prepared.config, prepared.mesh
  compiled = prepared.lowered.compile()
  # A thunk named after no instruction of the text (a runtime helper) counts as "other ops".
  groups = collections.defaultdict(lambda: "other ops", instruction_groups(compiled.as_text()))
  k = config.train.steps_per_call
  host = synthetic_batch(batch_size, options.src_length, options.tgt_length, config.model.vocab_size)
  host = {name: np.stack([a] * k) for name, a in host.items()} if k > 1 else host
  batch = global_batch(host, mesh, sh.rules_for(config.mesh))
  state, rng = prepared.create_state(), jax.random.key(0)

  def call() -> float:
    nonlocal state
    start = time.perf_counter()
    state, metrics = compiled(state, batch, rng)
    jax.block_until_ready(metrics)
    return time.perf_counter() - start

  for _ in range(3):
    call()
  plain = [call() / k for _ in range(args.calls)]
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      profiled = [call() / k for _ in range(args.calls)]
    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    events = [e for e in thunk_events(path) if groups[e[0]] is not None]
  steps = args.calls * k
  by_group = collections.Counter()
  for name, _, duration in events:
    by_group[groups[name]] += duration / 1e9 / steps
  busy = union_ns([(s, d) for _, s, d in events]) / 1e9 / steps
  wall = statistics.median(profiled)
  flops = train_flops_per_step(config.model, batch_size, options.src_length, options.tgt_length)
  peak = measure_matmul_peak()
  matmul_rate = flops / by_group["matmuls"] if by_group["matmuls"] else None
  thunk_total = sum(by_group.values())

  print(f"{config.name}: batch {batch_size} x {length} tokens, {k} step(s) per call, mesh {dict(mesh.shape)}")
  unprofiled = statistics.median(plain)
  print(f"step: {unprofiled * 1e3:.2f} ms unprofiled, {wall * 1e3:.2f} ms profiled (medians of {args.calls} calls)")
  print(f"{'group':<24}{'ms/step':>9}{'of thunks':>11}{'of step':>9}")
  for g in GROUPS:
    print(f"{g:<24}{by_group[g] * 1e3:>9.2f}{by_group[g] / thunk_total:>11.1%}{by_group[g] / wall:>9.1%}")
  print(f"{'host and gaps (upper)':<24}{(wall - busy) * 1e3:>9.2f}{'':>11}{(wall - busy) / wall:>9.1%}")
  print(
    f"thunk time {thunk_total * 1e3:.2f} ms over {busy * 1e3:.2f} ms busy (threads overlap where the sum exceeds it)"
  )
  if matmul_rate and matmul_rate > peak:
    print(
      "warning: the matmuls ran above the measured peak, so some ran asynchronously past their thunk "
      "events: the groups' times and the host row do not add up to this step's time"
    )
  if matmul_rate:
    print(
      f"matmuls: {flops / 1e9:.3f} GFLOP per step at {matmul_rate / 1e9:.0f} GFLOP/s, "
      f"{matmul_rate / peak:.0%} of the measured peak {peak / 1e9:.0f} GFLOP/s"
    )
  by_thunk = collections.Counter()
  for name, _, duration in events:
    by_thunk[name] += duration / 1e9 / steps
  for g in GROUPS:
    top = [(n, t) for n, t in by_thunk.most_common() if groups[n] == g][:4]
    print(f"slowest {g} thunks (ms/step):", ", ".join(f"{n} {t * 1e3:.2f}" for n, t in top))
  print(
    json.dumps(
      {
        "config": config.name,
        "batch_size": batch_size,
        "length": length,
        "steps_per_call": k,
        "step_ms": unprofiled * 1e3,
        "profiled_step_ms": wall * 1e3,
        "groups_ms": {g: by_group[g] * 1e3 for g in GROUPS},
        "host_and_gaps_ms": (wall - busy) * 1e3,
        "busy_ms": busy * 1e3,
        "matmul_gflops_per_step": flops / 1e9,
        "matmul_gflop_per_s": matmul_rate / 1e9 if matmul_rate else None,
        "peak_gflop_per_s": peak / 1e9,
        "deterministic": config.runtime.deterministic,
      }
    )
  )


if __name__ == "__main__":
  main()
