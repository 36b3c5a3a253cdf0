"""Convert a GGUF file into a Hugging Face checkpoint one tensor at a time.

``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` dequantizes every tensor into memory
before the model can be saved, so an 8B Q4 file needs its full float32 size (32 GB) in RAM. This
module writes the same checkpoint while holding one dequantized tensor and one output shard: it
calls transformers' own GGUF pieces (config extraction, GGUF-to-HF name map, per-architecture
tensor processors such as llama's q/k un-permutation and gemma's norm offset) per tensor, and
builds the model only on the meta device, for its parameter names, dtypes and tied weights.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, dequantize
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.core_model_loading import build_glob_alternation
from transformers.integrations.gguf import is_gguf_arch_supported, read_gguf_metadata
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
    load_gguf_checkpoint,
)

from blockfold.errors import BlockfoldError
from blockfold.models.checkpoint import DEFAULT_SHARD_BYTES, ShardWriter
from blockfold.progress import bar

logger = logging.getLogger(__name__)

#: packed bytes per gguf ``dequantize`` call (at most ~70 MB of float32 out): its numpy dequantizers
#: build intermediates several times their output, which for an 8B model's embedding table (2 GB in
#: float32) would otherwise cost more than the table itself
_DEQUANT_CHUNK_BYTES = 8 << 20


class _TensorSpan(NamedTuple):
    """Where one GGUF tensor's bytes lie and how gguf's reader would type them."""

    name: str
    qtype: GGMLQuantizationType
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]


def convert_gguf(
    gguf: Path, target: Path, dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> None:
    """Write into the (existing, empty) folder ``target`` the checkpoint that
    ``from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)`` followed by ``save_pretrained``
    (and the tokenizer's ``save_pretrained``) would write, dequantizing one tensor at a time so the
    model never has to fit in memory. On error ``target`` keeps what was written so far (the caller's
    staging folder)."""
    architecture, spans = _read_gguf(gguf)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=_gguf_config(gguf, architecture))
    model = _skeleton(gguf, AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), dtype, architecture)

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(target)
    model.config.dtype = str(dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(target)
    if model.can_generate():
        model.generation_config.save_pretrained(target)
    _write_weights(gguf, spans, target, model, processor, dtype, max_shard_bytes)


def _read_gguf(gguf: Path) -> tuple[str, list[_TensorSpan]]:
    """The architecture and the tensor table, read through gguf's reader and kept without its memory
    map (mapped pages, once touched, stay in this process's resident memory while the map lives)."""
    try:
        architecture = read_gguf_metadata(str(gguf))[0]["general.architecture"]
        reader = GGUFReader(gguf)
    except (ValueError, struct.error) as err:  # wrong magic bytes, a header cut short, tensors past the end
        raise BlockfoldError(f"{gguf} is not a readable GGUF file ({err}): download it again") from None
    spans = [_TensorSpan(tensor.name, tensor.tensor_type, tensor.data_offset, tensor.data.nbytes, tensor.data.dtype,
                         tensor.data.shape) for tensor in reader.tensors]
    return architecture, spans


def _gguf_config(gguf: Path, architecture: str) -> dict:
    """The raw config transformers parses from the metadata, which is what it hands the tensor
    processors; fails on architectures transformers cannot read, or reads only through its packed path."""
    if is_gguf_arch_supported(architecture):
        raise BlockfoldError(
            f"{gguf.name}: GGUF architecture {architecture!r} loads through transformers' packed-GGUF path, "
            "which blockfold's streaming converter does not cover: convert it with transformers "
            "(from_pretrained(..., gguf_file=...) then save_pretrained) and pass the folder"
        )
    try:
        return load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    except ValueError as err:  # "GGUF model with architecture ... is not supported yet."
        raise BlockfoldError(
            f"{gguf.name}: transformers cannot read GGUF architecture {architecture!r} "
            f"({str(err).splitlines()[0]}): pass the model's Hugging Face (safetensors) folder instead"
        ) from None


def _skeleton(gguf: Path, config, dtype: torch.dtype, architecture: str) -> PreTrainedModel:
    """The causal-LM model transformers would build, with meta parameters: names, shapes, dtypes, ties."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as err:  # e.g. t5: readable from GGUF, but no causal-LM class
        raise BlockfoldError(
            f"{gguf.name}: GGUF architecture {architecture!r} ({config.model_type}) is not a causal language model "
            f"transformers can build ({str(err).splitlines()[0]}): blockfold compresses decoder-only models"
        ) from None


def _write_weights(
    gguf: Path, spans: list[_TensorSpan], target: Path, model: PreTrainedModel, processor: TensorProcessor,
    dtype: torch.dtype, max_shard_bytes: int,
) -> None:
    """Dequantize, process, cast and write each tensor as ``load_gguf_checkpoint`` + loading + saving would."""
    name_map = get_gguf_hf_weights_map(model, processor)
    expected = _saved_names(model)
    param_dtypes = _parameter_dtypes(model, dtype)
    # a few processors (MoE experts, gpt2's lm_head) merge or move tensors through this side channel;
    # what lands there is written after the loop, as transformers loads it without the first cast
    side_channel: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}
    writer = ShardWriter(target, max_shard_bytes)
    written: set[str] = set()

    def emit(name: str, tensor: torch.Tensor) -> None:
        if name in expected:
            writer.add(name, tensor.to(param_dtypes[name]))
            written.add(name)

    with gguf.open("rb") as handle:
        for span in bar(spans, desc=f"converting {gguf.name}", unit="tensor"):
            result = processor.process(weights=_dequantize(_read(handle, span), span.qtype), name=span.name,
                                       tensor_key_mapping=name_map, parsed_parameters=side_channel)
            if result.name in name_map:  # transformers skips the rest (e.g. llama 3's rope_freqs)
                emit(name_map[result.name], torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype))
            del result  # else this float32 tensor lives on through the next one's dequantization
    for name, tensor in side_channel["tensors"].items():
        emit(name, tensor)
    missing = sorted(expected - written)
    if missing:
        raise BlockfoldError(
            f"{gguf.name} has no tensor for {len(missing)} parameters of {type(model).__name__} "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); transformers would fill them with "
            "random values: the file does not match its own architecture's parameters, convert the original "
            "Hugging Face checkpoint instead"
        )
    writer.close()
    logger.info("wrote %d tensors (%.1f MB) to %s", len(written), writer.total_bytes / 1e6, target)


def _saved_names(model: PreTrainedModel) -> set[str]:
    """The names ``save_pretrained`` writes: the state dict less tied copies and ignored keys."""
    names = set(model.state_dict()) - set(model.all_tied_weights_keys)
    return names - set(model._keys_to_ignore_on_save or ())


def _parameter_dtypes(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Each parameter's dtype after loading: ``dtype``, except where the model keeps some in float32."""
    dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    plan = model._get_dtype_plan(dtype)
    if plan:
        alternation, group_to_pattern, _ = build_glob_alternation(list(plan))
        for name in dtypes:
            if (match := alternation.search(name)) is not None:
                dtypes[name] = plan[group_to_pattern[match.lastgroup]]
    return dtypes


def _read(handle, span: _TensorSpan) -> np.ndarray:
    """The array gguf's reader would give for ``span``, read into memory of its own with a plain read."""
    buffer = bytearray(span.nbytes)
    handle.seek(span.offset)
    if handle.readinto(buffer) != span.nbytes:
        raise BlockfoldError(f"{handle.name} ends inside tensor {span.name}: the file is truncated; download it again")
    return np.frombuffer(buffer, dtype=span.dtype).reshape(span.shape)


def _dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's ``dequantize``, a slab of rows at a time for large packed tensors (rows are independent,
    so the values are those of one call)."""
    if raw.dtype != np.uint8 or raw.ndim < 2 or raw.nbytes <= _DEQUANT_CHUNK_BYTES:
        return dequantize(raw, qtype)
    rows = raw.reshape(-1, raw.shape[-1])
    step = max(1, _DEQUANT_CHUNK_BYTES // rows.shape[1])
    first = dequantize(rows[:step], qtype)
    out = np.empty((rows.shape[0], first.shape[1]), dtype=first.dtype)
    out[:step] = first
    for start in range(step, rows.shape[0], step):
        out[start : start + step] = dequantize(rows[start : start + step], qtype)
    return out.reshape(*raw.shape[:-1], out.shape[1])
