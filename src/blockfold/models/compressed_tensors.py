"""Checkpoints stored as compressed-tensors: weight-only GPTQ, AWQ or round-to-nearest models, as
llm-compressor writes them and vLLM serves them.

The NBL paper compresses a 4-bit model as it is served. A weight-only scheme (W4A16, W8A16) keeps
activations in floating point, so the quantized model computes exactly what its dequantized weights
compute; blockfold therefore reads such a checkpoint as the float model its quantized layers stand
for (``CompressedTensorsReader``: each packed layer's ``weight`` dequantized by compressed-tensors
itself, on demand, so a layer-by-layer run still holds one block), calibrates on it, and edits in
float64. On saving (``surgery/save.py``) every quantized weight compression left alone is copied
byte for byte (its packed values, scales, zero points and shape tensors), a weight it changed is
quantized again in the source's scheme with fresh min-max scales (round to nearest, what the format's
library computes without calibration data), and layers that exist in no scheme (NBL's linear maps)
are stored in float and named in the config's ``ignore`` list. The saved config is the source's
quantization config with that list brought up to date, so transformers and vLLM load the result as
they load the source.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import torch
from torch import nn

from blockfold.errors import BlockfoldError
from blockfold.models.checkpoint import CheckpointReader

QUANT_METHOD = "compressed-tensors"
#: storage formats whose layers blockfold reads and writes back (llm-compressor's W4A16/W8A16 output)
SUPPORTED_FORMATS = ("pack-quantized",)
#: weight quantization strategies whose scales blockfold can compute again for a changed weight
REQUANTIZED_STRATEGIES = ("group", "channel", "tensor")
#: the tensor beside a layer's weight that marks the layer as stored quantized
_SCALE_SUFFIX = ".weight_scale"


def check_compressed_tensors_source(quantization: dict) -> None:
    """Refuse the compressed-tensors checkpoints blockfold cannot compress faithfully, each with the way out."""
    if importlib.util.find_spec("compressed_tensors") is None:
        raise BlockfoldError("the checkpoint is stored as compressed-tensors, which is not installed: "
                             "pip install 'blockfold[quant]' (or compressed-tensors itself)")
    from compressed_tensors.quantization import QuantizationConfig

    way_out = "compress the float model, then quantize the result with llm-compressor"
    if quantization.get("sparsity_config") or quantization.get("transform_config"):
        kind = "sparse" if quantization.get("sparsity_config") else "rotated (transform_config)"
        raise BlockfoldError(f"the compressed-tensors checkpoint is {kind}, which blockfold does not compress: {way_out}")
    config = QuantizationConfig.model_validate(quantization)
    if config.kv_cache_scheme is not None:
        raise BlockfoldError("the compressed-tensors checkpoint quantizes its KV cache, which blockfold's calibration "
                             f"would not reproduce: {way_out}")
    for name, scheme in config.config_groups.items():
        if scheme.input_activations is not None or scheme.output_activations is not None:
            raise BlockfoldError(f"the compressed-tensors scheme {name} quantizes activations too (W8A8, FP8 and the "
                                 "like), so the statistics of its float model would not be the quantized model's; "
                                 f"blockfold compresses weight-only schemes (W4A16, W8A16): {way_out}")
        if scheme.weights is None:
            continue
        storage = scheme.format or config.format
        if storage not in SUPPORTED_FORMATS:
            raise BlockfoldError(f"the compressed-tensors scheme {name} is stored as {storage}; blockfold reads and "
                                 f"writes {', '.join(SUPPORTED_FORMATS)} (W4A16/W8A16): {way_out}")
        if scheme.weights.strategy not in REQUANTIZED_STRATEGIES:
            raise BlockfoldError(f"the compressed-tensors scheme {name} quantizes weights by {scheme.weights.strategy}; "
                                 f"blockfold quantizes a changed weight again by {', '.join(REQUANTIZED_STRATEGIES)} "
                                 f"only: {way_out}")


def without_quantization(config):
    """A copy of ``config`` without its quantization config: the float model the checkpoint stands for."""
    plain = copy.deepcopy(config)
    if hasattr(plain, "quantization_config"):
        delattr(plain, "quantization_config")
    return plain


class CompressedTensorsReader(CheckpointReader):
    """A compressed-tensors checkpoint seen as the float checkpoint it stands for: each quantized
    layer shows one ``<layer>.weight`` (dequantized when read) and hides the tensors it is stored as,
    which ``stored_tensors`` hands out for copying."""

    def __init__(self, folder: str | Path, quantization: dict):
        super().__init__(folder)
        from compressed_tensors.quantization import QuantizationConfig

        self.quantization = quantization
        self._config = QuantizationConfig.model_validate(quantization)
        if any(name.endswith(".weight_g_idx") for name in self._file_of):
            raise BlockfoldError(f"{self.folder} stores activation-order indices (weight_g_idx), a layout of older "
                                 "compressed-tensors versions that the installed one does not read: quantize the "
                                 "float model again with a current llm-compressor")
        layers = sorted(name.removesuffix(_SCALE_SUFFIX) for name in self._file_of if name.endswith(_SCALE_SUFFIX))
        self._stored_file = dict(self._file_of)
        self._stored_meta = dict(self._meta)
        self._parts: dict[str, list[str]] = {}  # presented weight → the stored tensors it is read from
        for layer in layers:
            parts = [name for name in self._stored_file if name.startswith(f"{layer}.weight_")]
            shape = tuple(int(size) for size in self.stored(f"{layer}.weight_shape").tolist())
            weight = f"{layer}.weight"
            self._parts[weight] = parts
            for part in parts:
                del self._file_of[part], self._meta[part]
            self._file_of[weight] = self._stored_file[f"{layer}{_SCALE_SUFFIX}"]
            self._meta[weight] = (self._stored_meta[f"{layer}{_SCALE_SUFFIX}"][0], shape)

    # -- the stored form -------------------------------------------------------------------
    def is_quantized(self, name: str) -> bool:
        """Whether the weight ``name`` is stored quantized (and read dequantized)."""
        return name in self._parts

    @property
    def quantized_weights(self) -> list[str]:
        """The weights stored quantized, under the float checkpoint's names."""
        return list(self._parts)

    def stored_tensors(self, name: str) -> list[str]:
        """The checkpoint tensors the quantized weight ``name`` is stored as, in the checkpoint's order."""
        return self._parts[name]

    def stored(self, name: str) -> torch.Tensor:
        """A tensor as the checkpoint stores it (a packed weight's parts included)."""
        with self._open(self._stored_file[name]) as handle:
            return handle.get_tensor(name).clone()

    def stored_layout(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        dtype, shape = self._stored_meta[name]
        return shape, dtype

    def scheme(self, name: str):
        """The compressed-tensors scheme the layer of weight ``name`` is quantized by: the config group
        whose targets name it (exactly or by a ``re:`` pattern), else the first one targeting a class."""
        from compressed_tensors.utils.match import match_name

        layer = name.removesuffix(".weight")
        groups = [scheme for scheme in self._config.config_groups.values() if scheme.weights is not None]
        for scheme in groups:
            if any(match_name(layer, target) for target in scheme.targets):
                return scheme
        by_class = [scheme for scheme in groups if any(_is_class_target(target) for target in scheme.targets)]
        if not by_class:
            raise BlockfoldError(f"{self.folder}: no quantization group of its config targets {layer}: the config "
                                 "does not describe these weights; quantize the float model again")
        return by_class[0]

    # -- the float view --------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``; a quantized weight dequantized by compressed-tensors in the scale's dtype."""
        if name not in self._parts:
            return super().get(name)
        from compressed_tensors.compressors import BaseCompressor

        scheme = self.scheme(name)
        layer = name.removesuffix(".weight")
        parts = {part[len(layer) + 1:]: self.stored(part) for part in self._parts[name]}
        compressor = BaseCompressor.get_value_from_registry(scheme.format or self._config.format)
        return compressor.decompress(parts, scheme)["weight"]

    # -- writing back ----------------------------------------------------------------------
    def requantizable(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the layer of weight ``name``, edited to ``shape``, fits its scheme again (a sliced
        layer's inputs may no longer be a whole number of groups: it is then stored in float)."""
        args = self.scheme(name).weights
        return args.strategy != "group" or shape[-1] % args.group_size == 0

    def requantize(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors (by suffix: ``weight_packed``, ``weight_scale``, ...) that store the changed
        ``weight`` of layer ``name`` in its source scheme, scales from the weight's own minima and maxima
        per group, channel or tensor. A meta ``weight`` gives meta tensors of the right shapes."""
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization.utils import calculate_qparams

        scheme = self.scheme(name)
        args = scheme.weights
        layer = name.removesuffix(".weight")
        weight = weight.to(torch.float32)
        if args.strategy == "group":
            grouped = weight.reshape(weight.shape[0], -1, args.group_size)
            low, high = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == "channel":
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        else:
            low, high = weight.amin().reshape(1), weight.amax().reshape(1)
        scale_dtype = self._stored_meta[f"{layer}{_SCALE_SUFFIX}"][0]
        if weight.device.type == "meta":
            scale = torch.empty(low.shape, dtype=scale_dtype, device="meta")
            zero = torch.empty(low.shape, dtype=args.zp_dtype or torch.int8, device="meta")
        else:
            scale, zero = calculate_qparams(low, high, args)
            scale = scale.to(scale_dtype)
        state = {"weight": weight, "weight_scale": scale}
        if not args.symmetric:
            state["weight_zero_point"] = zero
        compressor = BaseCompressor.get_value_from_registry(scheme.format or self._config.format)
        stored = compressor.compress(state, scheme)
        if weight.device.type == "meta" and "weight_zero_point" in stored:  # packed along rows, as compress packs it
            rows = -(-zero.shape[0] * args.num_bits // 32)
            stored["weight_zero_point"] = torch.empty((rows, *zero.shape[1:]), dtype=torch.int32, device="meta")
        return stored

    def saved_config(self, model: nn.Module, quantized: set[str]) -> dict:
        """The source's quantization config for the saved ``model``, whose layers ``quantized`` (names)
        are stored quantized: every other layer a scheme targets is named in ``ignore``, where the
        source's patterns and class names stay; the source's names of single layers are recomputed (a
        removal renumbers blocks)."""
        from compressed_tensors.utils.match import is_match

        config = json.loads(json.dumps(self.quantization))
        targets = [target for scheme in self._config.config_groups.values() if scheme.weights is not None
                   for target in scheme.targets]
        kept = [entry for entry in config.get("ignore") or [] if entry.startswith("re:") or _is_class_target(entry)]
        unquantized = [name for name, module in model.named_modules()
                       if name and name not in quantized and isinstance(module, (nn.Linear, nn.Embedding))
                       and is_match(name, module, targets, ignore=kept)]  # the loaders' own matching rule
        config["ignore"] = kept + unquantized
        return config


def _is_class_target(target: str) -> bool:
    """Whether a target names a module class (``Linear``) rather than a layer."""
    return not target.startswith("re:") and "." not in target and target[:1].isupper()
