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
    parser.add_argument("--calibration-images", type=int, default=128)
    parser.add_argument("--eval-images", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench/results/vision.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="blockfold-vision-"))
    try:
        model_folder = Path(args.model) if args.model else random_tower(work / "tower", args.seed)
        calibration = write_digits(work / "calibration", 0, args.calibration_images)
        held_out = write_digits(work / "held-out", args.calibration_images, args.eval_images)
        original = load_model(str(model_folder))
        reference, labels = image_embeddings(original, held_out)
        results = {"provenance": provenance(["bench/vision.py", *sys.argv[1:]]),
                   "model": args.model or "random-weight CLIP ViT-B/32 vision tower (real shape)",
                   "images": {"source": "scikit-learn digits", "calibration": args.calibration_images,
                              "held_out": args.eval_images},
                   "original": {"parameters": count_parameters(original.model), "knn_accuracy": knn_accuracy(reference, labels)},
                   "rows": []}
        for blocks in (int(b) for b in args.blocks.split(",")):
            for spec in args.methods.split(","):
                method, _, rest = spec.partition(":")
                settings = dict(item.split("=") for item in filter(None, rest.split(";")))
                recipe = {"method": method, "blocks": blocks, **settings,
                          "calibration": {"source": str(calibration), "num_sequences": args.calibration_images}}
                result = blockfold.compress(str(model_folder), recipe=blockfold.Recipe.parse(recipe))
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
