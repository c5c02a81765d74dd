"""jaxformer: the Transformer (Vaswani et al. 2017) in JAX/Flax, sharded over a device mesh.

The public Python API is the names below; everything else is internal. Each does what the
`jaxformer` command of the same purpose does:

  config = jaxformer.load_config(path, overrides)   # a YAML config plus `a.b=c` overrides
  jaxformer.fit(config, workdir)                    # `jaxformer train`: train or resume
  model = jaxformer.restore(workdir)                # a checkpoint, ready for inference
  jaxformer.translate(model, sentences)             # `jaxformer translate`
  jaxformer.generate(model, prompt, max_new_tokens) # `jaxformer generate` (a causal LM)
  jaxformer.score(model, split="test")              # `jaxformer eval`
  jaxformer.logits(model, ids)                      # float32 logits, to compare with another implementation
  jaxformer.export(workdir, out)                    # `jaxformer export --format hf`

(Training is `fit` and evaluation `score` because `jaxformer.train` is an internal package and
evaluation lives in `jaxformer.tasks.evaluate`.) The names are imported on first use, so `import jaxformer` loads
neither JAX nor anything else.
"""

import importlib

__version__ = "0.1.0"

# Public name -> "module:attribute"; one line per name.
_PUBLIC = {
  "load_config": "jaxformer.config:load_config",
  "fit": "jaxformer.api:fit",
  "restore": "jaxformer.api:restore",
  "translate": "jaxformer.api:translate",
  "generate": "jaxformer.inference.generate:generate",
  "score": "jaxformer.api:score",
  "logits": "jaxformer.api:logits",
  "export": "jaxformer.interop.hf_export:export_workdir",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
  """Imports a public name on first access (PEP 562) and keeps it in the module."""
  if name not in _PUBLIC:
    raise AttributeError(f"module 'jaxformer' has no attribute {name!r}")
  module, attribute = _PUBLIC[name].split(":")
  value = getattr(importlib.import_module(module), attribute)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_PUBLIC))
