"""Where the sequential pipeline keeps activations between layers: on the device, in CPU memory, or
in files of a temporary folder (read back into fresh memory, not mapped, so they never count as
resident)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from blockfold.runtime import check_offload_dir


class ActivationStore:
    """Tensors by key, kept ``where`` ("device", "cpu" or "disk"), handed back on ``device``."""

    def __init__(self, where: str, device: torch.device, offload_dir: str | None = None, needed_bytes: int = 0):
        self.where = where
        self.device = device
        self._kept: dict = {}
        self._folder: Path | None = None
        if where == "disk":
            root = check_offload_dir(offload_dir, needed_bytes)
            self._folder = Path(tempfile.mkdtemp(prefix="blockfold-activations-", dir=root))

    def put(self, key, tensor: torch.Tensor) -> None:
        if self.where == "device":
            self._kept[key] = tensor
        elif self.where == "cpu":
            self._kept[key] = tensor.to("cpu")
        else:
            path = self._folder / f"{key}.safetensors"
            save_file({"t": tensor.detach().to("cpu").contiguous()}, str(path))
            self._kept[key] = path

    def get(self, key) -> torch.Tensor:
        kept = self._kept[key]
        if isinstance(kept, Path):
            with safe_open(str(kept), framework="pt") as handle:
                kept = handle.get_tensor("t").clone()
        return kept.to(self.device)

    def close(self) -> None:
        self._kept.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> "ActivationStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
