"""Transformer models built from `jaxformer.layers`."""
