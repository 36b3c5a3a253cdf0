"""Safetensors checkpoints read and written one tensor at a time.

``CheckpointReader`` opens a Hugging Face folder (``model.safetensors``, or shards named by
``model.safetensors.index.json``) and hands out single tensors, so a model larger than memory can
be read layer by layer. ``ShardWriter`` writes tensors as they come into shards of bounded size,
then names them and writes the index the way ``save_pretrained`` does, so plain transformers loads
the result; peak memory is one shard.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from blockfold.errors import BlockfoldError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: shard size of written checkpoints: small enough that one shard in memory is cheap next to a
#: layer-by-layer run, large enough that a 70B model has a few dozen files
DEFAULT_SHARD_BYTES = 2 << 30

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def has_safetensors(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()


class CheckpointReader:
    """Tensors of a safetensors checkpoint by name, each read only when asked for."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError):
                raise BlockfoldError(f"{index} is not a safetensors index (no weight_map): re-save the model "
                                     "with save_pretrained") from None
        elif (self.folder / SINGLE_FILE).is_file():
            weight_map = None
        else:
            raise BlockfoldError(f"{self.folder} has no {SINGLE_FILE} or {INDEX_FILE}: blockfold streams safetensors "
                                 "checkpoints; re-save the model with save_pretrained(safe_serialization=True)")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        missing = [name for name in files if not (self.folder / name).is_file()]
        if missing:
            raise BlockfoldError(f"checkpoint {self.folder} is incomplete: {len(missing)} of {len(files)} shards are "
                                 f"missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); download "
                                 "the whole checkpoint again")
        self._file_of: dict[str, str] = {}
        self._meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for name in files:
            with self._open(name) as handle:
                for key in handle.keys():
                    self._file_of[key] = name
                    tensor_slice = handle.get_slice(key)
                    self._meta[key] = (_DTYPES.get(tensor_slice.get_dtype(), torch.float32),
                                       tuple(tensor_slice.get_shape()))

    def _open(self, name: str):
        """A fresh handle per read: safetensors memory-maps the file, and pages read through a handle
        that stays open would stay in this process's resident memory (the whole model, by the end)."""
        try:
            return safe_open(str(self.folder / name), framework="pt")
        except Exception as err:  # truncated or foreign file
            raise BlockfoldError(f"cannot read {self.folder / name} ({err}): the file is damaged; download it "
                                 "again") from None

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][0]

    def nbytes(self, name: str) -> int:
        dtype, shape = self._meta[name]
        return int(torch.Size(shape).numel()) * dtype.itemsize

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``, in its stored dtype, copied into CPU memory of its own (not the mapping)."""
        if name not in self._file_of:
            raise BlockfoldError(f"checkpoint {self.folder} has no tensor {name!r}")
        with self._open(self._file_of[name]) as handle:
            return handle.get_tensor(name).clone()

    def floating_dtype(self) -> torch.dtype:
        """The dtype holding most of the checkpoint's floating-point bytes: the model's own precision."""
        totals: dict[torch.dtype, int] = {}
        for name, (dtype, _) in self._meta.items():
            if dtype.is_floating_point:
                totals[dtype] = totals.get(dtype, 0) + self.nbytes(name)
        return max(totals, key=totals.get) if totals else torch.float32


_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}

#: (name, shape, dtype) of every tensor a checkpoint will hold, in the order they are written
Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


class ShardWriter:
    """Write tensors into ``folder`` as safetensors shards of at most ``max_shard_bytes`` (a tensor
    larger than that gets a shard of its own); ``close`` names them as ``save_pretrained`` does.

    With a ``layout`` (every tensor's name, shape and dtype, in the order they will come) each
    shard's header is known in advance, so every tensor goes to its file as it arrives and memory
    holds one tensor; without one, a shard is gathered in memory and written by safetensors.
    """

    def __init__(self, folder: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES, layout: Layout | None = None):
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self.total_parameters = 0
        self._layout = list(layout) if layout is not None else None
        self._shards = self._plan(self._layout) if layout is not None else []
        self._starts = {shard[0][0] for shard in self._shards if shard}
        self._next = 0  # position in the layout
        self._file = None

    def _plan(self, layout: Layout) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        shards: list[list] = [[]]
        size = 0
        for name, shape, dtype in layout:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if shards[-1] and size + nbytes > self.max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype))
            size += nbytes
        return shards

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.total_bytes += size
        self.total_parameters += tensor.numel()
        if self._layout is not None:
            self._stream(name, tensor)
            return
        if name in self._pending or any(name in names for _, names in self._written):
            raise ValueError(f"tensor {name!r} written twice")
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += size

    def _stream(self, name: str, tensor: torch.Tensor) -> None:
        expected, shape, dtype = self._layout[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (expected, shape, dtype):
            raise ValueError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} is not the layout's next one: "
                             f"{expected} {shape} {dtype}")
        if name in self._starts:
            self._open_shard()
        self._file.write(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
        self._next += 1

    def _open_shard(self) -> None:
        """Close the current shard and start the next: its header, then its tensors as they come."""
        if self._file is not None:
            self._file.close()
        tensors = self._shards[len(self._written)]
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in tensors:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        path = self.folder / f".shard-{len(self._written):05d}.safetensors"
        self._file = path.open("wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._written.append((path, [name for name, _, _ in tensors]))

    def _flush(self) -> None:
        if not self._pending:
            return
        path = self.folder / f".shard-{len(self._written):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write what is left, rename the shards and write the index; returns the file names."""
        if self._layout is not None:
            if self._next != len(self._layout):
                raise ValueError(f"{len(self._layout) - self._next} tensors of the layout were never written")
            if self._file is not None:
                self._file.close()
                self._file = None
        self._flush()
        if len(self._written) == 1:
            os.replace(self._written[0][0], self.folder / SINGLE_FILE)
            return [SINGLE_FILE]
        count = len(self._written)
        weight_map, names = {}, []
        for number, (path, tensors) in enumerate(self._written, start=1):
            name = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(path, self.folder / name)
            weight_map.update(dict.fromkeys(tensors, name))
            names.append(name)
        index = {"metadata": {"total_size": self.total_bytes, "total_parameters": self.total_parameters},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names
