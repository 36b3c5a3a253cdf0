"""Calibration images for vision encoders: a folder of image files (any layout; in class subfolders
for the k-NN evaluation) through the model's own image processor, into batches of pixel values.

The mask of an image batch has one entry per token the encoder makes of an image (its patches and
class token), all real, so every statistic runs on image batches as on text.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from blockfold.data.calibration import Batch, CalibrationSet
from blockfold.errors import BlockfoldError
from blockfold.recipe import CalibrationConfig

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def image_files(folder: str | Path) -> list[Path]:
    """Every image file under ``folder``, in a fixed order (sorted paths)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise BlockfoldError(f"{root} is not a folder of images: give a folder holding .jpg/.png files "
                             "(in class subfolders for accuracy)")
    files = sorted(path for path in root.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file())
    if not files:
        raise BlockfoldError(f"{root} holds no image file ({', '.join(IMAGE_SUFFIXES)}): give a folder of images")
    return files


def is_image_folder(source: str | None) -> bool:
    if not source:
        return False
    root = Path(source).expanduser()
    return root.is_dir() and any(path.suffix.lower() in IMAGE_SUFFIXES for path in root.rglob("*"))


def pixel_batches(files: list[Path], processor, adapter, config, batch_size: int) -> tuple[list[Batch], str]:
    """The images of ``files`` as batches of pixel values with all-real masks, and a hash of the pixels."""
    from PIL import Image, UnidentifiedImageError

    batches, hasher = [], hashlib.sha256()
    for start in range(0, len(files), batch_size):
        images = []
        for path in files[start : start + batch_size]:
            try:
                with Image.open(path) as image:
                    images.append(image.convert("RGB"))
            except (UnidentifiedImageError, OSError) as error:
                raise BlockfoldError(f"cannot read image {path} ({error}): remove it or replace it by a valid image") from None
        pixels = processor(images=images, return_tensors="pt")["pixel_values"].float()
        hasher.update(pixels.numpy().tobytes())
        tokens = adapter.tokens_per_image(config, pixels.shape[-2], pixels.shape[-1])
        batches.append(Batch(None, torch.ones(len(images), tokens, dtype=torch.long), pixels))
    return batches, hasher.hexdigest()[:16]


def build_image_calibration(config: CalibrationConfig, processor, adapter, model_config) -> CalibrationSet:
    """The first ``num_sequences`` images of the folder ``config.source``, ``batch_size`` per batch."""
    if processor is None:
        raise BlockfoldError("this vision model has no image processor (preprocessor_config.json) in its folder: "
                             "save the model's image processor beside its weights")
    files = image_files(config.source)[: config.num_sequences]
    batches, fingerprint = pixel_batches(files, processor, adapter, model_config, config.batch_size)
    description = {"source": str(config.source), "images": len(files), "sequences": len(files),
                   "sequence_length": batches[0].attention_mask.shape[1], "tokens": sum(b.num_tokens for b in batches),
                   "sha256_16": fingerprint}
    return CalibrationSet(batches, description)
