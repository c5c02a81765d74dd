"""Pipeline parallelism over the `stage` mesh axis: the GPipe schedule (Huang et al. 2019,
"GPipe", section 2.2) written as one SPMD program, no per-device code.

A layer stack of L scanned layers (`model.scan_layers=true`, params `[L, ...]`, the
logical axis `layers` on mesh axis `stage`) is split into S = `mesh.stage` stages of L / S
contiguous layers: stage device s holds layers s * L/S, ..., (s + 1) * L/S - 1, and the
params are only reshaped to `[S, L/S, ...]` (no data moves). The batch is split into M =
`train.microbatches` microbatches of rows j, j + M, j + 2M, ... (each data-parallel device
keeps its rows, as in `train.step._microbatches`).

The schedule runs M + S - 1 iterations of a `lax.scan` over a buffer `[S, rows / M, ...]`
whose stage dimension is sharded over `stage` (logical axis `stages`). Each iteration
shifts the buffer one stage on (`jnp.roll`: a collective permute between stage devices),
puts the next microbatch in slot 0, and applies every stage's layers to its slot at once
(`jax.vmap` over stages, so each stage device computes its own slot). Slot S - 1 then holds
a finished microbatch. `Pipeline.schedule` is the table of which microbatch each stage
works on at each iteration: the scan feeds and keys the microbatches by it, and
`bubble_fraction` counts its idle slots, (S - 1) / (M + S - 1). The backward pass is the
scan's autodiff: the same pipeline in reverse.

Per-row arguments of the blocks (the class attribute `ROW_ARGNUMS`: padding masks,
segment ids, positions, the encoder output and source masks of decoder blocks) are not passed
from stage to stage: every stage device has all microbatches' (replicated over stage, like the
embeddings), and each stage reads those of the microbatch the schedule gives it; the others
(flags, the T5 bias table) are broadcast. Only the activations `[rows / M, length, d_model]`
travel. Idle slots compute on copies of real microbatches, so every value stays finite; their
outputs are dropped, and so are the sums their layers sow (the mixture of experts' router
losses, `layers.moe.AUX`): the others add up over the microbatches into the unpipelined stack's
layout. Layer l of microbatch m draws its dropout from fold_in(rngs[l], m): with dropout
the pipelined step is an equally valid sample, not the unpipelined step's bits.

Embeddings, the final norm and the logits stay outside the pipeline (every stage device
computes them for its data-parallel rows). Cached decoding is never pipelined.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxformer import sharding as sh
from jaxformer.config import Config, ConfigError, ModelConfig
from jaxformer.layers.moe import AUX
from jaxformer.models.transformer import layer_stack

_BUFFER_AXES = (sh.STAGES, sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_EMBED)


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """S = `stages` pipeline stages fed M = `microbatches` microbatches (GPipe schedule)."""

  stages: int
  microbatches: int

  def schedule(self) -> np.ndarray:
    """int `[M + S - 1, S]`: entry [t, s] is the microbatch stage s works on at iteration t, -1 when idle."""
    m = np.arange(self.microbatches + self.stages - 1)[:, None] - np.arange(self.stages)[None, :]
    return np.where((m >= 0) & (m < self.microbatches), m, -1)

  @property
  def bubble_fraction(self) -> float:
    """The idle share of the schedule's stage-iterations, (S - 1) / (M + S - 1)."""
    return float(np.mean(self.schedule() < 0))

  def stack(
    self, block: type[nn.Module], config: ModelConfig, num_layers: int, name: str, **block_fields
  ) -> PipelinedStack:
    """The pipelined stack `name` of `num_layers` blocks (`layer_stack` with a pipeline)."""
    return PipelinedStack(block, config, num_layers, self, tuple(block_fields.items()), name=name)


def _split(x: jax.Array, m: int) -> jax.Array:
  """`[rows, ...]` -> `[m, rows / m, ...]`, microbatch j holding rows j, j + m, ..."""
  x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
  return sh.constrain(x, (None, *_BUFFER_AXES[1 : x.ndim]))


def _merge(x: jax.Array) -> jax.Array:
  """The inverse of `_split`: `[m, rows / m, ...]` -> `[rows, ...]`."""
  return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _on_stages(x: jax.Array) -> jax.Array:
  return sh.constrain(x, _BUFFER_AXES[: x.ndim])


class PipelinedStack(nn.Module):
  """A scanned layer stack run as a pipeline; its params are the scanned stack's, `[num_layers, ...]`.

  Called like the `nn.scan` stack of `layer_stack`: `(x, *block args, rngs) -> (y, None)`
  with `x`, `y` `[batch, length, d_model]` and `rngs` the layers' dropout keys `[num_layers]`
  or None. Apply only (its params come from initialising the unpipelined model).

  Raises:
    ConfigError: the batch rows do not split into the microbatches.
  """

  block: Any
  config: ModelConfig
  num_layers: int
  pipeline: Pipeline
  block_fields: tuple = ()

  @nn.compact
  def __call__(self, x: jax.Array, *args) -> tuple[jax.Array, None]:
    """Runs the schedule over `x` `[batch, length, d_model]`; see the class docstring."""
    *args, rngs = args
    stages, micro = self.pipeline.stages, self.pipeline.microbatches
    per_stage = self.num_layers // stages
    if x.shape[0] % micro:
      raise ConfigError(
        f"a batch of {x.shape[0]} rows does not split into train.microbatches={micro}; "
        f"use a batch size that is a multiple of {micro}"
      )
    row_at = tuple(i - 2 for i in self.block.ROW_ARGNUMS)  # positions in `args` (after self and x)
    inputs = _split(x, micro)
    rows = jax.tree.map(lambda a: _split(a, micro), tuple(args[i] for i in row_at))
    module = layer_stack(self.block, self.config, per_stage, "stage", parent=None, **dict(self.block_fields))
    params = jax.tree.map(lambda p: p.reshape(stages, per_stage, *p.shape[1:]), self.variables["params"])
    keys = None if rngs is None else rngs.reshape(stages, per_stage)

    def run_stage(stage_params, x, stage_rows, stage_keys):
      call = list(args)
      for i, value in zip(row_at, stage_rows):
        call[i] = value
      (y, _), state = module.apply({"params": stage_params}, x, *call, stage_keys, mutable=[AUX])
      return y, state.get(AUX, {})

    def iteration(buffer, schedule_row):
      feed, working, active = schedule_row  # the microbatch entering stage 0; each stage's microbatch
      buffer = _on_stages(jnp.roll(buffer, 1, axis=0).at[0].set(inputs[feed]))
      # Every stage device holds all microbatches' per-row arguments (they are replicated over
      # stage), so each stage reads its own microbatch's locally instead of passing them on.
      stage_rows = jax.tree.map(lambda a: _on_stages(a[working]), rows)
      stage_keys = (
        None
        if keys is None
        else jax.vmap(lambda k, m: jax.vmap(lambda key: jax.random.fold_in(key, m))(k))(keys, working)
      )
      y, aux = jax.vmap(run_stage, spmd_axis_name=stage_axis)(params, buffer, stage_rows, stage_keys)
      y = _on_stages(y)
      # Sums sown by the layers (`layers.moe.AUX`, `[S, L/S, ...]`): an idle slot's are dropped with its output.
      aux = jax.tree.map(lambda a: jnp.where(active.reshape(-1, *(1,) * (a.ndim - 1)), a, 0), aux)
      return y, (y[stages - 1], aux)

    stage_axis = nn.logical_to_mesh_axes((sh.STAGES,))[0]
    schedule = self.pipeline.schedule()
    # Idle slots compute on real microbatches (the first one, the last one again, or microbatch 0's
    # per-row arguments), so every value stays finite; their outputs are dropped.
    buffer = _on_stages(jnp.broadcast_to(inputs[0], (stages, *inputs.shape[1:])))
    xs = (np.clip(schedule[:, 0], 0, micro - 1), np.maximum(schedule, 0), schedule >= 0)
    _, (outputs, aux) = jax.lax.scan(iteration, buffer, xs)
    if self.is_mutable_collection(AUX):  # summed over the microbatches, in the unpipelined stack's layout
      for name, sums in aux.items():
        self.put_variable(AUX, name, jax.tree.map(lambda a: a.sum(0).reshape(self.num_layers, *a.shape[3:]), sums))
    return _merge(outputs[stages - 1 :]), None


def check_pipeline(config: Config, stages: int, data_parallel: int) -> None:
  """Fails before compiling for a pipeline the model or batch cannot take (`runtime.startup.build_mesh` calls it).

  Raises:
    ConfigError (one line): stages without `model.scan_layers`,
      a layer stack that does not split into the stages, or a batch that does not split into
      `train.microbatches` (times `train.grad_accum_steps`) microbatches per data-parallel device.
  """
  from jaxformer.tasks import get_task  # noqa: PLC0415  (tasks import the models)

  train = config.train
  if stages == 1:  # no pipeline, whatever train.microbatches says (a pipelined run's checkpoint evaluates anywhere)
    return
  if not config.model.scan_layers:
    raise ConfigError(
      f"mesh.stage={stages} pipelines the layer stack, which needs model.scan_layers=true "
      "(checkpoints of either layout restore into it)"
    )
  for _, field in get_task(config).make_model().STACKS:
    layers = getattr(config.model, field)
    if layers % stages:
      raise ConfigError(
        f"model.{field}={layers} does not split into mesh.stage={stages} pipeline stages; "
        f"use a mesh.stage that divides {layers}"
      )
  per = train.microbatches * train.grad_accum_steps * data_parallel
  if train.batch_size % per:
    raise ConfigError(
      f"train.batch_size={train.batch_size} does not split into train.microbatches="
      f"{train.microbatches} (x train.grad_accum_steps={train.grad_accum_steps}) microbatches over "
      f"{data_parallel} data-parallel devices; use a train.batch_size that is a multiple of {per}"
    )


def pipeline_for(config: Config, mesh: Mesh) -> Pipeline | None:
  """The pipeline of a run on `mesh`: `mesh.stage` stages fed `train.microbatches`; None without stages."""
  stages = mesh.shape["stage"]
  return Pipeline(stages, config.train.microbatches) if stages > 1 else None


def pipelined(model: nn.Module, config: Config, mesh: Mesh) -> nn.Module:
  """`model` with its layer stacks pipelined over `mesh`'s stage axis (the train and eval step
  factories call it); `model` itself when the mesh has no stages."""
  pipeline = pipeline_for(config, mesh)
  return model if pipeline is None else model.clone(pipeline=pipeline)
