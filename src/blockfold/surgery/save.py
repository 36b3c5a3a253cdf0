"""Writing a compressed model atomically: a temporary folder, renamed into place when complete."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save
from transformers.utils import GENERATION_CONFIG_NAME

from blockfold.errors import BlockfoldError
from blockfold.models.checkpoint import DEFAULT_SHARD_BYTES, ShardWriter
from blockfold.models.compressed_tensors import QUANT_METHOD, CompressedTensorsReader
from blockfold.models.handle import ModelHandle
from blockfold.models.multimodal import PROCESSOR_FILES
from blockfold.models.naming import stored_tensors
from blockfold.models.quantized import companion_names, is_quantized_linear, quantization_method, skip_modules_config
from blockfold.progress import bar
from blockfold.surgery.card import CARD_NAME, model_card, source_license

MANIFEST_NAME = "blockfold_manifest.json"
RECIPE_NAME = "blockfold_recipe.yaml"

logger = logging.getLogger(__name__)


def check_output_folder(out: str | Path, overwrite: bool) -> Path:
    """Refuse an existing output folder unless ``overwrite``; called before any work is done."""
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise BlockfoldError(f"output folder {out} already exists: choose another --out or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise BlockfoldError(f"output path {out} is a file: choose a folder path for --out")
    return out


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove the staging folders a killed run left beside ``out`` (``.<out>.partial-<pid>-*`` and
    ``.<out>.old-<pid>-*`` whose process is gone); a live run's folders are left alone."""
    removed = []
    for folder in out.parent.glob(f".{out.name}.*-*-*"):
        kind, _, rest = folder.name[len(out.name) + 2 :].partition("-")
        pid = rest.split("-", 1)[0]
        if kind in ("partial", "old") and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            logger.info("removed %s, left by an interrupted run (process %s)", folder, pid)
            removed.append(folder)
    return removed


def resume_folder(out: str | Path, fresh: bool = False, rank: int = 0) -> Path:
    """Where a compression into ``out`` checkpoints its calibration passes (``.<out>.resume`` beside
    it, so it outlives the process); ``fresh`` deletes this process's checkpoints first."""
    out = Path(out)
    folder = out.parent / f".{out.name}.resume"
    if fresh and folder.is_dir():
        for path in folder.glob(f"*rank{rank}*"):
            path.unlink(missing_ok=True)
    return folder


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextmanager
def staged_folder(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty folder beside ``out`` to write into; when the block ends without error it
    replaces ``out`` (an old ``out`` is moved aside first and removed after), otherwise it is
    deleted: nothing half written is ever at ``out``."""
    out = check_output_folder(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    try:
        yield staging
        if out.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
            os.replace(out, retired / out.name)
            os.replace(staging, out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


#: float16's own rounding is at most 2^-11 relative; a tensor cast with a larger error than this lost it
#: to the range, not the rounding (subnormals, values flushed to zero, or inf)
FLOAT16_CAST_ERROR = 1e-2


def _cast_checked(name: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` in ``dtype``, refused where float16 cannot hold it: the cast's norm-wise relative error
    past ``FLOAT16_CAST_ERROR`` (Gemma's linearized-norm fold stores weights near 1e-10, which flush to
    zero, and a norm scale near 1e6, past float16's range)."""
    cast = value.to(dtype)
    if dtype != torch.float16 or value.dtype == torch.float16 or not value.is_floating_point():
        return cast
    original = value.double()
    error = float((cast.double() - original).norm() / original.norm().clamp_min(torch.finfo(torch.float64).tiny))
    if not error <= FLOAT16_CAST_ERROR:
        raise BlockfoldError(f"{name} cannot be saved in float16 (relative error {error:.3g} from its range; a Gemma "
                             "linearized-norm fold does this): save in bfloat16 or float32 (--save-dtype), or compress "
                             "with --sandwich-fold through-norm")
    return cast


def write_checkpoint(handle: ModelHandle, folder: Path, save_dtype: torch.dtype | None = None,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict | None:
    """Write the model's weights, config and generation config into ``folder``, tensor by tensor:
    each parameter is read from the source checkpoint (or the owned copy), its recorded edits are
    applied in float64, and it is cast to ``save_dtype`` (default: the source's own dtype). The
    whole model is never in memory; plain transformers loads the result. For a compressed-tensors source,
    the layers compression edited are quantized again in its scheme, or, where ``save_dtype`` is given,
    kept in that dtype; returns how its quantized layers were saved (as stored, quantized again, in float)."""
    model = handle.saved_model
    requantize = save_dtype is None  # a quantized source's edited layers: its scheme, unless a dtype is asked for
    save_dtype = save_dtype or handle.source_dtype()
    entries = _saved_entries(model)

    def dtype_of(tensor: torch.Tensor) -> torch.dtype:
        return save_dtype if tensor.is_floating_point() else tensor.dtype

    # each parameter under the names save_pretrained writes it (a mixture's experts one tensor each)
    # (a meta stand-in, not ``tensor.to("meta")``: bitsandbytes moves a 4-bit weight's state along with it, in place)
    quantized = {name: source for name, module, attr, tensor in entries
                 if (source := _stored_quantized(handle, module, attr, tuple(tensor.shape), requantize)) is not None}
    layout = []
    for name, module, attr, tensor in entries:
        placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        if name in quantized:
            layout += [(stored, tuple(piece.shape), piece.dtype) for stored, piece in
                       _quantized_tensors(handle, module, name, quantized[name], placeholder).items()]
        else:
            layout += [(stored, tuple(piece.shape), dtype_of(tensor))
                       for stored, piece in stored_tensors(model, name, placeholder).items()]
    companions = _quantization_state(handle, entries)
    reader = handle.store.reader
    layout += [(saved, tuple(reader.shape(source)), reader.dtype(source)) for saved, source in companions.items()]
    writer = ShardWriter(folder, max_shard_bytes, layout)
    for name, module, attr, tensor in bar(entries, desc="writing checkpoint", unit="tensor", leave=False):
        if name in quantized:  # as stored, or quantized again where compression changed it
            for stored, piece in _quantized_tensors(handle, module, name, quantized[name]).items():
                writer.add(stored, piece.contiguous())
            continue
        value = handle.saved_value(module, attr) if attr in module._parameters else tensor
        for stored, piece in stored_tensors(model, name, _cast_checked(name, value, dtype_of(value))).items():
            writer.add(stored, piece.contiguous())
    for saved, source in companions.items():  # as stored: a 4-bit weight's state is never cast
        writer.add(saved, reader.get(source))
    writer.close()
    stored_as = None
    config = copy.deepcopy(model.config)
    if isinstance(reader, CompressedTensorsReader):
        layers = {name.removesuffix(".weight") for name in quantized}
        config.quantization_config = reader.saved_config(model, layers)
        again = sum(_edited(handle, module) for name, module, *_ in entries if name in quantized)
        stored_as = {"format": QUANT_METHOD, "as_stored": len(quantized) - again, "quantized_again": again,
                     "in_float": config.quantization_config["ignore"]}
    elif quantization_method(config) is not None:
        skip_modules_config(config, model)
    config.dtype = str(save_dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    if model.is_remote_code():  # linearized checkpoints ship their modeling code
        custom_object_save(model, folder, config=config)
    config.save_pretrained(folder)
    source_generation = handle.path / GENERATION_CONFIG_NAME if handle.path else None
    if source_generation is not None and source_generation.is_file():
        shutil.copyfile(source_generation, folder / GENERATION_CONFIG_NAME)
    elif model.can_generate():
        GenerationConfig.from_model_config(config).save_pretrained(folder)
    return stored_as


def _stored_quantized(handle: ModelHandle, module: nn.Module, attr: str, shape: tuple[int, ...],
                      requantize: bool) -> str | None:
    """The checkpoint name of a weight its compressed-tensors source stores quantized, when it is saved
    quantized (as stored, or quantized again in the source's scheme after an edit where ``requantize``);
    else None: a weight from no checkpoint (a trained or new layer), an edited one without ``requantize``
    and one the scheme no longer fits are saved in float."""
    reader = handle.store.reader
    if not isinstance(reader, CompressedTensorsReader) or attr != "weight" or attr in handle.store.owned.get(module, {}):
        return None
    source = handle.store.source_name(module, attr)
    if not isinstance(source, str) or not reader.is_quantized(source):
        return None
    return source if not _edited(handle, module) or (requantize and reader.requantizable(source, shape)) else None


def _edited(handle: ModelHandle, module: nn.Module) -> bool:
    return bool(handle.store.edits.get(module, {}).get("weight"))


def _quantized_tensors(handle: ModelHandle, module: nn.Module, name: str, source: str,
                       placeholder: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Saved name → tensor of a quantized weight: its source's tensors byte for byte, or, where compression
    edited it, the edited float64 weight quantized again in the source's scheme. Given the weight's meta
    ``placeholder``, meta tensors of the same shapes and dtypes (the shard plan), nothing read."""
    reader, layer = handle.store.reader, name.removesuffix("weight")
    if _edited(handle, module):
        weight = placeholder if placeholder is not None else handle.saved_value(module, "weight")
        return {layer + suffix: tensor for suffix, tensor in reader.requantize(source, weight).items()}
    prefix = source.removesuffix("weight")
    if placeholder is None:
        return {layer + part.removeprefix(prefix): reader.stored(part) for part in reader.stored_tensors(source)}
    return {layer + part.removeprefix(prefix): torch.empty(shape, dtype=dtype, device="meta")
            for part in reader.stored_tensors(source) for shape, dtype in [reader.stored_layout(part)]}


def _quantization_state(handle: ModelHandle, entries) -> dict[str, str]:
    """Saved name → checkpoint name of the tensors beside each 4-bit weight that stays quantized
    (renumbered with its block), so it is written back byte for byte."""
    companions: dict[str, str] = {}
    for name, module, attr, _ in entries:
        if attr == "weight" and is_quantized_linear(module):
            source = handle.store.source_name(module, attr)
            if handle.store.reader is None or not isinstance(source, str):
                raise BlockfoldError(f"{name} is a 4-bit weight with no checkpoint to copy its quantization state "
                                     "from: load the model from its folder")
            for companion in companion_names(handle.store.reader.names(), source):
                companions[name + companion[len(source):]] = companion
    return companions


def _saved_entries(model) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """(name, module, attribute, tensor) of everything a checkpoint holds, in state-dict order: each
    parameter once (tied ones under their first name), and the persistent buffers."""
    entries, written = [], set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for attr, param in module._parameters.items():
            if param is not None and id(param) not in written:
                written.add(id(param))
                entries.append((prefix + attr, module, attr, param))
        for attr, buffer in module._buffers.items():
            if buffer is not None and attr not in module._non_persistent_buffers_set:
                entries.append((prefix + attr, module, attr, buffer))
    return entries


def save_compressed(
    handle: ModelHandle,
    out: str | Path,
    manifest: dict,
    recipe_yaml: str,
    overwrite: bool = False,
    save_dtype: torch.dtype | None = None,
) -> Path:
    """Save weights (safetensors shards), tokenizer, manifest and recipe; nothing half written is left."""
    with staged_folder(out, overwrite) as staging:
        stored_as = write_checkpoint(handle, staging, save_dtype)
        if stored_as is not None:
            manifest["quantization"] = stored_as
        if handle.tokenizer is not None:
            handle.tokenizer.save_pretrained(staging)
        if handle.container is not None and handle.path is not None:  # what turns images into the model's input
            for name in PROCESSOR_FILES:
                if (handle.path / name).is_file() and not (staging / name).exists():
                    shutil.copyfile(handle.path / name, staging / name)
        manifest["saved_dtype"] = str(save_dtype or handle.source_dtype()).removeprefix("torch.")
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, default=str))
        (staging / RECIPE_NAME).write_text(recipe_yaml)
        license_name = source_license((manifest.get("source_model") or {}).get("path"))
        card = model_card(json.loads(json.dumps(manifest, default=str)), staging, Path(out).name, license_name)
        (staging / CARD_NAME).write_text(card)
    return Path(out).expanduser()


def read_manifest(folder: str | Path) -> dict | None:
    path = Path(folder) / MANIFEST_NAME
    return json.loads(path.read_text()) if path.is_file() else None
