"""Outputs for serving engines: GGUF files for llama.cpp."""

from blockfold.export.gguf import QUANT_TYPES, SOURCE, export_gguf

__all__ = ["QUANT_TYPES", "SOURCE", "export_gguf"]
