"""The one-verb Python API: ``blockfold.compress(model, tokenizer, recipe)``."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold import __version__
from blockfold.adapters import get_adapter
from blockfold.data import CalibrationSet, build_calibration
from blockfold.recipe import Recipe


@dataclass
class CompressionResult:
    model: PreTrainedModel
    manifest: dict


def environment() -> dict:
    return {"blockfold": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "threads": torch.get_num_threads()}


def count_parameters(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())


def compress(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    recipe: Recipe | dict | None = None,
    calibration: CalibrationSet | None = None,
) -> CompressionResult:
    """Compress ``model`` in place as ``recipe`` says; returns the model and its manifest.

    ``calibration`` may be given to reuse token batches across runs; otherwise it is built from
    ``recipe.calibration``.
    """
    from blockfold.methods import METHODS

    recipe = recipe if isinstance(recipe, Recipe) else Recipe.parse(recipe or {})
    adapter = get_adapter(model)
    model.eval()
    model.requires_grad_(False)
    original_layers = adapter.num_layers(model)
    original_parameters = count_parameters(model)
    if calibration is None:
        calibration = build_calibration(recipe.calibration, tokenizer, model)
    started = time.perf_counter()
    details = METHODS[recipe.method](model, tokenizer, recipe, calibration)
    elapsed = time.perf_counter() - started
    manifest = {
        "format": "blockfold-manifest/1",
        "method": recipe.method,
        "architecture": {"model_type": model.config.model_type, "adapter": adapter.name},
        "original_num_layers": original_layers,
        "num_layers": adapter.num_layers(model),
        "original_parameters": original_parameters,
        "parameters": count_parameters(model),
        **details,
        "calibration": calibration.description,
        "recipe": recipe.model_dump(mode="json"),
        "compress_seconds": elapsed,
        "environment": environment(),
    }
    return CompressionResult(model, manifest)
