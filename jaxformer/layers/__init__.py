"""Transformer building blocks: attention, feed-forward, embeddings, normalization."""
