"""Loading models from Hugging Face folders, GGUF files, built-in names and hub ids, resident or streamed."""

from blockfold.models.handle import ModelHandle, WeightStore
from blockfold.models.sources import BUILTIN_MODELS, load_model, model_fingerprint

__all__ = ["BUILTIN_MODELS", "ModelHandle", "WeightStore", "load_model", "model_fingerprint"]
