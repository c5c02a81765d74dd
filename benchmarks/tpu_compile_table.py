"""The table of benchmarks/results/2026-12-03-tpu-compile.md: `jaxformer compile --topology` of every
preset on TPU slices, by the real TPU compiler (libtpu, `pip install -e '.[aot]'`) on this CPU machine,
with a roofline step time and MFU from the compiler's cost analysis and the chips' published peaks.

One `jaxformer compile` process per cell (libtpu is loaded per process); each cell's JSON line is
appended to RESULTS (a cell already there is skipped, so an interrupted run resumes), then the
markdown table is printed. Run the cells one at a time: a large compile takes minutes and gigabytes.

  python benchmarks/tpu_compile_table.py [--results runs/tpu_compile.jsonl] [--only decoder_8b v5e-16] [--table]
  (rows with TPU flash attention, decoder_1b+splash and decoder_8b+splash, run only when named in --only)

Roofline (per device, from the compiled program): compute time = flops / the chip's peak bf16
flop/s; memory time = bytes accessed / the chip's HBM bandwidth; the step takes at least the larger
of the two (communication and overlap not counted). XLA's cost analysis counts a loop's body once,
and the presets scan their layers, so a preset is also compiled unscanned with 1 and 2 layers (same
mesh and batch, on the first slice where it fits): the difference is one layer's flops and bytes per
chip, added (layers - 1) times to the preset's figures on every slice with the same work per chip
(the same tokens per chip and tensor-parallel degree); other cells show the loop-once figures.
MFU = the model's flops per step (6 * params * tokens, plus attention 12 * layers * d_model * length
* tokens, the PaLM appendix B count; an encoder-decoder counts its source and target tokens) /
(chips * peak * roofline step time): the best MFU this program could reach. The compiler's flop count is
below the model's own, so compute time takes the larger of it and the flops the step must execute (the
model's, with the forward counted twice under `model.remat=full`: at most 75% MFU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# Chip peaks from Google's Cloud TPU pages (cloud.google.com/tpu/docs/v5e, /v5p, /v6e):
# bf16 dense flop/s per chip, HBM bandwidth bytes/s, HBM bytes.
CHIPS = {
  "v5e": {"flops": 197e12, "hbm_bw": 819e9, "hbm": 16 * 2**30},
  "v5p": {"flops": 459e12, "hbm_bw": 2765e9, "hbm": 95 * 2**30},
  "v6e": {"flops": 918e12, "hbm_bw": 1640e9, "hbm": 32 * 2**30},
}
# Slice name -> (topology for jax.experimental.topologies, chips). v5p-128 counts TensorCores: 64 chips.
SLICES = {
  "v5e-16": ("v5e:4x4", 16),
  "v5e-256": ("v5e:16x16", 256),
  "v5p-128": ("v5p:4x4x4", 64),
  "v6e-256": ("v6e:16x16", 256),
}
PRESETS = ("multi30k_base", "multi30k_big", "decoder_1b", "decoder_8b", "decoder_70b")
# Rows run only when named in --only: a preset with TPU flash attention (model.attention=splash).
SPLASH = ("decoder_1b+splash", "decoder_8b+splash")


def base(row_name: str) -> str:
  """The preset of a row name ("decoder_1b+splash" -> "decoder_1b")."""
  return row_name.split("+")[0]


# (fsdp, tensor) where the rule in `cell` gives sizes the slice's physical axes cannot form (each mesh axis must
# be a product of some of them: v5p 4x4x4 makes 4, 16 or 64; v6e 16x16 makes 16 or 256).
MESHES = {
  ("decoder_8b", "v6e-256"): (256, 1),
  ("decoder_70b", "v5p-128"): (16, 4),
  ("decoder_70b", "v6e-256"): (256, 1),
}


def cell(row_name: str, slice_name: str) -> list[str]:
  """The mesh and batch a user would choose: the paper's models data-parallel with 32 sentence pairs
  of 64 tokens per chip (layers scanned); the decoders one 2048-token sequence per data-parallel rank,
  fully sharded (fsdp) up to 64 ways (1B: 16), 70B also tensor-parallel over 8 chips from 64 chips
  (`MESHES` where the slice's physical axes need other sizes)."""
  preset, chips = base(row_name), SLICES[slice_name][1]
  if preset.startswith("multi30k"):
    return [f"mesh.data={chips}", "mesh.fsdp=1", f"train.batch_size={32 * chips}", "model.scan_layers=true"]
  fsdp = min(chips, 16 if preset == "decoder_1b" else 64)
  tensor = 8 if preset == "decoder_70b" and chips >= 64 else 1
  fsdp, tensor = MESHES.get((preset, slice_name), (min(fsdp, chips // tensor), tensor))
  data = chips // (fsdp * tensor)
  splash = ["model.attention=splash", "model.attention_block_size=512"] if row_name.endswith("+splash") else []
  return [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", f"train.batch_size={data * fsdp}", *splash]


def variant(preset: str, name: str) -> list[str]:
  """Overrides of a compile `name`: "preset" (as shipped) or "layers=1" / "layers=2" (unscanned)."""
  if name == "preset":
    return []
  n = name.split("=")[1]
  stacks = ["model.num_decoder_layers"] + (["model.num_encoder_layers"] if preset.startswith("multi30k") else [])
  return [*(f"{s}={n}" for s in stacks), "model.scan_layers=false"]


def run_cell(row_name: str, slice_name: str, name: str) -> dict:
  """Compiles one cell's variant `name` in its own process; its JSON line with the row, slice and
  command, or the error line."""
  topology = SLICES[slice_name][0]
  args = [
    sys.executable,
    "-m",
    "jaxformer",
    "compile",
    "--config",
    base(row_name),
    "--topology",
    topology,
    *cell(row_name, slice_name),
    *variant(base(row_name), name),
  ]
  proc = subprocess.run(args, capture_output=True, text=True, timeout=3600)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode or not lines:
    return {
      "config": base(row_name),
      "row": row_name,
      "slice": slice_name,
      "variant": name,
      "error": (proc.stderr.strip().splitlines() or ["?"])[-1],
    }
  return {
    **json.loads(lines[-1]),
    "row": row_name,
    "slice": slice_name,
    "variant": name,
    "command": " ".join(["jaxformer", *args[3:]]),
  }


def corrected(result: dict, layers: dict[str, dict]) -> tuple[float, float]:
  """The preset's (flops, bytes accessed) per device with its scanned layers all counted: plus
  (depth - 1) times the difference of the unscanned 2- and 1-layer compiles."""
  from jaxformer.cli.args import config_path
  from jaxformer.config import load_config

  depth = load_config(config_path(result["config"])).model.num_decoder_layers
  one, two = layers["layers=1"], layers["layers=2"]
  return tuple(result[k] + (depth - 1) * (two[k] - one[k]) for k in ("flops", "bytes_accessed"))


def model_flops(result: dict) -> float:
  """6 * params * tokens + 12 * layers * d_model * length * tokens per step (see the module docstring)."""
  from jaxformer.cli.args import config_path
  from jaxformer.config import load_config

  m = load_config(config_path(result["config"])).model
  length = result["length"]
  tokens = result["batch_size"] * length * (2 if m.kind == "encoder_decoder" else 1)
  layers = m.num_decoder_layers + (m.num_encoder_layers if m.kind == "encoder_decoder" else 0)
  return 6 * result["params"] * tokens + 12 * layers * m.d_model * length * tokens


def work(result: dict) -> tuple:
  """What a layer's per-chip flops and bytes depend on: the preset, tokens per chip, tensor degree."""
  return (
    result.get("row", result["config"]),
    result["batch_size"] * result["length"] / result["devices"],
    result["mesh"]["tensor"],
  )


def row(result: dict, layers: dict[str, dict]) -> str:
  """One markdown row: the preset's compile, with the roofline once its layer compiles are in `layers`."""
  if "error" in result:
    return f"| {result['config']} | {result['slice']} | | | error: {result['error'][:120]} | | | | | | |"
  chip = CHIPS[result["slice"].split("-")[0]]
  mesh = " ".join(f"{k}={v}" for k, v in result["mesh"].items() if v > 1)
  head = f"| {result.get('row', result['config'])} | {result['slice']} | {mesh} | {result['batch_size']} |"
  if not result["fits"]:
    return (
      f"{head} needs {result['required_bytes'] / 2**30:.2f} of {result['available_bytes'] / 2**30:.2f} "
      f"GiB ({result['required_for']}) | no | {result['compile_seconds']:.0f} | | | | |"
    )
  memory_cell = f"{head} {result['total_bytes_per_device'] / 2**30:.2f} GiB | yes | {result['compile_seconds']:.0f} |"
  if len(layers) < 2 or any("error" in r or not r["fits"] for r in layers.values()):
    return f"{memory_cell} {result['flops'] / 1e12:.2f} (loop once) | {result['bytes_accessed'] / 1e9:.1f} | | |"
  flops, accessed = corrected(result, layers)
  model = model_flops(result) / result["devices"]
  executed = max(flops, model * (4 / 3 if result["remat"] == "full" else 1))  # full remat: the forward twice
  compute, memory = executed / chip["flops"], accessed / chip["hbm_bw"]
  step = max(compute, memory)
  mfu = model / (chip["flops"] * step)
  return (
    f"{memory_cell} {flops / 1e12:.2f} | {accessed / 1e9:.1f} | {step * 1e3:.0f} "
    f"({'compute' if compute >= memory else 'memory'}) | {100 * mfu:.0f}% |"
  )


def table(results: list[dict]) -> str:
  """The markdown table of `results`, presets in order then slices."""
  lines = [
    "| config | slice | mesh | batch | memory / chip | fits | compile s | TFLOP / chip | GB accessed / chip "
    "| roofline step ms (bound) | roofline MFU |",
    "|---|---|---|---:|---:|:-:|---:|---:|---:|---:|---:|",
  ]
  presets, layers = {}, {}
  for r in results:
    if r.get("variant", "preset") == "preset":
      presets[r.get("row", r["config"]), r["slice"]] = r
    elif "error" not in r:
      layers.setdefault(work(r), {})[r["variant"]] = r
  for preset in PRESETS + SPLASH:
    for slice_name in SLICES:
      if (preset, slice_name) in presets:
        result = presets[preset, slice_name]
        lines.append(row(result, layers.get(work(result), {}) if "error" not in result else {}))
  return "\n".join(lines)


def main() -> None:
  """Runs the missing compiles (all cells, or `--only` presets/slices), then prints the table."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--results", default="runs/tpu_compile.jsonl")
  p.add_argument(
    "--only", nargs="*", default=(), help="rows and/or slices to run (default: every preset on every slice)"
  )
  p.add_argument("--table", action="store_true", help="print the table of the results so far, compile nothing")
  args = p.parse_args()
  path = Path(args.results)
  path.parent.mkdir(parents=True, exist_ok=True)
  results = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

  def record(preset: str, slice_name: str, name: str) -> dict:
    print(f"== {preset} on {slice_name} ({name}): {' '.join(cell(preset, slice_name))}", file=sys.stderr, flush=True)
    result = run_cell(preset, slice_name, name)
    results.append(result)
    with path.open("a") as f:
      f.write(json.dumps(result) + "\n")
    return result

  for preset in PRESETS + SPLASH:
    for slice_name in SLICES:
      rows = set(args.only) & set(PRESETS + SPLASH) or set(PRESETS)  # named rows (splash ones only so)
      slices = set(args.only) & set(SLICES) or set(SLICES)
      if args.table or preset not in rows or slice_name not in slices:
        continue
      done = {
        r.get("variant", "preset"): r
        for r in results
        if (r.get("row", r["config"]), r["slice"]) == (preset, slice_name)
      }
      result = done.get("preset") or record(preset, slice_name, "preset")
      if "error" in result or not result["fits"]:
        continue  # no roofline for a program that does not fit
      measured = {work(r) for r in results if r.get("variant") == "layers=2" and "error" not in r}
      if work(result) not in measured:
        for name in ("layers=1", "layers=2"):
          if name not in done:
            record(preset, slice_name, name)
  print(table(results))


if __name__ == "__main__":
  main()
