"""Content hashes of checkpoint files, computed once per file.

A streamed model is never resident, so its fingerprint cannot hash tensors in memory; hashing only
names, shapes and sizes would give a base model and its fine-tune (same shards, other values) the
same key, and a statistics cache or a resume folder would serve one the other's sums. Instead each
shard's bytes are hashed (SHA-256, several files at once) and the digest is kept in a small index
keyed by the file's path, size and modification time, so a later run on the same files reads the
index instead of the bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from blockfold.jsonfile import write_json

log = logging.getLogger(__name__)

INDEX_NAME = "file-digests.json"
#: digests of files read at the same time (hashlib releases the GIL while it hashes)
PARALLEL_FILES = min(8, os.cpu_count() or 1)


def _index_path() -> Path:
    from blockfold.models.sources import cache_dir

    return cache_dir() / INDEX_NAME


def _read_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _stamp(path: Path) -> list:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _hash_file(path: Path) -> str:
    digest, buffer = hashlib.sha256(), bytearray(16 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def file_digests(paths: list[Path]) -> dict[Path, str]:
    """The SHA-256 of each file's bytes: from the index where the file's path, size and modification
    time are those recorded, else read (several files at once) and added to the index."""
    index_path = _index_path()
    index = _read_index(index_path)
    digests, missing = {}, []
    for path in paths:
        key = str(path.resolve())
        entry = index.get(key)
        if isinstance(entry, dict) and entry.get("stamp") == _stamp(path):
            digests[path] = entry["sha256"]
        else:
            missing.append(path)
    if missing:
        size = sum(path.stat().st_size for path in missing)
        (log.info if size >= 1 << 30 else log.debug)("hashing %d checkpoint file(s), %.1f GiB, once (kept in %s)",
                                                     len(missing), size / 2**30, index_path)
        with ThreadPoolExecutor(PARALLEL_FILES) as pool:
            for path, digest in zip(missing, pool.map(_hash_file, missing)):
                digests[path] = digest
                index[str(path.resolve())] = {"stamp": _stamp(path), "sha256": digest}
        try:  # a newer index written meanwhile by another process keeps its own entries too
            write_json(index_path, {**_read_index(index_path), **index}, indent=None)
        except OSError as error:  # a read-only cache only costs the hashing again next time
            log.warning("could not keep the checkpoint digests in %s (%s)", index_path, error)
    return digests


__all__ = ["file_digests"]
