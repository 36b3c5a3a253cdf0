"""The key that statistics caches and resume folders trust: a streamed model's fingerprint covers its
weights' values, and each checkpoint file is hashed once."""

from __future__ import annotations

import os

import pytest
from conftest import random_calibration, tiny_model, tiny_tokenizer

import blockfold
from blockfold.models import digests
from blockfold.runtime import Execution


@pytest.fixture
def two_models(tmp_path, monkeypatch):
    """Two random-weight Llamas of the same shapes and shard layout, other values (a base model and
    its fine-tune, as the cache sees them)."""
    monkeypatch.setenv("BLOCKFOLD_CACHE", str(tmp_path / "cache"))
    folders = []
    for seed in (0, 1):
        folder = tmp_path / f"model{seed}"
        tiny_model("llama", seed=seed).save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
        folders.append(folder)
    assert (folders[0] / "model.safetensors").stat().st_size == (folders[1] / "model.safetensors").stat().st_size
    return folders


def _streamed(folder):
    return blockfold.open_model(str(folder), Execution(pipeline="sequential"))


def test_streamed_models_that_differ_only_in_values_have_other_fingerprints(two_models):
    first, second = (_streamed(folder) for folder in two_models)
    assert not first.resident and not second.resident
    assert first.fingerprint() != second.fingerprint()
    assert _streamed(two_models[0]).fingerprint() == first.fingerprint()


def test_the_stats_cache_never_serves_a_streamed_model_another_ones_sums(two_models, tmp_path):
    """The issue's reproduction: the second model compressed after the first with one cache removes
    what its own uncached run removes, with no pass loaded from the cache."""
    execution = Execution(pipeline="sequential", stats_cache=str(tmp_path / "stats"))
    recipe = {"blocks": 2, "refit": "none"}
    blockfold.compress(str(two_models[0]), recipe=recipe, calibration=random_calibration(), execution=execution)
    served = blockfold.compress(str(two_models[1]), recipe=recipe, calibration=random_calibration(), execution=execution)
    own = blockfold.compress(str(two_models[1]), recipe=recipe, calibration=random_calibration(),
                             execution=Execution(pipeline="sequential"))
    assert served.manifest["execution"]["cached_passes"] == 0
    assert served.manifest["removed_blocks"] == own.manifest["removed_blocks"]


def test_each_file_is_hashed_once_and_again_when_it_changes(two_models, monkeypatch):
    hashed = []
    real = digests._hash_file
    monkeypatch.setattr(digests, "_hash_file", lambda path: hashed.append(path.name) or real(path))
    shard = two_models[0] / "model.safetensors"
    first = digests.file_digests([shard])[shard]
    assert digests.file_digests([shard])[shard] == first and hashed == ["model.safetensors"]
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: read again, same bytes
    assert digests.file_digests([shard])[shard] == first and len(hashed) == 2
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert digests.file_digests([shard])[shard] != first
