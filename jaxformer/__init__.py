"""jaxformer: the Transformer (Vaswani et al. 2017) in JAX/Flax, sharded over a device mesh."""

__version__ = "0.1.0"
