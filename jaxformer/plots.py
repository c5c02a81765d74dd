"""Pictures with matplotlib (the Agg backend: no display): training curves of one or more
workdirs, and attention maps per layer and head (the paper's Figures 3-5).

Figures are built with the object-oriented API (no pyplot state) and written atomically;
the functions return the `Figure`, whose `axes` are its panels.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

if TYPE_CHECKING:  # the loss curves need no JAX
  from jaxformer.inference.attention_maps import AttentionMap

METRICS_FILE = "metrics.jsonl"  # JSON lines the training loop appends (`train.loop`)
CURVES = (("loss", "training loss"), ("val_loss", "validation loss"), ("learning_rate", "learning rate"))


def read_metrics(workdir: str | Path) -> list[dict]:
  """The rows of `workdir`'s metrics file (training rows hold `loss`, `learning_rate`, ...;
  validation rows `val_loss`, ...; every row a `step`). A torn last line (a run killed
  while writing, or still running) is skipped.

  Raises:
    ValueError: the workdir has no metrics file, or it holds no training or validation row.
  """
  path = Path(workdir) / METRICS_FILE
  if not path.is_file():
    raise ValueError(f"{workdir} has no {METRICS_FILE}; give a workdir that `jaxformer train` has logged to")
  lines = path.read_text().splitlines()
  rows = []
  for number, line in enumerate(lines, 1):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if number < len(lines):
        raise ValueError(f"{path} line {number} is not JSON; the file is damaged") from None
  if not any("loss" in r or "val_loss" in r for r in rows):
    raise ValueError(f"{path} holds no training or validation rows yet; train for at least train.log_every steps")
  return rows


def run_names(workdirs: Sequence[str | Path]) -> list[str]:
  """Legend names: each workdir's folder name, or its path where two names would clash."""
  names = [Path(w).name or str(w) for w in workdirs]
  return [n if names.count(n) == 1 else str(w) for n, w in zip(names, workdirs)]


def plot_training(workdirs: Sequence[str | Path], out: str | Path) -> Figure:
  """Training loss, validation loss and learning rate against step (three panels), one
  line per workdir with its name in the legend; written to the PNG `out`.

  Raises:
    ValueError: a workdir without metrics (`read_metrics`), or `out` cannot be written.
  """
  runs = [read_metrics(w) for w in workdirs]  # every workdir checked before drawing
  fig = Figure(figsize=(13, 3.8), layout="constrained")
  axes = fig.subplots(1, len(CURVES))
  for rows, name in zip(runs, run_names(workdirs)):
    for ax, (key, _) in zip(axes, CURVES):
      points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
      if points:
        ax.plot(*zip(*points), marker="o" if key.startswith("val_") else None, markersize=3, label=name)
  for ax, (key, title) in zip(axes, CURVES):
    ax.set(title=title, xlabel="step")
    ax.grid(alpha=0.3)
    if key == "learning_rate":
      ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
  axes[0].legend(fontsize="small")
  save_figure(fig, out)
  return fig


def plot_attention(maps: Sequence[AttentionMap], out: str | Path, title: str = "") -> Figure:
  """One panel per layer and head of each attention map (rows: layers, columns: heads),
  queries down and keys across with their tokens on the axes, weights from 0 (white) to 1
  (black); written to the PNG `out`. The figure has sum(layers) x heads panels.

  Raises:
    ValueError: `out` cannot be written.
  """
  num_heads = maps[0].weights.shape[1]
  tokens = max(max(len(m.queries), len(m.keys)) for m in maps)
  size = max(1.5, 0.11 * tokens)  # inches per panel: room for the token labels
  layers = [m.weights.shape[0] for m in maps]
  fig = Figure(figsize=(1.2 + size * num_heads, sum(1.0 + size * n for n in layers)), layout="constrained")
  if title:
    fig.suptitle(title, fontsize="medium")
  for sub, m in zip(fig.subfigures(len(maps), 1, height_ratios=layers), maps):
    sub.suptitle(m.title, fontsize="medium")
    grid = sub.subplots(m.weights.shape[0], num_heads, squeeze=False)
    for (layer, head), ax in zip(((i, j) for i in range(len(grid)) for j in range(num_heads)), grid.flat):
      ax.imshow(m.weights[layer, head], cmap="Greys", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
      ax.set_xticks(range(len(m.keys)), m.keys if layer == len(grid) - 1 else [], rotation=90, fontsize=6)
      ax.set_yticks(range(len(m.queries)), m.queries if head == 0 else [], fontsize=6)
      ax.tick_params(length=0, pad=1)
      if layer == 0:
        ax.set_title(f"head {head + 1}", fontsize="small")
      if head == 0:
        ax.set_ylabel(f"layer {layer + 1}", fontsize="small")
  save_figure(fig, out)
  return fig


def save_figure(fig: Figure, out: str | Path, dpi: int = 100) -> Path:
  """Writes `fig` as a PNG through a temporary file in `out`'s folder, renamed into place,
  so a crash leaves no partial image.

  Raises:
    ValueError: the folder is missing or the file cannot be written (one line).
  """
  out = check_out(out)
  FigureCanvasAgg(fig)  # render with Agg whatever backend matplotlib would pick
  tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # opened normally: the umask sets its mode
  try:
    with open(tmp, "wb") as f:
      fig.savefig(f, format="png", dpi=dpi)
    os.replace(tmp, out)
  except OSError as e:
    with contextlib.suppress(OSError):
      tmp.unlink()
    raise ValueError(f"cannot write {out}: {e.strerror}") from None
  return out


def check_out(out: str | Path) -> Path:
  """`out` as a Path, once its folder is known to exist (commands check before any work).

  Raises:
    ValueError: the folder is missing, or `out` is a directory.
  """
  out = Path(out)
  if out.is_dir():
    raise ValueError(f"--out {out} is a directory; give a file path, e.g. --out {out / 'plot.png'}")
  if not out.absolute().parent.is_dir():
    raise ValueError(f"--out {out}: its folder {out.absolute().parent} is missing; create it or give another path")
  return out
