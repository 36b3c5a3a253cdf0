"""Checkpoints that are already quantized by bitsandbytes (4-bit NF4 or FP4), as users run them.

The NBL paper compresses a 4-bit model the way it is served: the calibration statistics come from
the quantized model's own forward passes, the fold is computed in higher precision on the tensors it
touches, and every other tensor is kept as it was. Here that means:

- the model runs resident, with transformers' bitsandbytes layers (``--pipeline whole``: the packed
  weights are rebuilt into 4-bit layers by bitsandbytes on load, not read tensor by tensor);
- a layer surgery edits (the folded down-projection, say) is dequantized once into a plain
  ``nn.Linear`` in the runtime dtype, and is saved unquantized in the source's floating dtype;
- every other 4-bit layer is written back byte for byte, its quantization state beside it, and the
  saved config lists the unquantized layers in ``llm_int8_skip_modules`` so plain transformers loads
  them as they are.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from blockfold.errors import BlockfoldError
from blockfold.models.compressed_tensors import QUANT_METHOD, check_compressed_tensors_source

log = logging.getLogger(__name__)


def quantization_method(config) -> str | None:
    """The ``quant_method`` of the config's ``quantization_config`` (None for a float checkpoint)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    return quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)


def quantization_dict(config) -> dict:
    """The config's ``quantization_config`` as a plain dict (transformers keeps a dict or a config object)."""
    quantization = getattr(config, "quantization_config", None) or {}
    return dict(quantization) if isinstance(quantization, dict) else quantization.to_dict()


def check_quantized_source(config, pipeline: str) -> None:
    """Refuse the quantized checkpoints blockfold cannot compress, and layer-by-layer runs of the
    bitsandbytes ones, with what to do instead (a compressed-tensors checkpoint is read as its float
    model, ``models/compressed_tensors.py``, so it runs either way)."""
    method = quantization_method(config)
    if method is None:
        return
    method = str(getattr(method, "value", method))
    quantization = quantization_dict(config)
    if method == QUANT_METHOD:
        check_compressed_tensors_source(quantization)
        return
    eight_bit = quantization.get("load_in_8bit")
    if method != "bitsandbytes" or eight_bit:
        hint = (" (an AutoGPTQ/AutoAWQ layout: llm-compressor writes the same schemes as compressed-tensors, which "
                "blockfold reads)" if method in ("gptq", "awq") else "")
        raise BlockfoldError(f"the checkpoint is quantized with {method}{' (8-bit)' if eight_bit else ''}, which "
                             "blockfold does not compress: it reads float checkpoints, GGUF files, bitsandbytes 4-bit "
                             f"and compressed-tensors weight-only checkpoints{hint}; compress the float model, or its "
                             "GGUF file")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise BlockfoldError("the checkpoint is quantized with bitsandbytes, which is not installed: "
                             "pip install 'blockfold[quant]' (or bitsandbytes itself)")
    if pipeline == "sequential":
        raise BlockfoldError("a bitsandbytes 4-bit checkpoint runs with --pipeline whole (bitsandbytes builds its "
                             "4-bit layers when the model loads): drop --pipeline sequential")


def is_quantized_linear(module: nn.Module) -> bool:
    """A bitsandbytes 4-bit linear layer (its weight packed, its quantization state beside it)."""
    weight = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) and getattr(weight, "quant_state", None) is not None


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The 4-bit layer's weight as the float32 matrix its forward pass multiplies by."""
    import bitsandbytes.functional as bnb_functional

    weight = module.weight
    return bnb_functional.dequantize_4bit(weight.data, weight.quant_state).to(torch.float32)


def keep_standard_4bit_layout(model: nn.Module) -> None:
    """Stop bitsandbytes from repacking the model's 4-bit weights for its CPU kernel.

    On a CPU with AVX512-BF16, bitsandbytes (0.50) rewrites a 4-bit layer's weight and quantization
    state into its kernel's own layout at the layer's first forward, and computes in bfloat16. The
    fold then dequantized garbage and the untouched weights were saved in a layout no loader reads,
    so blockfold keeps the standard layout (its float compute path). A layer already repacked (a model
    run before it was handed over) is refused: bitsandbytes' inverse does not restore its scales.
    """
    for name, module in model.named_modules():
        if not is_quantized_linear(module):
            continue
        if getattr(module.weight.quant_state, "packing_format_for_cpu", False):
            raise BlockfoldError(f"{name}: this 4-bit model already ran on a CPU where bitsandbytes repacks its weights "
                                 "for its AVX512-BF16 kernel, a layout blockfold cannot fold or save: pass the "
                                 "checkpoint's folder (or load it and compress it before running it)")
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def make_plain_linear(module: nn.Module, weight: torch.Tensor) -> None:
    """Turn the 4-bit layer ``module`` into a plain ``nn.Linear`` holding ``weight``, in place, so
    every reference to the module (adapters, the weight store) stays valid."""
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.__class__ = nn.Linear
    for attribute in ("quant_state", "compute_dtype", "compute_type_is_set", "quant_storage"):
        module.__dict__.pop(attribute, None)


def companion_names(names, weight_name: str) -> list[str]:
    """The checkpoint tensors that hold a 4-bit weight's quantization state (``<weight>.absmax``,
    ``<weight>.quant_map``, ``<weight>.quant_state.bitsandbytes__nf4``, ...)."""
    prefix = f"{weight_name}."
    return sorted(name for name in names if name.startswith(prefix))


def unquantized_linears(model: nn.Module) -> list[str]:
    """Names of the model's plain linear layers (the LM head, which bitsandbytes never quantizes, and
    the layers surgery dequantized or added): what the saved config must keep bitsandbytes from
    quantizing when transformers loads it (a list there replaces transformers' default, the head)."""
    return sorted(name for name, module in model.named_modules() if type(module) is nn.Linear and name)


def skip_modules_config(config, model: nn.Module) -> None:
    """Add the model's unquantized linear layers to ``llm_int8_skip_modules`` of ``config``."""
    as_dict = quantization_dict(config)
    skip = sorted(set(as_dict.get("llm_int8_skip_modules") or []) | set(unquantized_linears(model)))
    as_dict = {**as_dict, "llm_int8_skip_modules": skip or None}
    config.quantization_config = as_dict
    log.info("saved unquantized (llm_int8_skip_modules): %s", ", ".join(skip) or "none")
