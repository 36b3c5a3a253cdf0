"""Checkpoints read one tensor at a time and written shard by shard (streamed when the layout is known)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from blockfold.errors import BlockfoldError
from blockfold.models.checkpoint import CheckpointReader, ShardWriter


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(40, 30, generator=generator), "b.bias": torch.randn(7, generator=generator).bfloat16(),
            "big": torch.randn(300, 100, generator=generator).half(), "count": torch.tensor(5),
            "ids": torch.arange(12).reshape(3, 4), "z.norm": torch.randn(30, generator=generator).double()}


@pytest.mark.parametrize("streamed", [True, False])
def test_shards_round_trip_through_safetensors(tmp_path, streamed):
    tensors = _tensors()
    layout = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()] if streamed else None
    writer = ShardWriter(tmp_path, max_shard_bytes=20_000, layout=layout)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    names = writer.close()
    assert len(names) > 2 and all((tmp_path / name).is_file() for name in names)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) and index["metadata"]["total_size"] == writer.total_bytes
    loaded = {}
    for name in names:  # safetensors itself reads every shard
        loaded.update(load_file(tmp_path / name))
    reader = CheckpointReader(tmp_path)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
        assert torch.equal(reader.get(name), tensor) and reader.shape(name) == tuple(tensor.shape)
    assert reader.floating_dtype() == torch.float16  # the dtype with the most bytes


def test_a_single_shard_is_named_as_save_pretrained_names_it(tmp_path):
    tensors = _tensors()
    writer = ShardWriter(tmp_path, layout=[(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    assert writer.close() == ["model.safetensors"]
    assert set(load_file(tmp_path / "model.safetensors")) == set(tensors)


def test_a_streamed_writer_refuses_what_its_layout_does_not_announce(tmp_path):
    writer = ShardWriter(tmp_path, layout=[("a", (2,), torch.float32), ("b", (3,), torch.float32)])
    with pytest.raises(ValueError, match="not the layout's next"):
        writer.add("b", torch.zeros(3))
    writer.add("a", torch.zeros(2))
    with pytest.raises(ValueError, match="never written"):
        writer.close()


def test_damaged_and_foreign_checkpoints_are_named(tmp_path):
    with pytest.raises(BlockfoldError, match="no model.safetensors"):
        CheckpointReader(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(BlockfoldError, match="damaged"):
        CheckpointReader(tmp_path)
