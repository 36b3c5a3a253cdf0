"""Passes that outlive a process: checkpoints to resume a killed run, and a cache of finished passes.

Both work on observers' states (``stats/state.py``) between groups of sequences, keyed by what
determines a pass's result: the weights (their fingerprint) and dtype, the calibration tokens and
what the observers accumulate. Neither knows which method the observers serve.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from blockfold.data import Batch
from blockfold.errors import BlockfoldError
from blockfold.jsonfile import write_json
from blockfold.stats.state import (STATE_FORMAT, describe, digest, load_observer_state, map_leaves, observer_state,
                                   read_meta, read_state, write_state)

log = logging.getLogger(__name__)

#: a checkpoint is written at most every this many seconds of pass time...
MIN_CHECKPOINT_SECONDS = 10.0
#: ...and at most once per this many times the last checkpoint took to write (5 % overhead at most)
CHECKPOINT_OVERHEAD = 20.0
CACHE_MARKER = "blockfold-stats-cache.json"


def calibration_digest(batches: list[Batch]) -> str:
    """A hash of the calibration tokens (ids, masks and images, in order)."""
    hasher = hashlib.sha256()
    for batch in batches:
        for tensor in (batch.input_ids, batch.attention_mask, batch.pixel_values):
            if tensor is not None:
                hasher.update(tensor.cpu().numpy().tobytes())
    return hasher.hexdigest()[:24]


def pass_key(fingerprint: str, dtype: torch.dtype, calibration: str, observers: list) -> str:
    return digest(STATE_FORMAT, fingerprint, str(dtype), calibration, [describe(o) for o in observers])


def save_observers(path: Path, observers: list, meta: dict) -> None:
    write_state(path, [observer_state(o) for o in observers], meta)


def load_observers(path: Path, meta: dict, observers: list, device: torch.device, fix: str) -> None:
    """Observers' states from a saved pass: sums onto ``device``, sampled rows in CPU memory."""
    states = read_state(path, meta, fix)
    for observer, state in zip(observers, states):
        for name in type(observer).SUMS:
            state[name] = map_leaves(state[name], lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf)
        load_observer_state(observer, state)


def changed_since(path: Path, identity: dict) -> list[str] | None:
    """The fields of ``identity`` (what a run is: its recipe, weights, calibration, ...) that differ from
    those recorded at ``path`` by the run that left it (an unreadable record differs in all); None where
    no run left one."""
    if not path.is_file():
        return None
    try:
        before = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        before = {}
    return [name for name in identity if before.get(name) != identity[name]]


class Checkpoints:
    """One run's passes as they advance, in ``folder`` (one state per pass and rank), so the same
    command started again after a crash resumes each pass from its last checkpoint."""

    def __init__(self, folder: Path, rank: int = 0, seconds: float | None = None):
        self.folder, self.rank, self.seconds = folder, rank, seconds

    def claim(self, run: dict) -> None:
        """Record what this run is (``run``: its recipe, weights, calibration, processes); checkpoints
        left by a run that differs in any of them are refused, not resumed."""
        path = self.folder / f"run-rank{self.rank}.json"
        changed = changed_since(path, run)
        if changed:
            raise BlockfoldError(f"{self.folder} holds checkpoints of a run with another {', '.join(changed)}: "
                                 "give --no-resume to start afresh (it deletes them), or another --out")
        if changed is None:
            write_json(path, run, indent=None)

    def _path(self, number: int) -> Path:
        return self.folder / f"pass-{number}-rank{self.rank}"

    def restore(self, number: int, key: str, observers: list, device: torch.device) -> tuple[int, int | None] | None:
        """(groups done, group size) of pass ``number``'s checkpoint, its state loaded into
        ``observers``; None when there is none. A checkpoint of another pass is an error."""
        path = self._path(number)
        fix = f"start afresh with --no-resume (it deletes {self.folder})"
        meta = read_meta(path, fix)
        if meta is None:
            return None
        if meta.get("key") != key:
            raise BlockfoldError(f"the checkpoint of pass {number} in {self.folder} was made with other weights, "
                                 f"calibration or statistics than this run's: {fix}")
        load_observers(path, meta, observers, device, fix)
        log.info("pass %d resumed after %d of %d groups", number, meta["groups_done"], meta["groups"])
        return meta["groups_done"], meta["group_size"]

    def writer(self, number: int, key: str, groups: int, group_size: int | None, observers: list):
        """``after_group(done)`` for a pipeline: checkpoints every so often, and when the pass ends."""
        last = {"at": time.monotonic(), "took": 0.0}

        def after_group(done: int) -> None:
            now = time.monotonic()
            interval = self.seconds if self.seconds is not None else max(MIN_CHECKPOINT_SECONDS,
                                                                         CHECKPOINT_OVERHEAD * last["took"])
            if done < groups and now - last["at"] < interval:
                return
            save_observers(self._path(number), observers,
                           {"key": key, "groups_done": done, "groups": groups, "group_size": group_size})
            last["at"] = time.monotonic()
            last["took"] = last["at"] - now

        return after_group


class StatsCache:
    """Finished passes in a folder shared by commands (``--stats-cache``): a pass with the same key
    (weights, dtype, calibration tokens, observers) is loaded instead of run."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder).expanduser()
        marker = self.folder / CACHE_MARKER
        fix = f"pass another --stats-cache folder, or delete {self.folder}"
        if self.folder.exists() and not self.folder.is_dir():
            raise BlockfoldError(f"--stats-cache {self.folder} is a file: {fix}")
        if marker.is_file():
            try:
                found = json.loads(marker.read_text()).get("format")
            except (OSError, json.JSONDecodeError, AttributeError):
                found = None
            if found != STATE_FORMAT:
                raise BlockfoldError(f"--stats-cache {self.folder} was written by another blockfold (format {found!r}, "
                                     f"this one reads {STATE_FORMAT!r}): {fix}")
        elif self.folder.is_dir() and any(self.folder.iterdir()):
            raise BlockfoldError(f"--stats-cache {self.folder} holds files but is not a statistics cache: {fix}")
        else:
            try:
                write_json(marker, {"format": STATE_FORMAT}, indent=None)
            except OSError as error:
                raise BlockfoldError(f"--stats-cache {self.folder} cannot be written ({error.strerror}): {fix}") from None

    def has(self, key: str) -> bool:
        return (self.folder / key).with_suffix(".json").is_file()

    def load(self, key: str, fingerprint: str, observers: list, device: torch.device) -> None:
        path = self.folder / key
        fix = f"delete {path}.json or pass another --stats-cache"
        meta = read_meta(path, fix)
        if meta.get("fingerprint") != fingerprint:
            raise BlockfoldError(f"cached statistics {path}.json are of other weights than this model's: {fix}")
        load_observers(path, meta, observers, device, fix)

    def save(self, key: str, fingerprint: str, observers: list, description: str) -> None:
        save_observers(self.folder / key, observers, {"key": key, "fingerprint": fingerprint, "pass": description})


__all__ = ["Checkpoints", "StatsCache", "calibration_digest", "changed_since", "pass_key"]
