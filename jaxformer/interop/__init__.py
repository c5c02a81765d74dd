"""Interoperability: Hugging Face Transformers export and import (`hf_export`, `hf_import`) and
CTranslate2 conversion (`ctranslate2`). Needs the `hf` extra (and `peers` for CTranslate2)."""
