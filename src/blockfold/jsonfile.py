"""Files written whole or not at all.

A run stopped while it writes a file (killed, out of disk) must not leave a truncated one where a
reader, a later ``--original-from`` or ``--resume``, expects it: the file is written beside the target
under a staging name (``.<name>.partial-<pid>``, the convention of the checkpoint writer, so processes
writing the same target do not share one) and renamed over it, so the target is always the previous
file or the new one.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from blockfold.errors import BlockfoldError


def write_json(path: str | Path, data: Any, indent: int | None = 1, default: Callable[[Any], Any] | None = None) -> Path:
    """Write ``data`` as JSON to ``path`` (its folder made if missing) in one rename; returns the path."""
    target = Path(path)
    text = json.dumps(data, indent=indent, default=default)  # a value JSON cannot hold fails before any file exists
    with staged_file(target) as staging:
        staging.write_text(text)
    return target


@contextlib.contextmanager
def staged_file(target: Path) -> Iterator[Path]:
    """The path to write ``target``'s content to (its folder made if missing): renamed over ``target``
    when the block ends, removed if it raises."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        yield staging
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)


def check_json_target(path: str | Path, option: str = "--json") -> None:
    """Refuse a results path that cannot be written before the run it ends, not after: a folder, or
    a path under a file or under a folder this process cannot write to."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise BlockfoldError(f"{option} {path} is a folder: give a file path, e.g. {target / 'results.json'}")
    existing = target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise BlockfoldError(f"{option} {path}: {existing} is a file, not a folder: give another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BlockfoldError(f"{option} {path}: {existing} is not writable by this user: give another path")
