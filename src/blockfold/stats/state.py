"""An observer's running state as plain data: what ranks add up, checkpoints save and caches reuse.

Every observer names its state in two class attributes: ``SUMS``, attributes that are sums over
calibration tokens (tensors, numpy arrays, numbers, and lists or dicts of them), which shards add;
and ``ROWS``, lists of sampled rows in calibration order, which shards concatenate in order. Between
two groups of sequences (after ``end_batch``) nothing else carries information, so these are the
whole state: saved, it resumes a pass; reduced across processes, it is the pass of all of them.

The state is written as one safetensors file (the tensors) and one JSON file (the structure, with
the numbers), never as a pickle: a cache folder from elsewhere cannot run code when it is read.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from blockfold.errors import BlockfoldError
from blockfold.jsonfile import write_json

#: bump when the layout of saved states changes; a state of another format is refused, not read
STATE_FORMAT = "blockfold-stats/1"


def observer_state(observer) -> dict:
    """The observer's ``SUMS`` and ``ROWS`` attributes (the objects themselves, not copies)."""
    return {name: getattr(observer, name) for name in (*type(observer).SUMS, *type(observer).ROWS)}


def load_observer_state(observer, state: dict) -> None:
    for name in (*type(observer).SUMS, *type(observer).ROWS):
        setattr(observer, name, state[name])


def describe(observer) -> dict:
    """What an observer accumulates, as JSON-able data: its class and public settings (two observers
    with equal descriptions fed the same tokens end in equal states)."""
    settings = {}
    for name, value in sorted(vars(observer).items()):
        if name.startswith("_") or name in type(observer).SUMS or name in type(observer).ROWS:
            continue
        if hasattr(value, "describe"):
            settings[name] = value.describe()
        elif _plain(value):
            settings[name] = value
    return {"class": type(observer).__name__, **settings}


def _plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    return False


def digest(*parts) -> str:
    """A short hash of JSON-able parts (the key of a saved pass)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


# -- encoding ---------------------------------------------------------------------------------
def encode(tree) -> tuple[object, dict[str, torch.Tensor]]:
    """``tree`` as (JSON-able structure, named tensors): tensors and arrays become references."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value):
        if isinstance(value, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = value.detach().cpu().contiguous()
            return {"tensor": name}
        if isinstance(value, np.ndarray):
            name = f"t{len(tensors)}"
            tensors[name] = torch.from_numpy(np.ascontiguousarray(value))
            return {"array": name}
        if isinstance(value, dict):
            return {"dict": [[_key(key), walk(item)] for key, item in value.items()]}
        if isinstance(value, tuple):
            return {"tuple": [walk(item) for item in value]}
        if isinstance(value, list):
            return {"list": [walk(item) for item in value]}
        if isinstance(value, (bool, int, float)) or value is None:
            return {"value": value}
        raise TypeError(f"cannot save a {type(value).__name__} in an observer's state")

    return walk(tree), tensors


def _key(key):
    return list(key) if isinstance(key, tuple) else key


def decode(structure, tensors: dict[str, torch.Tensor]):
    """The tree ``encode`` took apart."""
    def walk(node):
        (kind, value), = node.items()
        if kind == "tensor":
            return tensors[value]
        if kind == "array":
            return tensors[value].numpy()
        if kind == "dict":
            return {(tuple(key) if isinstance(key, list) else key): walk(item) for key, item in value}
        if kind == "tuple":
            return tuple(walk(item) for item in value)
        if kind == "list":
            return [walk(item) for item in value]
        return value

    return walk(structure)


def write_state(path: Path, tree, meta: dict) -> None:
    """``path``.json and a tensors file it names, the tensors written first and the JSON renamed into
    place last: whatever moment a run is killed at, the JSON names a complete state (the new one or
    the previous one, whose tensors are removed only after)."""
    structure, tensors = encode(tree)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors_name = f"{path.name}.{uuid.uuid4().hex[:12]}.safetensors"
    save_file(tensors, str(path.parent / tensors_name))
    write_json(path.with_suffix(".json"), {"format": STATE_FORMAT, **meta, "tensors": tensors_name, "structure": structure},
               indent=None)
    for old in path.parent.glob(f"{path.name}.*.safetensors"):
        if old.name != tensors_name:
            old.unlink(missing_ok=True)


def read_meta(path: Path, fix: str) -> dict | None:
    """The JSON of a saved state, None where there is none; a state of another format is an error
    whose message ends with ``fix``."""
    json_path = path.with_suffix(".json")
    if not json_path.is_file():
        return None
    try:
        meta = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError):
        raise BlockfoldError(f"saved statistics {json_path} cannot be read: {fix}") from None
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise BlockfoldError(f"saved statistics {json_path} are of format {found!r}, not this blockfold's "
                             f"{STATE_FORMAT!r}: {fix}")
    return meta


def read_state(path: Path, meta: dict, fix: str):
    """The tree a saved state holds (tensors on the CPU)."""
    tensors_path = path.parent / meta["tensors"]
    try:
        tensors = load_file(str(tensors_path))
    except (OSError, ValueError) as error:
        raise BlockfoldError(f"saved statistics {tensors_path} cannot be read ({error}): {fix}") from None
    return decode(meta["structure"], tensors)


# -- combining shards ----------------------------------------------------------------------------
def combine(trees: list, rows: bool) -> object:
    """Shards' states as one: sums added, or (``rows``) row lists concatenated in shard order."""
    first = trees[0]
    if isinstance(first, dict):
        keys = list(first)
        for tree in trees[1:]:
            keys += [key for key in tree if key not in first]
        return {key: combine([tree[key] for tree in trees if key in tree], rows) for key in keys}
    if rows:
        if isinstance(first, list) and (not first or not isinstance(first[0], list)):
            return [item for tree in trees for item in tree]
        return [combine(list(items), rows) for items in zip(*trees)]
    if isinstance(first, (list, tuple)):
        return type(first)(combine(list(items), rows) for items in zip(*trees))
    total = first.clone() if isinstance(first, torch.Tensor) else first.copy() if isinstance(first, np.ndarray) else first
    for tree in trees[1:]:
        total = total + tree.to(total.device) if isinstance(total, torch.Tensor) else total + tree
    return total


def map_leaves(tree, function: Callable):
    """``tree`` with every tensor, array and number replaced by ``function(leaf)``."""
    if isinstance(tree, dict):
        return {key: map_leaves(value, function) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_leaves(value, function) for value in tree)
    return function(tree)


__all__ = ["STATE_FORMAT", "combine", "decode", "describe", "digest", "encode", "load_observer_state",
           "map_leaves", "observer_state", "read_meta", "read_state", "write_state"]
