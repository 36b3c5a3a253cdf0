"""Outputs for serving engines: GGUF files for llama.cpp (loaded on first use: the writer needs torch)."""

from __future__ import annotations

from blockfold.export.choices import SOURCE

__all__ = ["QUANT_TYPES", "SOURCE", "export_gguf"]


def __getattr__(name: str):
    if name in ("QUANT_TYPES", "export_gguf"):
        from blockfold.export import gguf

        return getattr(gguf, name)
    raise AttributeError(f"module 'blockfold.export' has no attribute {name!r}")
