"""A causal LM whose weights are resident on the device, or streamed from its checkpoint one module at a time.

Both kinds are a real ``PreTrainedModel`` object, so adapters, surgery and the pipelines address
modules the same way. In a streamed model every parameter is a placeholder on the ``meta`` device
until a pipeline asks for a module (``materialized``): its tensors are then read from the
checkpoint, the edits made so far are applied, and they are cast and moved to the device; when the
pipeline is done with the module they go back to being placeholders.

Surgery never writes weights directly: it records an edit (``transform``) per parameter, a function
on the float64 tensor. A resident model applies it at once; a streamed one when the module is next
materialized; the writer (``surgery/save.py``) applies it to the checkpoint's own tensors, so a
model calibrated in bfloat16 is saved from the float32 source with the fold computed in float64.
Parameters that exist in no checkpoint (linear replacements, trained weights) are ``own``ed: a
float32 master copy is kept on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.adapters import DecoderAdapter, get_adapter
from blockfold.errors import BlockfoldError
from blockfold.models.checkpoint import CheckpointReader
from blockfold.models.digests import file_digests
from blockfold.models.naming import load_stored, stored_tensors
from blockfold.models.quantized import dequantized_weight, is_quantized_linear, keep_standard_4bit_layout, make_plain_linear

Edit = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class WeightStore:
    """Where each parameter comes from (checkpoint name, or an owned master copy) and what was done to it,
    keyed by the module that holds it, so blocks keep their provenance when they are renumbered."""

    reader: CheckpointReader | None
    #: module → attribute → the checkpoint tensor's name, or a ``Stored`` for one kept in several tensors
    sources: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    edits: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    owned: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    @classmethod
    def of(cls, model: nn.Module, reader: CheckpointReader | None) -> "WeightStore":
        """Map every parameter of ``model`` to its tensor in ``reader`` (a tied parameter to whichever
        of its names the checkpoint holds)."""
        store = cls(reader)
        if reader is None:
            return store
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        for module_name, module in model.named_modules():
            for attr, param in module._parameters.items():
                if param is None:
                    continue
                names = aliases[id(param)]
                found = next((name for name in names if name in reader), None) or Stored.of(model, names[0], param, reader)
                if found is None:
                    stored = Stored.names(model, names[0], param)
                    missing = [name for name in stored if name not in reader]
                    if 0 < len(missing) < len(stored):  # some held: an incomplete checkpoint, not another model's
                        raise BlockfoldError(
                            f"checkpoint {reader.folder} lacks {len(missing)} of the tensors {names[0]} is stored as "
                            f"({', '.join(missing[:2])}{', ...' if len(missing) > 2 else ''}): the checkpoint is "
                            "incomplete; download it again")
                    raise BlockfoldError(
                        f"checkpoint {reader.folder} has no tensor for {names[0]}: it is not a checkpoint of this "
                        f"{type(model).__name__}, or it names its tensors differently; load it with "
                        "--pipeline whole, or re-save it with save_pretrained")
                store.sources.setdefault(module, {})[attr] = found
        return store

    def holding(self, model: nn.Module) -> "WeightStore":
        """A store whose parameters keep their checkpoint names but hold ``model``'s current values (an
        edit returning the value, where training changed it): what a trained model is saved from, so that a
        quantized source's untrained layers stay as stored and its trained ones are quantized again."""
        store = WeightStore(self.reader)
        for module in model.modules():
            for attr, param in module._parameters.items():
                if param is None:
                    continue
                value = param.detach().to("cpu")
                source = self.source_name(module, attr)
                if source is None or attr in self.owned.get(module, {}):
                    store.owned.setdefault(module, {})[attr] = value.to(torch.float32).clone()
                    continue
                store.sources.setdefault(module, {})[attr] = source
                if torch.equal(self.value(module, attr).to(value.dtype), value):
                    edits = list(self.edits.get(module, {}).get(attr, ()))
                else:
                    edits = [lambda _, trained=value.clone(): trained.double()]
                if edits:
                    store.edits.setdefault(module, {})[attr] = edits
        return store

    def source_name(self, owner: nn.Module, attr: str) -> "str | Stored | None":
        return self.sources.get(owner, {}).get(attr)

    def value(self, owner: nn.Module, attr: str) -> torch.Tensor | None:
        """The parameter as the checkpoint (or the owned copy) holds it, with every edit applied
        (then in float64); None when it has neither."""
        if attr in self.owned.get(owner, {}):
            base = self.owned[owner][attr]
        else:
            name = self.source_name(owner, attr)
            if name is None or self.reader is None:
                return None
            base = name.read(self.reader) if isinstance(name, Stored) else self.reader.get(name)
        edits = self.edits.get(owner, {}).get(attr, ())
        if edits:
            base = base.double()
            for edit in edits:
                base = edit(base)
        return base


@dataclass(frozen=True)
class Stored:
    """A parameter the checkpoint keeps as several tensors (one per expert, say), rebuilt as
    transformers rebuilds it on load (``models/naming.py``)."""

    parameter: str
    tensors: tuple[str, ...]
    model: weakref.ref

    @staticmethod
    def names(model: nn.Module, parameter: str, param: torch.Tensor) -> list[str]:
        """The tensors ``parameter`` is stored as, or none where it is stored under its own name."""
        stored = stored_tensors(model, parameter, torch.empty(param.shape, dtype=param.dtype, device="meta"))
        return [] if parameter in stored else list(stored)

    @classmethod
    def of(cls, model: nn.Module, parameter: str, param: torch.Tensor, reader: CheckpointReader) -> "Stored | None":
        """The stored form of ``parameter`` when ``reader`` holds all of it, else None."""
        names = cls.names(model, parameter, param)
        if not names or not all(name in reader for name in names):
            return None
        return cls(parameter, tuple(names), weakref.ref(model))

    def read(self, reader: CheckpointReader) -> torch.Tensor:
        return load_stored(self.model(), {name: reader.get(name) for name in self.tensors})[self.parameter]

    def __str__(self) -> str:
        return f"{self.parameter} from {len(self.tensors)} tensors ({self.tensors[0]}, ...)"


def _is_placeholder(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"


@dataclass
class ModelHandle:
    """A model, its tokenizer and adapter, where it runs (``device``, ``dtype``) and where its weights live."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    device: torch.device
    dtype: torch.dtype
    store: WeightStore
    spec: str = ""
    path: Path | None = None  # the local folder the weights came from
    #: the checkpoint of two networks ``model`` is one of (a multimodal model's language model, a dual encoder's
    #: vision tower; ``models/multimodal.py``): what is saved
    container: PreTrainedModel | None = None

    def __post_init__(self) -> None:
        self.adapter: DecoderAdapter = get_adapter(self.model)
        keep_standard_4bit_layout(self.model)

    @property
    def saved_model(self) -> PreTrainedModel:
        """The model a checkpoint is written from: the wrapper around the compressed network, if any."""
        return self.container if self.container is not None else self.model

    # -- what it is -------------------------------------------------------------------------
    @property
    def resident(self) -> bool:
        """True when every parameter is a real tensor (no placeholders)."""
        return not any(_is_placeholder(p) for p in self.model.parameters())

    @property
    def config(self):
        return self.model.config

    def num_layers(self) -> int:
        return self.adapter.num_layers(self.model)

    def layers(self) -> nn.ModuleList:
        return self.adapter.layers(self.model)

    def source_dtype(self) -> torch.dtype:
        """The checkpoint's own floating dtype (the resident model's, without a checkpoint)."""
        return self.store.reader.floating_dtype() if self.store.reader is not None else self.model.dtype

    def fingerprint(self) -> str:
        """A short content hash: of the weights for a resident model; for a streamed one, of the
        checkpoint's tensor names, shapes and dtypes and of its files' bytes (hashed once per file,
        ``models/digests.py``: a fine-tune with the same shards gets another key), which tensor each
        parameter is now, and the edited or owned ones' values (a fold or a removal changes the
        fingerprint, so a cached pass is never served to changed weights)."""
        if self.resident:
            from blockfold.models.sources import model_fingerprint

            return model_fingerprint(self.model)
        digest = hashlib.sha256()
        reader, store = self.store.reader, self.store
        for name in sorted(reader.names()):
            digest.update(f"{name} {reader.shape(name)} {reader.dtype(name)}".encode())
        files = sorted(reader.folder.glob("*.safetensors"))
        contents = file_digests(files)
        for path in files:
            digest.update(f"{path.name} {contents[path]}".encode())
        for module_name, module in self.model.named_modules():
            for attr, param in module._parameters.items():
                if param is None:
                    continue
                digest.update(f"{module_name}.{attr} {store.source_name(module, attr)}".encode())
                if store.edits.get(module, {}).get(attr) or attr in store.owned.get(module, {}):
                    flat = store.value(module, attr).reshape(-1)
                    digest.update(flat[:: max(1, flat.numel() // 4096)].double().cpu().numpy().tobytes())
        return digest.hexdigest()[:16]

    # -- running modules --------------------------------------------------------------------
    @contextlib.contextmanager
    def materialized(self, *modules: nn.Module) -> Iterator[None]:
        """Within the block, every parameter and buffer of ``modules`` is a real tensor on the
        device in the runtime dtype; afterwards what was loaded for the block is released."""
        restore: list[tuple[dict, str, torch.Tensor]] = []
        try:
            for module in modules:
                for owner in module.modules():
                    for attr, param in list(owner._parameters.items()):
                        if param is None or (param.device == self.device and not _is_placeholder(param)):
                            continue
                        value = self.store.value(owner, attr) if _is_placeholder(param) else param.detach()
                        if value is None:
                            raise BlockfoldError(f"no weights for {type(owner).__name__}.{attr}: the model was built "
                                                 "without a checkpoint; load it from a folder")
                        if value.is_floating_point():
                            value = value.to(self.dtype)
                        restore.append((owner._parameters, attr, param))
                        owner._parameters[attr] = nn.Parameter(value.to(self.device), requires_grad=False)
                    for attr, buffer in list(owner._buffers.items()):
                        if buffer is not None and buffer.device != self.device:
                            restore.append((owner._buffers, attr, buffer))
                            owner._buffers[attr] = buffer.to(self.device)
            yield
        finally:
            for table, attr, original in reversed(restore):
                table[attr] = original

    def top_modules(self) -> list[nn.Module]:
        """The decoder's modules outside its blocks (embeddings, rotary tables, final norm)."""
        return self.adapter.outside_modules(self.model)

    def head_modules(self) -> list[nn.Module]:
        """What turns the last hidden state into logits: the final norm and the LM head."""
        decoder = self.adapter.decoder(self.model)
        return [getattr(decoder, self.adapter.final_norm_attr), self.model.get_output_embeddings()]

    def copy_of(self, module: nn.Module) -> nn.Module:
        """A materialized private copy of a small module (a norm), for fits that call it many times."""
        with self.materialized(module):
            return copy.deepcopy(module)

    # -- editing ----------------------------------------------------------------------------
    @torch.no_grad()
    def transform(self, owner: nn.Module, attr: str, edit: Edit) -> None:
        """Record ``edit`` (float64 tensor → float64 tensor, on whatever device it is given, the meta
        device included) for ``owner.attr``; a real tensor is updated at once, a placeholder when next
        materialized. An edit may change the tensor's shape (a slice of the hidden dimension): the
        parameter is then replaced, placeholder by placeholder. A bitsandbytes 4-bit layer becomes a
        plain linear layer first (``models/quantized.py``)."""
        if is_quantized_linear(owner):  # edited in float: the layer is dequantized once, saved unquantized
            weight = dequantized_weight(owner)
            make_plain_linear(owner, weight.to(self.device, self.dtype))
            self.own(owner, "weight", weight)
        self.store.edits.setdefault(owner, {}).setdefault(attr, []).append(edit)
        param = owner._parameters[attr]
        if _is_placeholder(param):
            shape = edit(torch.empty(param.shape, dtype=torch.float64, device="meta")).shape
            if shape != param.shape:
                owner._parameters[attr] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"),
                                                       requires_grad=False)
            return
        edited = edit(param.double()).to(param.dtype)
        if edited.shape == param.shape:
            param.copy_(edited)
        else:
            owner._parameters[attr] = nn.Parameter(edited, requires_grad=False)

    @torch.no_grad()
    def own(self, owner: nn.Module, attr: str, value: torch.Tensor) -> None:
        """Give ``owner.attr`` a value that comes from no checkpoint: a float32 master copy on the
        CPU, from which the runtime tensor (and the saved one) is derived."""
        master = value.detach().to("cpu", torch.float32).clone()
        self.store.owned.setdefault(owner, {})[attr] = master
        self.store.edits.get(owner, {}).pop(attr, None)
        param = owner._parameters[attr]
        if self.resident:
            # a copy even where device and dtype match: an edit made in place must not reach the master
            owner._parameters[attr] = nn.Parameter(master.to(self.device, self.dtype, copy=True), requires_grad=False)
        else:
            owner._parameters[attr] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)

    def saved_value(self, owner: nn.Module, attr: str) -> torch.Tensor:
        """What a checkpoint written now holds for ``owner.attr``: the source (or owned copy) with
        the edits applied, or, for a model built in memory, the tensor itself."""
        value = self.store.value(owner, attr)
        if value is None:
            param = owner._parameters[attr]
            if _is_placeholder(param):
                raise BlockfoldError(f"no weights for {type(owner).__name__}.{attr}: nothing to save")
            value = param.detach()
        return value

    def fresh_copy(self) -> "ModelHandle":
        """An unedited twin for another compression of the same weights (a sweep): a deep copy of a
        resident model, a new skeleton over the same checkpoint for a streamed one."""
        from blockfold.models.multimodal import compressed_view

        if self.resident:
            saved = copy.deepcopy(self.saved_model)
            store = WeightStore.of(saved, self.store.reader) if self.store.reader is not None else WeightStore(None)
            for original, twin in zip(self.saved_model.modules(), saved.modules()):
                if original in self.store.owned:
                    store.owned[twin] = dict(self.store.owned[original])
                if original in self.store.edits:
                    store.edits[twin] = {k: list(v) for k, v in self.store.edits[original].items()}
        else:
            from blockfold.models.sources import skeleton

            # a config of its own: from_config keeps the object it is given, and the twin's surgery edits
            # its layer count (a shared one broke every later twin of a streamed model)
            saved = skeleton(copy.deepcopy(self.saved_model.config), self.dtype)
            store = WeightStore.of(saved, self.store.reader)
        model = compressed_view(saved)
        return ModelHandle(model, self.tokenizer, self.device, self.dtype, store, self.spec, self.path,
                           saved if model is not saved else None)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the weights in the runtime dtype: per block (the largest), and outside the blocks."""
        element = torch.finfo(self.dtype).bits // 8
        layers = self.layers()
        per_layer = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0) * element
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        outside = sum(p.numel() for p in self.model.parameters() if id(p) not in in_layers) * element
        return {"per_layer": per_layer, "outside_layers": outside, "total": per_layer * len(layers) + outside}
