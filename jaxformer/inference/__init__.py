"""The inference engine: KV-cache decoding, search strategies and int8 weights for serving trained models."""
