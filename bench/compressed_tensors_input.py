"""Compressing a W4A16 checkpoint stored as compressed-tensors (issue #45): GPTQ in, as vLLM serves it.

    scripts/quantize-w4a16.sh smollm2-135m /tmp/smollm2-gptq          # llm-compressor GPTQ, group 64
    .venv/bin/python bench/compressed_tensors_input.py --source /tmp/smollm2-gptq --serve \\
        --json bench/results/compressed_tensors_input.json

The quantized checkpoint and its float model are each compressed by ReplaceMe (``--blocks``) and by NBL
(``--attention-layers``) with one recipe (issue 2's calibration: 128 c4_demo documents, 64 sequences of
512 tokens). Statistics come from the quantized model's own computation (its layers dequantized, as a
weight-only scheme computes), untouched quantized layers are copied byte for byte and edited ones quantized
again in the source's scheme. WikiText-2 perplexity on the first ``--ppl-windows`` windows of 512 tokens;
for each quantized output, how many of its quantized layers are the source's bytes, and with ``--serve``
whether vLLM's greedy tokens equal transformers' (``scripts/serve-check.sh``: vLLM in bfloat16, since its
CPU kernel for packed weights takes no float32, against transformers in float32). ``--serve-only`` runs
that check alone on saved folders; ``--in-memory`` measures the quantized source's ReplaceMe before it is
written, its edited layers still in float (what quantizing them again costs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import blockfold
from blockfold.api import provenance
from blockfold.jsonfile import write_json
from blockfold.models.checkpoint import CheckpointReader
from blockfold.models.sources import resolve_model_path

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))
REPO = Path(__file__).resolve().parents[1]


def _weight_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def _same_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    return (first.dtype, first.shape) == (second.dtype, second.shape) and torch.equal(
        first.contiguous().view(-1).view(torch.uint8), second.contiguous().view(-1).view(torch.uint8))


def layers_as_stored(source: Path, output: Path, removed: list[int]) -> dict:
    """How many of the output's quantized layers hold their source layer's packed tensors byte for byte
    (blocks renumbered past the removed ones), and which do not."""
    before, after = CheckpointReader(source), CheckpointReader(output)
    kept = [index for index in range(1 + max(int(name.split(".")[2]) for name in before.names()
                                             if name.startswith("model.layers.")))
            if index not in set(removed)]
    same, changed = 0, []
    for name in after.names():
        if not name.endswith(".weight_packed"):
            continue
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            parts[2] = str(kept[int(parts[2])])
        layer = ".".join(parts).removesuffix(".weight_packed")
        stored = [suffix for suffix in ("weight_packed", "weight_scale", "weight_zero_point")
                  if f"{layer}.{suffix}" in before]
        if all(_same_bytes(before.get(f"{layer}.{suffix}"), after.get(f"{name.removesuffix('weight_packed')}{suffix}"))
               for suffix in stored):
            same += 1
        else:
            changed.append(name.removesuffix(".weight_packed"))
    return {"quantized_layers": same + len(changed), "as_stored": same, "quantized_again": changed}


def serve_check(folder: Path) -> dict:
    """``scripts/serve-check.sh FOLDER --engine vllm``: its exit status and summary line."""
    completed = subprocess.run(["bash", str(REPO / "scripts" / "serve-check.sh"), str(folder), "--engine", "vllm"],
                               capture_output=True, text=True, cwd=REPO)
    lines = [line for line in completed.stdout.splitlines() if line.strip()]
    return {"returncode": completed.returncode, "summary": lines[-1] if lines else completed.stderr[-500:],
            "differences": [line for line in lines if line.startswith("prompt ")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True, help="the compressed-tensors W4A16 folder")
    parser.add_argument("--float-model", default="smollm2-135m", help="the float model it was quantized from")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--attention-layers", type=int, default=8)
    parser.add_argument("--ppl-windows", type=int, default=40)
    parser.add_argument("--serve", action="store_true", help="check vLLM's greedy tokens on each quantized output")
    parser.add_argument("--serve-only", nargs="+", metavar="LABEL=FOLDER",
                        help="only the vLLM check, of saved folders (the source as 'original')")
    parser.add_argument("--in-memory", action="store_true",
                        help="only ReplaceMe on the quantized source, measured before writing (edited layers in float)")
    parser.add_argument("--json", default="bench/results/compressed_tensors_input.json")
    args = parser.parse_args()
    started = provenance(["bench/compressed_tensors_input.py", *sys.argv[1:]])
    if args.serve_only:
        folders = dict(entry.split("=", 1) for entry in args.serve_only)
        rows = [{"model": label, "vllm": serve_check(Path(folder))} for label, folder in folders.items()]
        write_json(args.json, {"rows": rows, "provenance": started}, indent=1)
        return
    text = DATA / "wikitext2_test.txt"
    calibration = {"source": str(DATA / "c4_demo.jsonl"), "max_documents": 128}
    recipes = {f"replaceme {args.blocks}": blockfold.Recipe.of(blockfold.ReplaceMe(blocks=args.blocks), calibration),
               f"nbl {args.attention_layers}": blockfold.Recipe.of(
                   blockfold.NBL(attention_layers=args.attention_layers), calibration)}
    if args.in_memory:  # what quantizing the edited layers again costs: the same model, its edits in float
        compressed = blockfold.compress(str(args.source), recipe=recipes[f"replaceme {args.blocks}"])
        scores = blockfold.evaluate(compressed, perplexity_text=text, max_windows=args.ppl_windows, baseline="none")
        rows = [{"precision": "w4a16", "model": f"replaceme {args.blocks}", "edits": "float, in memory",
                 "perplexity": scores["model"]["perplexity"], "removed_blocks": compressed.manifest["removed_blocks"]}]
        print(json.dumps(rows[0]), flush=True)
        write_json(args.json, {"rows": rows, "provenance": started}, indent=1)
        return
    sources = {"w4a16": args.source, "float32": Path(resolve_model_path(args.float_model))}
    rows = []
    with tempfile.TemporaryDirectory(dir=args.source.parent) as scratch:
        for precision, source in sources.items():
            outputs = {"original": (source, None, None)}
            for label, recipe in recipes.items():
                began = time.perf_counter()
                compressed = blockfold.compress(str(source), recipe=recipe)
                seconds = time.perf_counter() - began
                folder = compressed.save(Path(scratch) / f"{precision}-{label.replace(' ', '-')}")
                outputs[label] = (folder, compressed.manifest, seconds)
                del compressed
            for label, (folder, manifest, seconds) in outputs.items():
                scores = blockfold.evaluate(str(folder), perplexity_text=text, max_windows=args.ppl_windows,
                                            baseline="none")
                row = {"precision": precision, "model": label, "perplexity": scores["model"]["perplexity"],
                       "weight_bytes": _weight_bytes(folder)}
                if manifest is not None:
                    row.update(removed_blocks=manifest.get("removed_blocks") or [],
                               replaced=manifest.get("replaced") or [], compress_seconds=seconds)
                    if precision == "w4a16":
                        config = json.loads((folder / "config.json").read_text())
                        row.update(layers_as_stored(source, folder, row["removed_blocks"]),
                                   ignore=config["quantization_config"]["ignore"])
                if precision == "w4a16" and args.serve:
                    row["vllm"] = serve_check(folder)
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_json(args.json, {"source": str(args.source), "float_model": args.float_model, "blocks": args.blocks,
                           "attention_layers": args.attention_layers, "ppl_windows": args.ppl_windows,
                           "recipes": {label: recipe.model_dump(mode="json") for label, recipe in recipes.items()},
                           "source_quantization": json.loads((args.source / "config.json").read_text())[
                               "quantization_config"],
                           "rows": rows, "provenance": started}, indent=1)


if __name__ == "__main__":
    main()
