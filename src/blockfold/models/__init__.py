"""Loading models from Hugging Face folders, GGUF files, built-in names and hub ids."""

from blockfold.models.sources import BUILTIN_MODELS, LoadedModel, load_model, model_fingerprint

__all__ = ["BUILTIN_MODELS", "LoadedModel", "load_model", "model_fingerprint"]
