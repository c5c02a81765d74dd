"""The weights of a local Hugging Face model directory, read from safetensors one tensor at a time.

`HFWeights(hf_dir, prefix)` lists the tensors of `model.safetensors`, or of the shards a
`model.safetensors.index.json` names, and reads each on request as a float32 numpy array
(`get`, or `weights[name]`), so a converter holds one tensor at a time rather than a whole
torch model. F32, F16 and BF16 files are read (BF16 widened exactly: its bits are a float32's
upper half); each tensor is read from disk in chunks straight into its float32 array, so
reading needs about one float32 tensor of memory beyond what the caller keeps. The files are checked with the
`safetensors` library when opened: a truncated or corrupt file is refused in one line.

Names are those of the architecture's `state_dict()`: files saved from a base model (GPT-2's
hub files hold `h.0.attn.c_attn.weight`, not `transformer.h.0...`) get the architecture's
`base_model_prefix` (transformers' `PreTrainedModel.base_model_prefix`, the caller's argument).
Old LayerNorm names (`LayerNorm.gamma`/`beta`, as in BERT's hub files) become `weight`/`bias`, as
transformers renames them on load. Buffers that are not weights (GPT-2's causal masks,
`position_ids`, rotary `inv_freq`) are left out. A tied checkpoint written by transformers
leaves out the tied copy (`lm_head.weight`): what the files hold is what is listed.

A directory with only `pytorch_model.bin` (or its sharded index) is converted to safetensors
with torch, when torch is importable, into a temporary directory (never the model's own),
removed by `close()` (or the `with` block's end).
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxformer.config import ConfigError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
# Buffers some checkpoints hold that are not weights: GPT-2's causal-mask buffers, position ids, rotary frequencies.
BUFFERS = (".attn.bias", ".attn.masked_bias", ".position_ids", ".rotary_emb.inv_freq")
# Old names transformers renames on load in every model (BERT's hub files: `LayerNorm.gamma`).
LEGACY = (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))
# safetensors dtype -> the little-endian numpy dtype its bytes are read as (BF16: as uint16 bit patterns).
DTYPES = {
  "F64": "<f8",
  "F32": "<f4",
  "F16": "<f2",
  "BF16": "<u2",
  "I64": "<i8",
  "I32": "<i4",
  "I16": "<i2",
  "I8": "i1",
  "U8": "u1",
  "BOOL": "?",
}
CHUNK = 1 << 24  # elements read from disk at a time


@dataclass(frozen=True)
class _Entry:
  """Where one tensor's bytes lie: `file`, from byte `start` (absolute), `dtype` (safetensors') and `shape`."""

  file: Path
  start: int
  dtype: str
  shape: tuple[int, ...]


class HFWeights:
  """The tensors of a Hugging Face directory, read lazily by name (see the module docstring).

  Args:
    hf_dir: a local Hugging Face model directory (`config.json` and its weight files).
    prefix: the architecture's `base_model_prefix` ("transformer" for GPT-2, "model" for Llama,
      "" for none), added to every name when no name starts with it (a base model's files).
    drop: name endings left out (buffers that are not weights).

  Raises:
    ConfigError: no `config.json`, no weight files, an index naming a missing shard, a truncated
      or corrupt file, a dtype other than float and integer ones, or a `pytorch_model.bin` without torch.
  """

  def __init__(self, hf_dir: str | Path, prefix: str = "", drop: tuple[str, ...] = BUFFERS):
    self.hf_dir = Path(hf_dir)
    self._tmp: Path | None = None
    self._cleanup = None
    if not (self.hf_dir / "config.json").is_file():
      raise ConfigError(
        f"{self.hf_dir / 'config.json'} is missing; --from-hf takes a local Hugging Face model directory"
      )
    entries: dict[str, _Entry] = {}
    try:
      for file in self._safetensors_files():
        for name, entry in _read_header(file).items():
          for old, new in LEGACY:
            name = name.replace(old, new)
          if name in entries:
            raise ConfigError(f"{name} is in both {entries[name].file.name} and {file.name}; download the model again")
          entries[name] = entry
    except BaseException:
      self.close()
      raise
    if prefix and not any(name.startswith(prefix + ".") for name in entries):
      entries = {f"{prefix}.{name}": entry for name, entry in entries.items()}
    self._entries = {name: e for name, e in entries.items() if not name.endswith(drop)}

  def names(self) -> list[str]:
    """The tensor names, in the files' order."""
    return list(self._entries)

  def __contains__(self, name: object) -> bool:
    return name in self._entries

  def __len__(self) -> int:
    return len(self._entries)

  def __iter__(self) -> Iterator[str]:
    return iter(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    """`name`'s shape, without reading it."""
    return self._entries[name].shape

  def dtype(self, name: str) -> str:
    """`name`'s dtype in the file, as safetensors names it (`F32`, `F16`, `BF16`, ...)."""
    return self._entries[name].dtype

  def get(self, name: str) -> np.ndarray:
    """`name` as a float32 numpy array (a new array the caller owns).

    Raises:
      KeyError: no tensor `name`.
      ConfigError: the file ends before the tensor does (changed since it was opened).
    """
    entry = self._entries[name]
    count = int(np.prod(entry.shape, dtype=np.int64))
    out = np.empty(count, np.float32)
    bits = out.view(np.uint32)
    with open(entry.file, "rb") as f:
      f.seek(entry.start)
      for i in range(0, count, CHUNK):
        part = np.fromfile(f, dtype=DTYPES[entry.dtype], count=min(CHUNK, count - i))
        if part.size != min(CHUNK, count - i):
          raise ConfigError(f"{entry.file} ends inside {name}; the file is truncated: download it again")
        if entry.dtype == "BF16":
          bits[i : i + part.size] = part
          bits[i : i + part.size] <<= 16  # a bfloat16 is the upper 16 bits of the float32 of the same value
        else:
          out[i : i + part.size] = part
    return out.reshape(entry.shape)

  def __getitem__(self, name: str) -> np.ndarray:
    return self.get(name)  # read on each call: a new array

  def items(self) -> Iterator[tuple[str, np.ndarray]]:
    """`(name, float32 array)` for every tensor, read one at a time."""
    for name in self._entries:
      yield name, self.get(name)

  def close(self) -> None:
    """Removes the temporary safetensors a `pytorch_model.bin` was converted to (if any)."""
    if self._cleanup is not None:
      self._cleanup()

  def __enter__(self) -> HFWeights:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _safetensors_files(self) -> list[Path]:
    """The safetensors files holding the directory's weights (converting `pytorch_model.bin` if that is all)."""
    d = self.hf_dir
    if (d / SAFETENSORS).is_file():
      return [d / SAFETENSORS]
    if (d / SAFETENSORS_INDEX).is_file():
      return _shards(d / SAFETENSORS_INDEX)
    if (d / TORCH_BIN).is_file() or (d / TORCH_BIN_INDEX).is_file():
      bins = [d / TORCH_BIN] if (d / TORCH_BIN).is_file() else _shards(d / TORCH_BIN_INDEX)
      return self._convert(bins)
    raise ConfigError(
      f"{d} holds no weights ({SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_BIN}); download the "
      "model's weight files into it"
    )

  def _convert(self, bins: list[Path]) -> list[Path]:
    """`bins` (torch pickles of state dicts) as safetensors files in a temporary directory."""
    try:
      import torch  # noqa: PLC0415
      from safetensors.torch import save_file  # noqa: PLC0415
    except ImportError:
      raise ConfigError(
        f"{self.hf_dir} holds only {TORCH_BIN}, which needs torch to read: pip install "
        '"jaxformer[hf]", or convert it with transformers\' save_pretrained(safe_serialization=True)'
      ) from None
    self._tmp = Path(tempfile.mkdtemp(prefix="jaxformer-hf-"))
    self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._tmp), True)
    out = []
    for k, path in enumerate(bins):
      try:
        state = torch.load(path, map_location="cpu", weights_only=True)
      except Exception as e:  # a truncated zip, a bad pickle, a non-tensor object
        raise ConfigError(f"{path} cannot be read as a torch state dict ({_one_line(e)}); download it again") from None
      if not isinstance(state, dict):
        raise ConfigError(f"{path} holds a {type(state).__name__}, not a state dict; download it again")
      seen: set[int] = set()
      tensors = {}
      for name, value in state.items():
        if not isinstance(value, torch.Tensor):
          raise ConfigError(f"{path} holds {name}, which is not a tensor; download it again")
        value = value.detach().contiguous()
        if value.untyped_storage().data_ptr() in seen:  # tied: safetensors refuses shared storage, so copy it
          value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        tensors[name] = value
      out.append(self._tmp / f"converted-{k:05d}.safetensors")
      save_file(tensors, str(out[-1]), metadata={"format": "pt"})
      del state, tensors
    return out


def _one_line(e: BaseException) -> str:
  """`e`'s message on one line (its first 200 characters)."""
  text = " ".join(str(e).split()) or type(e).__name__
  return text if len(text) <= 200 else text[:197] + "..."


def _shards(index: Path) -> list[Path]:
  """The shard files `index` (a `*.index.json` with a `weight_map`) names, in order, each checked to exist."""
  try:
    weight_map = json.loads(index.read_text())["weight_map"]
    names = sorted(set(weight_map.values()))
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ConfigError(f"{index} is not a valid index ({_one_line(e)}); download it again") from None
  for name in names:
    if not (index.parent / name).is_file():
      raise ConfigError(f"{index.name} names {name}, which is missing from {index.parent}; download every shard")
  return [index.parent / name for name in names]


def _read_header(file: Path) -> dict[str, _Entry]:
  """The tensors of the safetensors `file`, checked whole by the safetensors library.

  Raises:
    ConfigError: the file is truncated or corrupt, or holds a dtype with no float32 reading.
  """
  from safetensors import SafetensorError, safe_open  # noqa: PLC0415

  try:
    with safe_open(str(file), framework="numpy"):  # validates the header against the file's size
      pass
  except (SafetensorError, OSError) as e:
    raise ConfigError(f"{file} is truncated or corrupt ({_one_line(e)}); download it again") from None
  with open(file, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
  header.pop("__metadata__", None)
  entries = {}
  for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
    if info["dtype"] not in DTYPES:
      raise ConfigError(
        f"{file} holds {name} as {info['dtype']}; jaxformer reads F32, F16 and BF16 checkpoints (dequantize it first)"
      )
    entries[name] = _Entry(file, 8 + size + info["data_offsets"][0], info["dtype"], tuple(info["shape"]))
  return entries
