"""Peak memory of reading a Hugging Face checkpoint through `jaxformer.interop.hf_weights`, and of
the whole `jaxformer import` of it.

Has transformers write a random bfloat16 `LlamaForCausalLM` of `configs/decoder_1b.yaml`'s shape
(about 1.24B parameters, 2.5 GB of safetensors) into a temporary directory, in one subprocess;
then, in a fresh subprocess, reads every tensor with `HFWeights.get` one at a time (each widened
to float32, then dropped) and prints one JSON line: the peak RSS of that process
(`ru_maxrss`), its RSS before reading, the file size, the largest tensor in float32, the
number of tensors and the seconds taken. Then, in another fresh subprocess, runs `jaxformer
import --from-hf` of that directory into a new workdir (each tensor read, mapped to our params and
checked by mapping it back, one at a time; the params written as an Orbax checkpoint of their own)
and adds that process's peak RSS and
seconds, the peak of each stage (sampled every 10 ms: "start", reading the config and opening the
files; "convert", the params read, converted and checked one tensor at a time; "params_held", the
RSS once they are all built; "write", the tokenizer, run files and Orbax checkpoint) and the peak
over the model's float32 params. Needs about 8 GB of free space in the temporary directory and
about 6 GB of memory.

  python benchmarks/import_peak_rss.py [--config configs/decoder_1b.yaml] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WRITE = """
import sys, torch, transformers, yaml
m = yaml.safe_load(open(sys.argv[1]))["model"]
config = transformers.LlamaConfig(
    vocab_size=m["vocab_size"], hidden_size=m["d_model"], intermediate_size=m["d_ff"],
    num_hidden_layers=m["num_decoder_layers"], num_attention_heads=m["num_heads"],
    num_key_value_heads=m.get("num_kv_heads") or m["num_heads"], max_position_embeddings=m["max_length"],
    tie_word_embeddings=m.get("tie_embeddings", False), rms_norm_eps=1e-5)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[2])
import tokenizers   # a tokenizer too (import needs one): three tokens suffice for measuring memory
words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>",
                                     eos_token="</s>").save_pretrained(sys.argv[2])
print(sum(p.numel() for p in model.parameters()))
"""

READ = """
import json, os, resource, sys, time
from jaxformer.interop.hf_weights import HFWeights
def rss_mib():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before = rss_mib()
start = time.perf_counter()
largest = 0
with HFWeights(sys.argv[1], "model") as weights:
  for name in weights.names():
    array = weights.get(name)
    largest = max(largest, array.nbytes)
    del array
  count = len(weights)
seconds = time.perf_counter() - start
files = [p for p in os.listdir(sys.argv[1]) if p.endswith(".safetensors")]
print(json.dumps({
    "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    "rss_before_reading_mib": round(before, 1),
    "file_mib": round(sum(os.path.getsize(os.path.join(sys.argv[1], p)) for p in files) / 2**20, 1),
    "largest_tensor_float32_mib": round(largest / 2**20, 1), "tensors": count, "read_seconds": round(seconds, 1)}))
"""

IMPORT = """
import json, os, resource, sys, threading, time
from jaxformer.cli import main
from jaxformer.interop import hf_import
def rss_mib():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
stage, peaks = ["start"], {}
def watch():   # each stage's peak RSS, sampled every 10 ms (ru_maxrss is the exact peak of the whole)
  while True:
    peaks[stage[0]] = max(peaks.get(stage[0], 0.0), rss_mib())
    time.sleep(0.01)
threading.Thread(target=watch, daemon=True).start()
convert = hf_import.params_from_hf
def params_from_hf(*args):
  stage[0] = "convert"
  params = convert(*args)
  peaks["params_held"] = rss_mib()
  stage[0] = "write"
  return params
hf_import.params_from_hf = params_from_hf
start = time.perf_counter()
status = main(["import", "--from-hf", sys.argv[1], "--workdir", sys.argv[2]])
print(json.dumps({"import_status": status, "import_seconds": round(time.perf_counter() - start, 1),
                  "import_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  "import_rss_mib": {k: round(v, 1) for k, v in peaks.items()}}))
"""


def main() -> None:
  """Writes the checkpoint, reads it and imports it in fresh processes, prints one JSON line."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default=str(ROOT / "configs" / "decoder_1b.yaml"))
  parser.add_argument("--keep", help="write the checkpoint here and keep it (default: a removed temporary directory)")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory(prefix="jaxformer-rss-") as tmp:
    out = Path(args.keep or tmp) / "hf"
    params = subprocess.run(
      [sys.executable, "-c", WRITE, args.config, str(out)], check=True, capture_output=True, text=True
    ).stdout.split()[-1]
    line = (
      subprocess.run([sys.executable, "-c", READ, str(out)], check=True, capture_output=True, text=True, cwd=ROOT)
      .stdout.strip()
      .splitlines()[-1]
    )
    run = subprocess.run(
      [sys.executable, "-c", IMPORT, str(out), str(Path(tmp) / "run")],
      check=True,
      capture_output=True,
      text=True,
      cwd=ROOT,
    )
    imported = json.loads(run.stdout.strip().splitlines()[-1])
    if imported["import_status"]:
      imported["import_error"] = run.stderr.strip().splitlines()[-1]
  fp32 = int(params) * 4 / 2**20
  if "import_peak_rss_mib" in imported:
    imported["import_peak_over_float32_params"] = round(imported["import_peak_rss_mib"] / fp32, 2)
  print(
    json.dumps(
      {
        "config": args.config,
        "parameters": int(params),
        "float32_params_mib": round(fp32, 1),
        "dtype": "bfloat16",
        **json.loads(line),
        **imported,
      }
    )
  )


if __name__ == "__main__":
  main()
