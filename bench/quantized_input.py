"""Compressing a checkpoint that is already quantized (issue #14): bitsandbytes NF4 in, as users run it.

    .venv/bin/python bench/quantized_input.py --json bench/results/quantized_input.json

SmolLM2-135M's float weights (the built-in model, dequantized from its GGUF) are quantized to NF4 by
transformers on load and saved; that 4-bit checkpoint is compressed with ReplaceMe (statistics from the
4-bit model's own passes, the fold on the dequantized down-projection, every other 4-bit weight kept
byte for byte), and so is the float model, with the same recipe (issue 2's calibration: 128 c4_demo
documents, 64 sequences of 512 tokens). WikiText-2 perplexity (first 40 windows of 512 tokens) of the
four models, their weight files' sizes and the compress times, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import blockfold
from blockfold.api import provenance
from blockfold.jsonfile import write_json
from blockfold.models.sources import resolve_model_path

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


def _weight_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def _nf4_copy(folder: Path, target: Path) -> Path:
    """The float checkpoint quantized to NF4 by transformers on load, saved with its tokenizer."""
    quantized = AutoModelForCausalLM.from_pretrained(
        folder, device_map="cpu", quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    quantized.save_pretrained(target)
    for path in folder.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copyfile(path, target / path.name)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--ppl-windows", type=int, default=40)
    parser.add_argument("--json", default="bench/results/quantized_input.json")
    args = parser.parse_args()
    started = provenance(["bench/quantized_input.py", *sys.argv[1:]])
    text = DATA / "wikitext2_test.txt"
    recipe = blockfold.Recipe.of(blockfold.ReplaceMe(blocks=args.blocks),
                                 {"source": str(DATA / "c4_demo.jsonl"), "max_documents": 128})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        float_folder = Path(resolve_model_path(args.model))
        sources = {"float32": float_folder, "nf4": _nf4_copy(float_folder, Path(tmp) / "nf4")}
        for precision, source in sources.items():
            began = time.perf_counter()
            compressed = blockfold.compress(str(source), recipe=recipe)
            seconds = time.perf_counter() - began
            output = compressed.save(Path(tmp) / f"{precision}-replaceme")
            manifest = compressed.manifest
            del compressed
            for label, folder in (("original", source), (f"replaceme {args.blocks}", output)):
                scores = blockfold.evaluate(str(folder), perplexity_text=text, max_windows=args.ppl_windows,
                                            baseline="none")
                rows.append({"precision": precision, "model": label, "perplexity": scores["model"]["perplexity"],
                             "weight_bytes": _weight_bytes(folder),
                             **({"removed_blocks": manifest["removed_blocks"], "compress_seconds": seconds,
                                 "skip_modules": json.loads((folder / "config.json").read_text()).get(
                                     "quantization_config", {}).get("llm_int8_skip_modules")}
                                if folder == output else {})})
                print(json.dumps(rows[-1]), flush=True)
    write_json(args.json, {"model": args.model, "blocks": args.blocks,
                          "recipe": recipe.model_dump(mode="json"), "ppl_windows": args.ppl_windows,
                          "rows": rows, "provenance": started}, indent=1)


if __name__ == "__main__":
    main()
