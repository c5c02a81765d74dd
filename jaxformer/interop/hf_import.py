"""`jaxformer import --from-hf DIR --workdir NEW`: a local Hugging Face directory of a supported
architecture (see `hf_export`) as a jaxformer workdir that `eval`, `translate`, `generate`
and `train` (fine-tuning) read.

The workdir holds `config.yaml` (the exporting run's config when `config.json` carries it,
else the architecture's options and special ids on the default config: set the data keys when
training), `tokenizer.model` (the directory's SentencePiece model, or for a published model its
own tokenizer, whose files are also copied to `hf_tokenizer/`, which `data.tokenizer_model`
names, with `data.tokenizer=hf` for a `tokenizer.json`, `marian` for Marian's SentencePiece pair
and `vocab.json`; a Marian source side is also `source_tokenizer.model`), `imported.json` (where
from) and one checkpoint at step 0: the imported params alone (training adds a fresh optimizer state), so
`jaxformer train --config NEW/config.yaml --workdir NEW` continues from them. Every imported
tensor is checked by mapping the params back: a checkpoint holding anything our model has no
counterpart for (a nonzero attention bias, another LM-head transform) is refused in one line.
Nothing downloads. Memory stays near one float32 copy of the params: each tensor is read,
converted and checked before the next (`links.from_hf_checked`), and the checkpoint is written
without Orbax's copies (`checkpoint.manager.save_host_params`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.config import Config, ConfigError, DataConfig, config_from_dict, dump_config
from jaxformer.data.tokenizer_hf import SPM_FILES
from jaxformer.interop import links as L
from jaxformer.interop.hf_export import CONFIG_KEY, MAPPINGS
from jaxformer.interop.hf_tokenizer import load_tokenizer

IMPORT_FILE = "imported.json"
TOKENIZER_DIR = "hf_tokenizer"  # a published model's own tokenizer files, which data.tokenizer_model names
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "source.spm",
  "target.spm",
  "vocab.json",
)
TOKENIZER_SIGNS = ("tokenizer.json", *SPM_FILES, "source.spm")  # one of them: the directory has a tokenizer
OWN_TOKENIZERS = ("hf", "marian")  # data.tokenizer values naming a published model's own tokenizer files


def open_hf(hf_dir: str | Path) -> tuple[Config, Any]:
  """Our config and the tensors of a Hugging Face directory, unread: an `hf_weights.HFWeights`
  (close it, or use it in a `with` block) that reads each as float32 on request, named as the
  architecture's `state_dict()` names them; no torch model is built. They are what the files
  hold: a tied checkpoint written by transformers has no `lm_head.weight`.

  Raises:
    ConfigError: not a directory with `config.json`, an architecture with no mapping, or weight
      files that are missing, truncated or corrupt (see `hf_weights.HFWeights`).
    ValueError: options of the architecture jaxformer has no counterpart for.
  """
  import transformers  # noqa: PLC0415

  from jaxformer.interop.hf_weights import HFWeights  # noqa: PLC0415

  path = Path(hf_dir) / "config.json"
  if not path.is_file():
    raise ConfigError(f"{path} is missing; --from-hf takes a local Hugging Face model directory")
  raw = json.loads(path.read_text())
  by_type = {m.MODEL_TYPE: m for m in MAPPINGS}
  mapping = by_type.get(raw.get("model_type"))
  if mapping is None:
    raise ConfigError(
      f"{hf_dir} holds a {raw.get('model_type')!r} model; import supports {', '.join(m.ARCHITECTURE for m in MAPPINGS)}"
    )
  hf_config = transformers.AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
  config = config_from_dict(raw[CONFIG_KEY]) if CONFIG_KEY in raw else published_config(hf_dir, mapping, hf_config)
  prefix = getattr(mapping, "BASE_MODEL_PREFIX", None)  # T5's names are not under its base_model_prefix
  if prefix is None:
    prefix = getattr(transformers, mapping.ARCHITECTURE).base_model_prefix  # a class attribute: no model built
  return config, HFWeights(hf_dir, prefix)


def read_hf(hf_dir: str | Path) -> tuple[Config, dict[str, np.ndarray]]:
  """Our config and the float32 state dict (`{name: numpy array}`) of a Hugging Face directory:
  `open_hf`'s tensors, all read (import itself reads them one at a time instead).

  Raises:
    ConfigError, ValueError: as `open_hf`.
  """
  config, weights = open_hf(hf_dir)
  with weights:
    return config, dict(weights.items())


def _first(token_id: Any) -> int | None:
  """A config's token id (Llama 3 lists several EOS ids: the first is the one generation ends with)."""
  return token_id[0] if isinstance(token_id, list) and token_id else (None if isinstance(token_id, list) else token_id)


def special_ids(hf_config, tokenizer) -> dict[str, int]:
  """`model.*_id` fields of a published model: bos and eos from its config (else its tokenizer's),
  pad from its config only (-1 when absent or equal to eos, so EOS targets keep their loss), [MASK]
  from its tokenizer, the decoder start of an encoder-decoder from `decoder_start_token_id` (-1: bos; a
  bos equal to eos is then none: Marian's configs name EOS as BOS)."""
  ids = tokenizer.special_ids if tokenizer is not None else None
  vocab = getattr(hf_config, "vocab_size", None) or 0

  def config_id(name: str) -> int | None:  # an id past the vocabulary (GPT-2's 50256 in a small model) is none
    value = _first(getattr(hf_config, name, None))
    return -1 if value is not None and vocab and not 0 <= value < vocab else value

  bos, eos = config_id("bos_token_id"), config_id("eos_token_id")
  out = {
    "bos_id": bos if bos is not None else (ids.bos if ids else -1),
    "eos_id": eos if eos is not None else (ids.eos if ids else -1),
  }
  pad = config_id("pad_token_id")
  out["pad_id"] = -1 if pad is None or pad == out["eos_id"] else pad
  if ids is not None and ids.mask >= 0:  # a masked LM's [MASK] is the tokenizer's own token
    out["mask_id"] = ids.mask
  start = getattr(hf_config, "decoder_start_token_id", None)
  if getattr(hf_config, "is_encoder_decoder", False) and start is not None:
    out["decoder_start_id"] = start
    if out["bos_id"] == out["eos_id"]:
      out["bos_id"] = -1
  return out


def own_tokenizer(kind: str, folder: str | Path, side: str = "target"):
  """A published model's own tokenizer in `folder`: an `HFTokenizer` (`kind` "hf") or, for "marian", the
  `MarianTokenizer` of `side`.

  Raises:
    FileNotFoundError, ValueError: missing or invalid tokenizer files (one line).
  """
  if kind == "marian":
    from jaxformer.data.tokenizer_marian import MarianTokenizer  # noqa: PLC0415

    return MarianTokenizer.load(folder, side)
  from jaxformer.data.tokenizer_hf import HFTokenizer  # noqa: PLC0415

  return HFTokenizer.load(folder)


def published_config(hf_dir: str | Path, mapping, hf_config) -> Config:
  """The run config of a published model (no jaxformer config inside): the architecture's options,
  its special ids, and its own tokenizer (on the directory): `data.tokenizer=hf` when it has a
  `tokenizer.json` or only a SentencePiece model (T5's `spiece.model`, converted), `marian` when
  it has Marian's `source.spm`, `target.spm` and `vocab.json`.

  Raises:
    ValueError: options without a counterpart, or tokenizer files that do not load (one line).
  """
  from jaxformer.data.tokenizer_hf import slow_model  # noqa: PLC0415
  from jaxformer.data.tokenizer_marian import is_marian_dir  # noqa: PLC0415

  hf_dir = Path(hf_dir).absolute()
  kind = (
    "hf"
    if (hf_dir / "tokenizer.json").is_file() or slow_model(hf_dir) is not None
    else ("marian" if is_marian_dir(hf_dir) else None)
  )
  tokenizer = own_tokenizer(kind, hf_dir) if kind else None
  model = {**mapping.model_config(hf_config), **special_ids(hf_config, tokenizer)}
  length = min(DataConfig.max_length, model["max_length"])
  buckets = [b for b in DataConfig.buckets if b < length] + [length]
  data = {"max_length": length, "buckets": buckets}
  if tokenizer is not None:
    data.update(tokenizer=kind, tokenizer_model=str(hf_dir))
  return config_from_dict({"name": hf_dir.name, "model": model, "data": data})


def params_from_hf(config: Config, tensors: Any) -> dict[str, Any]:
  """Our params (nested dict of float32 numpy arrays, the config's layer layout) from a Hugging
  Face state dict, checked by mapping them back (see the module docstring). `tensors`: a dict
  (`read_hf`'s) or `open_hf`'s `HFWeights`, read one tensor at a time, so memory stays near one
  float32 copy of the params (`links.from_hf_checked`; a scanned layout's stacks are filled as
  each layer's tensor is read).

  Raises:
    ValueError: a tensor is missing or holds what our model cannot express (one line).
  """
  from jaxformer.interop.hf_export import select_mapping  # noqa: PLC0415

  links, consts = select_mapping(config).links(config.model)
  out = None
  if config.model.scan_layers:
    from jaxformer.tasks import get_task  # noqa: PLC0415

    paths = {p for link in links if link.from_hf is not None for p in link.ours}
    out = _ScannedParams(get_task(config).make_model(), paths)
  return L.unflatten(L.from_hf_checked(links, consts, tensors, config.model.kind, out))


class _Slot:
  """A param's place in the scanned layout: its path there, and its layer when it is one layer's
  slice of a stack (`models.layout.unstack_layers` indexes each stacked leaf per layer)."""

  def __init__(self, path: str, layer: int | None = None):
    self.path, self.layer = path, layer

  def __getitem__(self, layer: int) -> _Slot:
    return _Slot(self.path, layer)


class _ScannedParams:
  """Flat params stored in `model`'s scanned layout (`models.layout.stack_layers`'s, numpy arrays):
  a layer's leaf, set by its unrolled path (`paths`: all of them), is copied into its stack at
  once and read back as a view of it, so no unrolled copy is held (stacking after converting
  held both, and left the freed layers as holes in the heap). `items()` gives the scanned paths
  and arrays."""

  def __init__(self, model, paths: set[str]):
    import jax  # noqa: PLC0415

    from jaxformer.models import layout  # noqa: PLC0415

    stacks = layout.layer_stacks(model)
    shapes = _leaves(
      layout.stack_layers(L.unflatten({p: jax.ShapeDtypeStruct((), np.float32) for p in paths}), stacks)
    )  # a stack's leaf: ([layers],)
    self._layers = {path: sds.shape[0] if sds.shape else None for path, sds in shapes.items()}
    self._slots = _leaves(layout.unstack_layers(L.unflatten({p: _Slot(p) for p in shapes}), stacks))
    self._arrays: dict[str, np.ndarray] = {}

  def __setitem__(self, path: str, value: np.ndarray) -> None:
    slot = self._slots[path]
    if slot.layer is None:
      self._arrays[slot.path] = value
      return
    if slot.path not in self._arrays:  # pages are taken as layers are copied in
      self._arrays[slot.path] = np.empty((self._layers[slot.path], *np.shape(value)), np.float32)
    self._arrays[slot.path][slot.layer] = value

  def __getitem__(self, path: str) -> np.ndarray:
    slot = self._slots[path]
    return self._arrays[slot.path] if slot.layer is None else self._arrays[slot.path][slot.layer]

  def items(self):
    """`(scanned path, array)` pairs."""
    return self._arrays.items()


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
  """`{"a/b/c": leaf}` of a nested dict, leaves as they are (`links.flatten` makes them arrays)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_leaves(value, f"{prefix}{key}/"))
    else:
      out[f"{prefix}{key}"] = value
  return out


def write_workdir(
  config: Config, params: Any, tokenizer, workdir: str | Path, origin: dict, tokenizer_files: Path | None = None
) -> Path:
  """Writes a workdir (see the module docstring) under a temporary name, renamed when complete.
  `tokenizer_files`: a directory whose Hugging Face tokenizer files are copied to `TOKENIZER_DIR`.
  A Marian `tokenizer` (the target side) also writes its source side (`source_tokenizer.model`).

  Raises:
    ConfigError: `workdir` exists.
  """
  from jaxformer.checkpoint import manager as ckpt  # noqa: PLC0415
  from jaxformer.checkpoint import run_files as rf  # noqa: PLC0415

  workdir = Path(workdir)
  if workdir.exists():
    raise ConfigError(f"--workdir {workdir} already exists; import writes a new workdir")
  tmp = workdir.with_name(workdir.name + ".incomplete")
  shutil.rmtree(tmp, ignore_errors=True)
  try:
    source = tokenizer.with_side("source").serialized if config.data.tokenizer == "marian" else None
    rf.save_run_files(tmp, dump_config(config), tokenizer.serialized, source)
    if tokenizer_files is not None:
      (tmp / TOKENIZER_DIR).mkdir()
      for name in TOKENIZER_FILES:
        if (tokenizer_files / name).is_file():
          shutil.copyfile(tokenizer_files / name, tmp / TOKENIZER_DIR / name)
      if config.data.tokenizer == "hf" and not (tokenizer_files / "tokenizer.json").is_file():
        tokenizer.save(tmp / TOKENIZER_DIR)  # converted from the directory's SentencePiece model
    (tmp / IMPORT_FILE).write_text(json.dumps(origin) + "\n")
    # Params alone (no optimizer state, which training creates), written without Orbax's copies.
    ckpt.save_host_params(tmp, 0, params)
    tmp.rename(workdir)
  except BaseException:  # a failed or interrupted write leaves no .incomplete directory behind
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return workdir


def import_hf(hf_dir: str | Path, workdir: str | Path) -> dict[str, Any]:
  """`jaxformer import`: reads `hf_dir` and writes the workdir `workdir`.

  Returns:
    `{"workdir", "architecture", "from_hf"}`.

  Raises:
    ConfigError, ValueError, FileNotFoundError: one line naming the problem.
  """
  if Path(workdir).exists():  # before reading any weights
    raise ConfigError(f"--workdir {workdir} already exists; import writes a new workdir")
  if (Path(hf_dir) / "config.json").is_file() and not any((Path(hf_dir) / f).is_file() for f in TOKENIZER_SIGNS):
    raise ConfigError(
      f"{hf_dir} has no tokenizer ({', '.join(TOKENIZER_SIGNS)}); save the model's tokenizer "
      "beside it (AutoTokenizer's save_pretrained)"
    )
  config, weights = open_hf(hf_dir)
  with weights:  # one tensor read at a time (a pytorch_model.bin's temporary safetensors go at the end)
    params = params_from_hf(config, weights)
  own = config.data.tokenizer in OWN_TOKENIZERS  # a published model's tokenizer (else our SentencePiece model)
  if own:
    tokenizer = own_tokenizer(config.data.tokenizer, hf_dir)
    folder = Path(workdir).absolute() / TOKENIZER_DIR
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer_model=str(folder)))
  else:
    tokenizer = load_tokenizer(hf_dir)
  from jaxformer.interop.hf_export import select_mapping  # noqa: PLC0415

  model_type = json.loads((Path(hf_dir) / "config.json").read_text()).get("model_type")
  prefer = next((m.ARCHITECTURE for m in MAPPINGS if m.MODEL_TYPE == model_type), None)
  architecture = select_mapping(config, prefer).ARCHITECTURE
  origin = {"from_hf": str(Path(hf_dir).absolute()), "architecture": architecture}
  write_workdir(config, params, tokenizer, workdir, origin, Path(hf_dir) if own else None)
  return {"workdir": str(workdir), **origin}
