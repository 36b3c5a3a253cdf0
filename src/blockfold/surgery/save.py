"""Writing a compressed model atomically: a temporary folder, renamed into place when complete."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.errors import BlockfoldError

MANIFEST_NAME = "blockfold_manifest.json"
RECIPE_NAME = "blockfold_recipe.yaml"


def check_output_folder(out: str | Path, overwrite: bool) -> Path:
    """Refuse an existing output folder unless ``overwrite``; called before any work is done."""
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise BlockfoldError(f"output folder {out} already exists: choose another --out or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise BlockfoldError(f"output path {out} is a file: choose a folder path for --out")
    return out


@contextmanager
def staged_folder(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty folder beside ``out`` to write into; when the block ends without error it
    replaces ``out`` (an old ``out`` is moved aside first and removed after), otherwise it is
    deleted: nothing half written is ever at ``out``."""
    out = check_output_folder(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield staging
        if out.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, retired / out.name)
            os.replace(staging, out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_compressed(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: str | Path,
    manifest: dict,
    recipe_yaml: str,
    overwrite: bool = False,
) -> Path:
    """Save weights (safetensors), tokenizer, manifest and recipe; nothing half written is left."""
    with staged_folder(out, overwrite) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, default=str))
        (staging / RECIPE_NAME).write_text(recipe_yaml)
    return Path(out).expanduser()


def read_manifest(folder: str | Path) -> dict | None:
    path = Path(folder) / MANIFEST_NAME
    return json.loads(path.read_text()) if path.is_file() else None
