"""Export a checkpoint (a blockfold output or any supported model) to GGUF for llama.cpp.

Follows the conventions of llama.cpp's own converter: the llama architecture's query and key rows
permuted into interleaved rotary order, Gemma's norm weights stored with their ``1 +`` offset, 1-D
tensors in float32, a quantized type falling back to float16 for rows its blocks do not divide.

A Hugging Face folder gets llama.cpp's hyperparameters and tokenizer from its config.json and
tokenizer.json (``gguf_metadata``). A model that came from a GGUF file keeps that file's metadata (tokenizer, license, rope settings),
with the per-layer fields cut to the blocks that remain, and with ``--quant source`` every tensor
compression did not touch is copied byte for byte: the round trip a CPU user wants. The tensors
compression changed (the folded down-projection) are quantized again from the float32 fold at Q8_0,
or at their old type where that has 8 bits or more.

Written tensor by tensor into a staging file that is renamed into place when complete.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import (
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    ReaderTensor,
    LlamaFileType,
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    get_tensor_name_map,
)
from gguf.quants import quant_shape_to_byte_shape, quantize
from gguf.constants import GGML_QUANT_SIZES
from transformers import AutoConfig

from blockfold.adapters import get_adapter
from blockfold.errors import BlockfoldError
from blockfold.export.choices import QUANT_TYPE_NAMES, SOURCE
from blockfold.export.gguf_metadata import config_metadata, llama3_rope_factors, tokenizer_metadata
from blockfold.export.kquants import K_FILE_TYPES, k_quant_type, quantize_k
from blockfold.jsonfile import staged_file
from blockfold.models.checkpoint import CheckpointReader
from blockfold.models.multimodal import is_vision
from blockfold.progress import bar
from blockfold.settings import methods_where
from blockfold.surgery.card import source_license

log = logging.getLogger(__name__)

Q = GGMLQuantizationType

#: ``--quant`` names a uniform export can write (the ``gguf`` package quantizes these itself)
QUANT_TYPES: dict[str, GGMLQuantizationType] = {name: GGMLQuantizationType[name.upper()] for name in QUANT_TYPE_NAMES}
_FILE_TYPES = {Q.F32: LlamaFileType.ALL_F32, Q.F16: LlamaFileType.MOSTLY_F16, Q.BF16: LlamaFileType.MOSTLY_BF16,
               Q.Q8_0: LlamaFileType.MOSTLY_Q8_0, Q.Q4_0: LlamaFileType.MOSTLY_Q4_0,
               Q.Q4_1: LlamaFileType.MOSTLY_Q4_1, Q.Q5_0: LlamaFileType.MOSTLY_Q5_0,
               Q.Q5_1: LlamaFileType.MOSTLY_Q5_1}
#: what a tensor compression changed is stored in, at the least, in a ``--quant source`` export: the
#: fold is computed in float32, and quantizing it again at a 4-bit source type costs far more than
#: the source's own quantization did (SmolLM2 ReplaceMe 8/30, Q4_1 source, llama.cpp perplexity on 20
#: WikiText-2 windows: 135.1 with the folded down-projection in Q4_1, 126.9 in Q8_0, 126.8 all f16),
#: for a few hundred kB
_AT_LEAST_8_BITS = {Q.F32, Q.F16, Q.BF16, Q.Q8_0}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class Architecture:
    """What llama.cpp calls a Hugging Face ``model_type`` and how its tensors differ from transformers'."""

    arch: MODEL_ARCH
    permute_qk: bool = False  # llama.cpp's llama graph applies rotary embeddings to interleaved pairs
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w
    #: a mixture of experts: whether llama.cpp's graph rescales the chosen experts' weights to sum to 1
    #: (it hard-codes the family's usual choice; a config asking otherwise is refused)
    renormalizes_experts: bool | None = None
    #: llama.cpp's loader wants ``output.weight`` even where the model ties it to the embeddings
    requires_output: bool = False


ARCHITECTURES = {
    "llama": Architecture(MODEL_ARCH.LLAMA, permute_qk=True),
    "mistral": Architecture(MODEL_ARCH.LLAMA, permute_qk=True),
    "qwen2": Architecture(MODEL_ARCH.QWEN2),
    "qwen3": Architecture(MODEL_ARCH.QWEN3),
    "gemma2": Architecture(MODEL_ARCH.GEMMA2, norm_offset=1.0),
    "gemma3_text": Architecture(MODEL_ARCH.GEMMA3, norm_offset=1.0),
    # mixtures of experts: every block sparse, the experts stacked into one tensor per projection
    "mixtral": Architecture(MODEL_ARCH.LLAMA, permute_qk=True, renormalizes_experts=True),
    "qwen2_moe": Architecture(MODEL_ARCH.QWEN2MOE, renormalizes_experts=False, requires_output=True),
    "qwen3_moe": Architecture(MODEL_ARCH.QWEN3MOE, renormalizes_experts=True),
    "olmoe": Architecture(MODEL_ARCH.OLMOE, renormalizes_experts=False, requires_output=True),
}
#: one expert's projection as transformers saves it (Mixtral's w1/w2/w3, the others' *_proj)
_EXPERT = re.compile(r"^(?P<experts>model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(?P<index>\d+)\."
                     r"(?P<projection>\w+)\.weight$")


def export_gguf(model: str | Path, out: str | Path, quant: str = "f16", overwrite: bool = False,
                tokenizer_pre: str | None = None) -> Path:
    """Write ``model`` (a Hugging Face folder, e.g. a blockfold output) to the GGUF file ``out``.
    ``tokenizer_pre`` names llama.cpp's pre-tokenizer where blockfold cannot tell it from the
    tokenizer's own (a folder that came from a GGUF file keeps that file's)."""
    model, out = Path(model).expanduser(), Path(out).expanduser()
    if out.suffix != ".gguf":
        raise BlockfoldError(f"export target {out} must end in .gguf (llama.cpp finds GGUF files by that suffix)")
    if out.exists() and not overwrite:
        raise BlockfoldError(f"{out} exists: pass --overwrite to replace it, or choose another file")
    quant = _as_source_type(model, quant)
    if quant != SOURCE and quant not in QUANT_TYPES and quant not in K_FILE_TYPES:
        raise BlockfoldError(f"--quant {quant!r} is not a type blockfold writes: choose one of "
                             f"{', '.join([*QUANT_TYPES, *K_FILE_TYPES, SOURCE])} (for others, export f16 and run "
                             "llama.cpp's llama-quantize)")
    plan = _plan(model, quant, tokenizer_pre)
    with staged_file(out) as staging:
        _write(plan, staging)
    log.info("wrote %s (%.1f MB, %d tensors, %d copied unchanged from the source GGUF)", out,
             out.stat().st_size / 1e6, len(plan.tensors), sum(t.copied_from is not None for t in plan.tensors))
    return out


@dataclass
class _Tensor:
    gguf_name: str
    hf_name: str | None  # the transformers name llama.cpp's converter maps (for stacked experts, the stack's)
    copied_from: ReaderTensor | None  # copied byte for byte from this tensor of the source GGUF, or
    values: np.ndarray | None  # computed here (llama.cpp's tensors transformers keeps in its config), or
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical shape, numpy order
    parts: tuple[str, ...] = ()  # read from these checkpoint tensors: one, or one per expert, stacked

    def read(self, reader: CheckpointReader) -> torch.Tensor:
        if len(self.parts) == 1:
            return reader.get(self.parts[0]).reshape(self.shape)
        return torch.stack([reader.get(name) for name in self.parts])


def _checkpoint_tensors(reader: CheckpointReader, model: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Each tensor llama.cpp stores, by the name its converter maps, with the checkpoint tensors it is
    made of: itself, or (a mixture's experts) every expert's projection stacked in expert order."""
    entries: list[tuple[str, tuple[str, ...]]] = []
    stacks: dict[str, dict[int, str]] = {}
    for name in reader.names():
        match = _EXPERT.match(name)
        if match is None:
            entries.append((name, (name,)))
            continue
        stacked = f"{match['experts']}.{match['projection']}.weight"
        if stacked not in stacks:
            stacks[stacked] = {}
            entries.append((stacked, ()))
        stacks[stacked][int(match["index"])] = name
    for position, (name, parts) in enumerate(entries):
        if name in stacks:
            experts = stacks[name]
            if sorted(experts) != list(range(len(experts))):
                missing = sorted(set(range(max(experts) + 1)) - set(experts))
                raise BlockfoldError(f"{model}: {name.removesuffix('.weight')} has no tensor for expert(s) "
                                     f"{', '.join(map(str, missing))}: export the complete checkpoint")
            entries[position] = (name, tuple(experts[index] for index in range(len(experts))))
    return entries


def _refuse_experts_llama_cpp_runs_otherwise(config, architecture: Architecture, model: Path, quant: str) -> None:
    """llama.cpp's graphs for the mixture-of-experts families hard-code what transformers reads from the
    config: every block sparse, the experts' weights renormalized (or not) as the family usually does."""
    if architecture.renormalizes_experts is None:
        return
    name = MODEL_ARCH_NAMES[architecture.arch]
    dense = get_adapter(config).dense_layers(config)
    if dense:
        raise BlockfoldError(f"{model}: blocks {', '.join(map(str, dense))} are dense in a mixture of experts, and "
                             f"llama.cpp's {name} graph runs experts in every block; serve it with transformers or vLLM")
    renormalizes = getattr(config, "norm_topk_prob", True)  # Mixtral always renormalizes and has no such field
    if renormalizes != architecture.renormalizes_experts:
        raise BlockfoldError(f"{model}: its config says norm_topk_prob={renormalizes}, and llama.cpp's {name} graph "
                             f"always computes it as {architecture.renormalizes_experts}; serve it with transformers "
                             "or vLLM")
    if architecture.arch == MODEL_ARCH.OLMOE and config.num_key_value_heads != config.num_attention_heads:
        raise BlockfoldError(f"{model}: {config.num_key_value_heads} key-value heads for {config.num_attention_heads} "
                             "query heads, and llama.cpp's olmoe graph norms keys as wide as queries (OLMoE's own "
                             "layout); serve it with transformers or vLLM")
    if getattr(config, "clip_qkv", None) is not None:
        raise BlockfoldError(f"{model}: its config clips q, k and v at {config.clip_qkv}, which llama.cpp's {name} "
                             "graph does not; serve it with transformers or vLLM")
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if quant in K_FILE_TYPES and experts == 8:
        raise BlockfoldError(f"--quant {quant}: llama-quantize gives 8-expert models their own types, which "
                             "blockfold does not reproduce; export --quant f16 and run llama.cpp's llama-quantize")


@dataclass
class _Plan:
    model: Path
    config: object
    architecture: Architecture
    metadata: list[tuple[str, object, GGUFValueType, GGUFValueType | None]]
    tensors: list[_Tensor]
    file_type: LlamaFileType | None


def _plan(model: Path, quant: str, tokenizer_pre: str | None = None) -> _Plan:
    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise BlockfoldError(f"{model} is not a Hugging Face model folder ({str(error).splitlines()[0]}): "
                             "export a folder written by `blockfold compress` or save_pretrained") from None
    model_type = config.model_type
    if getattr(config, "quantization_config", None) is not None:
        raise BlockfoldError(f"{model} is a quantized transformers checkpoint (its weights are packed for "
                             "bitsandbytes or compressed-tensors, not float): export the float model's compressed "
                             "output, or compress the model's GGUF file and export that with --quant source")
    if model_type.startswith("blockfold_"):
        what = ("stores its projections as two low-rank factors (SVD-LLM), which no llama.cpp architecture expresses"
                if getattr(config, "blockfold_low_rank", None) else
                "is sliced with tied embeddings or LayerNorms (SliceGPT: blockfold's class, with a map after the "
                "final norm or RMSNorms where LayerNorms were), which no llama.cpp architecture expresses (an RMSNorm "
                "model with untied embeddings slices into a stock checkpoint that exports)"
                if getattr(config, "blockfold_sliced", None) else
                "gives its blocks different numbers of heads and MLP channels (LLM-Pruner), which blockfold's GGUF "
                "writer does not express" if getattr(config, "blockfold_pruned", None) else
                "replaces sublayers by linear maps (NBL), which no llama.cpp architecture expresses (a layer whose "
                "attention is `W x + b` with no KV cache)")
        raise BlockfoldError(
            f"{model} {what}: serve it with transformers, or export the output of a method that writes a standard "
            f"checkpoint ({', '.join(methods_where(lambda m: m.writes_standard_checkpoint))})")
    if is_vision(config):
        raise BlockfoldError(f"{model} is an image encoder ({model_type!r}): llama.cpp's GGUF files hold language "
                             "models; serve it with transformers (AutoModel.from_pretrained loads it as it is)")
    if getattr(config, "text_config", None) is not None and model_type not in ARCHITECTURES:
        raise BlockfoldError(f"{model} is a multimodal checkpoint ({model_type!r}): llama.cpp takes its language model "
                             "and its vision projector as two files (a GGUF and an mmproj), which blockfold does not "
                             "write; serve it with transformers or vLLM")
    if model_type not in ARCHITECTURES:
        raise BlockfoldError(f"GGUF export supports model types {', '.join(ARCHITECTURES)}; {model} is "
                             f"{model_type!r}")
    architecture = ARCHITECTURES[model_type]
    _refuse_experts_llama_cpp_runs_otherwise(config, architecture, model, quant)
    manifest = _manifest(model)
    kept = _kept_blocks(manifest, config.num_hidden_layers)
    found = _source_gguf(manifest, model)
    if quant == SOURCE and found is None:
        raise BlockfoldError(f"--quant source keeps the types of the GGUF file a model came from, and {model} did not "
                             "come from one: choose a type, e.g. --quant f16 or q8_0")
    reader = CheckpointReader(model)
    source = _SourceGGUF(*found) if found else None
    names_now = get_tensor_name_map(architecture.arch, config.num_hidden_layers)
    tied = "lm_head.weight" not in reader.names()
    entries = _checkpoint_tensors(reader, model)
    if tied and architecture.requires_output:  # the head llama.cpp wants, a copy of the embeddings
        entries.append(("lm_head.weight", ("model.embed_tokens.weight",)))
        tied = False  # as llama-quantize sees the file: it has an output.weight
    tensors = []
    for hf_name, parts in entries:
        gguf_name = names_now.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise BlockfoldError(f"{model}: no GGUF name for tensor {hf_name} of {model_type}; this checkpoint does "
                                 "not match llama.cpp's layout for its architecture")
        shape = (len(parts), *reader.shape(parts[0])) if len(parts) > 1 else tuple(reader.shape(parts[0]))
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):  # a (1, hidden) row that llama.cpp reads as a vector
            shape = shape[1:]
        copied = source.unchanged(hf_name, parts, kept, reader) if (source and quant == SOURCE) else None
        if copied is not None:
            tensors.append(_Tensor(gguf_name, hf_name, copied, None, copied.tensor_type, shape))
            continue
        if len(shape) < 2:
            qtype = Q.F32
        elif quant == SOURCE:  # changed by compression: at least 8 bits (see _AT_LEAST_8_BITS)
            old = source.type_of(hf_name, kept)
            qtype = _fits(old if old in _AT_LEAST_8_BITS else Q.Q8_0, shape)
        elif quant in K_FILE_TYPES:  # llama-quantize's choice per tensor, with its fallbacks for short rows
            block = _BLOCK.match(gguf_name)
            qtype = k_quant_type(quant, gguf_name, shape, int(block.group(1)) if block else None,
                                 config.num_hidden_layers, tied_embeddings=tied)
        else:
            qtype = _fits(QUANT_TYPES[quant], shape)
        tensor = _Tensor(gguf_name, hf_name, None, None, qtype, shape, parts)
        if qtype != Q.F32 and _below_float16(tensor.read(reader)):
            tensor.qtype = Q.F32
        tensors.append(tensor)
    rope_factors = llama3_rope_factors(config)
    if rope_factors is not None:
        tensors.append(_Tensor("rope_freqs.weight", None, None, rope_factors, Q.F32, rope_factors.shape))
    if source:
        metadata = source.metadata(architecture, kept)
    else:
        metadata = _metadata_from_config(config, architecture, model, manifest, tokenizer_pre)
    metadata += _layer_metadata(config, architecture, manifest)
    if quant == SOURCE:
        file_type = source.file_type
    else:
        file_type = K_FILE_TYPES[quant] if quant in K_FILE_TYPES else _FILE_TYPES[QUANT_TYPES[quant]]
    return _Plan(model, config, architecture, metadata, tensors, file_type)


def _as_source_type(model: Path, quant: str) -> str:
    """A K-quant file type (``q4_k_m``, ...) names the round trip when it is the source GGUF's own type:
    that is ``source``; other K-quant targets stay refused (the ``gguf`` package cannot write them)."""
    if quant in QUANT_TYPES or quant == SOURCE:
        return quant
    found = _source_gguf(_manifest(model), model)
    if found is None:
        return quant
    field = GGUFReader(found[0]).fields.get("general.file_type")
    if field is not None and LlamaFileType(int(field.contents())).name.lower() == f"mostly_{quant.lower()}":
        return SOURCE
    return quant


def _below_float16(weight: torch.Tensor) -> bool:
    """Whether float16 (the type of every 16-bit tensor and of every quantized block's scale) would
    flush ``weight`` to zero: true of Gemma's linearized-norm fold, whose down-projection is scaled
    by about 1e-10 so that the norm after it works in its linear range. Such tensors go out in
    float32, whatever the requested type."""
    return bool(weight.abs().max() < torch.finfo(torch.float16).tiny)


def _fits(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> GGMLQuantizationType:
    """``qtype``, or float16 where its block size does not divide a row (llama.cpp's converter does the same)."""
    block = GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else Q.F16


def _manifest(model: Path) -> dict:
    path = model / "blockfold_manifest.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _kept_blocks(manifest: dict, num_layers: int) -> list[int]:
    """The source's block index of each block that remains."""
    original = manifest.get("original_num_layers", num_layers)
    removed = set(manifest.get("removed_blocks") or [])
    kept = [index for index in range(original) if index not in removed]
    if len(kept) != num_layers:
        raise BlockfoldError(f"the manifest says {original} - {len(removed)} blocks remain but the config has "
                             f"{num_layers}: the folder was edited after compression; export the original output")
    return kept


def _source_gguf(manifest: dict, model: Path) -> tuple[Path, Path] | None:
    """The GGUF file the model was converted from and the folder it was converted into, where
    blockfold recorded them (the model itself, or the source its manifest names)."""
    for folder in (model, Path((manifest.get("source_model") or {}).get("path") or model)):
        record = folder / "blockfold_source.json"
        if record.is_file():
            path = Path(json.loads(record.read_text()).get("gguf") or "")
            if path.is_file():
                return path, folder
    return None


class _SourceGGUF:
    """The GGUF file (and its converted folder) a model came from: metadata and unchanged tensors."""

    def __init__(self, path: Path, converted: Path):
        self.path = path
        self.reader = GGUFReader(path)
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        self.arch = str(self.reader.fields["general.architecture"].contents())
        self.original_layers = int(self.reader.fields[f"{self.arch}.block_count"].contents())
        self.names = get_tensor_name_map(_arch_of(self.arch), self.original_layers)
        self.converted = CheckpointReader(converted)
        field = self.reader.fields.get("general.file_type")
        self.file_type = LlamaFileType(int(field.contents())) if field is not None else None

    def _source_name(self, hf_name: str, kept: list[int]) -> str:
        return _LAYER.sub(lambda m: f"model.layers.{kept[int(m.group(1))]}.", hf_name)

    def type_of(self, hf_name: str, kept: list[int]) -> GGMLQuantizationType | None:
        name = self.names.get_name(self._source_name(hf_name, kept), try_suffixes=(".weight", ".bias"))
        return self.tensors[name].tensor_type if name in self.tensors else None

    def unchanged(self, hf_name: str, parts: tuple[str, ...], kept: list[int], reader: CheckpointReader):
        """The source's GGUF tensor for ``hf_name`` when compression left every part of it bit for bit as
        converted."""
        gguf_name = self.names.get_name(self._source_name(hf_name, kept), try_suffixes=(".weight", ".bias"))
        sources = [self._source_name(part, kept) for part in parts]
        if gguf_name not in self.tensors or any(source not in self.converted for source in sources):
            return None
        if all(torch.equal(reader.get(part), self.converted.get(source)) for part, source in zip(parts, sources)):
            return self.tensors[gguf_name]
        return None

    def metadata(self, architecture: Architecture, kept: list[int]) -> list:
        """Every field of the source but its file layout, per-layer arrays cut to the kept blocks."""
        if _arch_of(self.arch) != architecture.arch:
            raise BlockfoldError(f"{self.path} is GGUF architecture {self.arch!r} but the model exports as "
                                 f"{MODEL_ARCH_NAMES[architecture.arch]!r}: export with a type, e.g. --quant f16")
        fields = []
        for name, field in self.reader.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
                continue
            value = field.contents()
            main = field.types[0]
            sub = field.types[-1] if main == GGUFValueType.ARRAY else None
            if name.startswith(f"{self.arch}.") and isinstance(value, list) and len(value) == self.original_layers:
                value = [value[index] for index in kept]
            fields.append((name, value, main, sub))
        return fields


def _arch_of(name: str) -> MODEL_ARCH:
    for arch, arch_name in MODEL_ARCH_NAMES.items():
        if arch_name == name:
            return arch
    raise BlockfoldError(f"unknown GGUF architecture {name!r}")


def _metadata_from_config(config, architecture: Architecture, model: Path, manifest: dict,
                          tokenizer_pre: str | None) -> list:
    """llama.cpp's fields for a folder that did not come from a GGUF file, named after its source."""
    source = (manifest.get("source_model") or {}).get("path")
    name = Path(source).name if source else model.name
    license_name = source_license(model) or source_license(source)
    arch = MODEL_ARCH_NAMES[architecture.arch]
    return config_metadata(config, arch, name, license_name) + tokenizer_metadata(model, config, tokenizer_pre)


def _layer_metadata(config, architecture: Architecture, manifest: dict) -> list:
    """The fields compression changes, from the exported config (they override the source's)."""
    arch = MODEL_ARCH_NAMES[architecture.arch]
    fields = [(f"{arch}.block_count", config.num_hidden_layers, GGUFValueType.UINT32, None)]
    layer_types = getattr(config, "layer_types", None)
    if architecture.arch == MODEL_ARCH.GEMMA3 and layer_types and getattr(config, "sliding_window", None):
        # llama.cpp assumes every sixth layer global unless told per layer; removal breaks that rhythm
        fields.append((f"{arch}.attention.sliding_window_pattern",
                       [kind == "sliding_attention" for kind in layer_types], GGUFValueType.ARRAY,
                       GGUFValueType.BOOL))
    if manifest:
        removed = manifest.get("removed_blocks") or []
        fields.append(("blockfold.method", str(manifest.get("method", "")), GGUFValueType.STRING, None))
        fields.append(("blockfold.removed_blocks", removed or [-1], GGUFValueType.ARRAY, GGUFValueType.INT32))
    return fields


def _write(plan: _Plan, path: Path) -> None:
    arch = MODEL_ARCH_NAMES[plan.architecture.arch]
    writer = GGUFWriter(path, arch)
    fields = {}
    for name, value, main, sub in plan.metadata:  # a later entry (this export's) replaces the source's
        fields[name] = (value, main, sub)
    for name, (value, main, sub) in fields.items():
        writer.add_key_value(name, value, main, sub_type=sub)
    if plan.file_type is not None:
        writer.add_file_type(plan.file_type)
    reader = CheckpointReader(plan.model)
    for tensor in plan.tensors:
        if tensor.copied_from is not None:
            data = tensor.copied_from.data
            writer.add_tensor_info(tensor.gguf_name, data.shape, data.dtype, data.nbytes, raw_dtype=tensor.qtype)
        elif tensor.values is not None:
            writer.add_tensor_info(tensor.gguf_name, tensor.values.shape, tensor.values.dtype, tensor.values.nbytes,
                                   raw_dtype=tensor.qtype)
        else:
            dtype, nbytes = _encoded_size(tensor.qtype, tensor.shape)
            writer.add_tensor_info(tensor.gguf_name, _info_shape(tensor.qtype, tensor.shape), dtype, nbytes,
                                   raw_dtype=tensor.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        for tensor in bar(plan.tensors, desc=f"writing {path.name.removeprefix('.').split('.partial')[0]}",
                           unit="tensor"):
            if tensor.copied_from is not None:
                writer.write_tensor_data(np.asarray(tensor.copied_from.data))
            elif tensor.values is not None:
                writer.write_tensor_data(tensor.values)
            else:
                writer.write_tensor_data(_encode(_gguf_layout(tensor.read(reader), tensor.hf_name, plan),
                                                 tensor.qtype))
    finally:
        writer.close()


def _gguf_layout(weight: torch.Tensor, hf_name: str, plan: _Plan) -> np.ndarray:
    """The tensor as llama.cpp's converter stores it."""
    weight = weight.float()
    architecture, config = plan.architecture, plan.config
    if architecture.permute_qk and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
        weight = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2)
        weight = weight.reshape(-1, *weight.shape[3:])
    if architecture.norm_offset and hf_name.endswith("norm.weight"):
        weight = weight + architecture.norm_offset
    return weight.contiguous().numpy()


def _encode(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == Q.F32:
        return data.astype(np.float32)
    if qtype == Q.F16:
        return data.astype(np.float16)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return quantize_k(data.astype(np.float32), qtype)
    return quantize(data.astype(np.float32), qtype)


def _info_shape(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[int, ...]:
    return quant_shape_to_byte_shape(shape, qtype) if qtype not in (Q.F32, Q.F16) else shape


def _encoded_size(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[np.dtype, int]:
    if qtype == Q.F32:
        return np.dtype(np.float32), 4 * int(np.prod(shape))
    if qtype == Q.F16:
        return np.dtype(np.float16), 2 * int(np.prod(shape))
    return np.dtype(np.uint8), int(np.prod(quant_shape_to_byte_shape(shape, qtype)))
