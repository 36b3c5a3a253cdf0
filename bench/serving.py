"""Compressed models in the engines users serve with (issue #14): vLLM (CPU build) and llama.cpp
(llama-cpp-python), each in its own environment (``scripts/serve-check.sh`` sets them up).

    scripts/serve-check.sh smollm2-135m --engine llamacpp && scripts/serve-check.sh smollm2-135m --engine vllm
    .venv/bin/python bench/serving.py --json bench/results/serving.json

For each model: the original, ReplaceMe and NBL (calibration: 128 c4_demo documents, today's
defaults), greedy tokens of each engine against transformers (float32) on the same 20 LAMBADA prompt
ids (64 tokens, 16 new), prefill and decode throughput original against compressed in one run, and
the GGUF round trip: the source's own quantized file against the compressed model exported with
``--quant source``, perplexity in llama.cpp on WikiText-2 windows.

Compressed outputs are kept in ``--work`` and reused by a later invocation (to restart after an
engine failure without compressing again); delete that folder to measure from scratch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

import blockfold
from blockfold.api import provenance
from blockfold.errors import BlockfoldError
from blockfold.export import export_gguf
from blockfold.export.gguf import _source_gguf  # the source GGUF a converted model records
from blockfold.models.sources import resolve_model_path
from blockfold.serving import read_prompts, run_engine, transformers_greedy

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


def _windows(tokenizer, count: int, length: int) -> list[list[int]]:
    ids = tokenizer((DATA / "wikitext2_test.txt").read_text())["input_ids"]
    return [ids[start : start + length] for start in range(0, count * length, length)]


def _speed(result: dict) -> dict:
    return {"prefill_tokens_per_s": result["prefill_tokens"] / result["prefill_seconds"],
            "decode_tokens_per_s": result["decode_tokens"] / result["decode_seconds"]}


def _engine_row(engine: str, request: dict, reference: list[list[int]], gaps: list[list[float]],
                expected_ids: list[list[int]]) -> dict:
    try:
        result = run_engine(engine, request)
    except BlockfoldError as error:
        return {"error": str(error).splitlines()[-1][:300]}
    matching = [a == b for a, b in zip(reference, result["tokens"])]
    parted = [next(step for step, (a, b) in enumerate(zip(ref, got)) if a != b)
              for ref, got, same in zip(reference, result["tokens"], matching) if not same]
    return {"matching": sum(matching), "prompts": len(matching),
            "gaps_where_parted": [gaps[index][step] for index, step in
                                  zip([i for i, same in enumerate(matching) if not same], parted)],
            "tokenization_agrees": sum(a == b for a, b in zip(expected_ids, result["tokenized"])),
            "kv_cache_tokens": result.get("kv_cache_tokens"), **_speed(result)}


def measure_variant(name: str, folder: Path, scratch: Path, args) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts, ids = read_prompts(DATA / "lambada_test.jsonl", tokenizer, args.prompts, 64)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", trust_remote_code=True).eval()
    reference, gaps = transformers_greedy(model, ids, args.new_tokens)
    del model
    expected = [tokenizer(text)["input_ids"] for text in texts]
    row = {"variant": name, "engines": {}}
    request = {"prompts": ids, "new_tokens": args.new_tokens, "threads": args.threads, "texts": texts}
    remote = json.loads((folder / "config.json").read_text()).get("model_type", "").startswith("blockfold_")
    row["engines"]["vllm"] = _engine_row("vllm", {**request, "model": str(folder), "trust_remote_code": remote},
                                         reference, gaps, expected)
    print(name, "vllm", json.dumps(row["engines"]["vllm"]), flush=True)
    for quant in args.quants.split(","):
        try:
            gguf = export_gguf(folder, scratch / f"{name}-{quant}.gguf", quant=quant, overwrite=True)
        except BlockfoldError as error:
            row["engines"][f"llamacpp-{quant}"] = {"error": str(error)}
            continue
        row["engines"][f"llamacpp-{quant}"] = _engine_row("llamacpp", {**request, "model": str(gguf)}, reference,
                                                          gaps, expected)
        row["engines"][f"llamacpp-{quant}"]["gguf_mb"] = gguf.stat().st_size / 1e6
        print(name, quant, json.dumps(row["engines"][f"llamacpp-{quant}"]), flush=True)
    return row


def round_trip(model: str, compressed: Path, scratch: Path, args) -> dict:
    """Perplexity in llama.cpp of the source GGUF against the compressed model exported at the source's types."""
    converted = Path(resolve_model_path(model))
    source, _ = _source_gguf({}, converted)
    exported = export_gguf(compressed, scratch / "round-trip.gguf", quant="source", overwrite=True)
    windows = _windows(AutoTokenizer.from_pretrained(converted), args.ppl_windows, 512)
    row = {"source_gguf": source.name, "source_mb": source.stat().st_size / 1e6,
           "exported_mb": exported.stat().st_size / 1e6, "windows": len(windows)}
    for label, path in (("source", source), ("round_trip", exported)):
        result = run_engine("llamacpp", {"model": str(path), "prompts": [], "new_tokens": 0, "threads": args.threads,
                                         "perplexity_windows": windows})
        row[f"{label}_perplexity"] = float(2.718281828459045 ** (result["nll"] / result["nll_tokens"]))
    print("round trip", json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m:8:8,gemma3-270m:4:4",
                        help="model:replaceme blocks:NBL attention layers, comma-separated")
    parser.add_argument("--quants", default="f16,q8_0,f32", help="GGUF types to serve in llama.cpp")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--ppl-windows", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(".serving-work"),
                        help="compressed outputs and GGUF files; a compressed output already there is reused")
    parser.add_argument("--json", default="bench/results/serving.json")
    args = parser.parse_args()
    record = {"provenance": provenance(["bench/serving.py", *sys.argv[1:]]), "prompts": args.prompts,
              "new_tokens": args.new_tokens, "threads": args.threads, "models": []}
    calibration = {"source": str(DATA / "c4_demo.jsonl"), "max_documents": 128}
    for spec in args.models.split(","):
        model, blocks, attention = spec.split(":")
        entry = {"model": model, "variants": []}
        scratch = args.work / model
        scratch.mkdir(parents=True, exist_ok=True)
        folders = {"original": Path(resolve_model_path(model))}
        for name, method in ((f"replaceme-{blocks}", blockfold.ReplaceMe(blocks=int(blocks))),
                             (f"nbl-{attention}", blockfold.NBL(attention_layers=int(attention)))):
            folders[name] = scratch / name
            if not (folders[name] / "blockfold_manifest.json").is_file():  # saves are atomic: present means whole
                blockfold.compress(model, recipe=blockfold.Recipe.of(method, calibration)).save(folders[name])
        for name, folder in folders.items():
            entry["variants"].append(measure_variant(name, folder, scratch, args))
        entry["round_trip"] = round_trip(model, folders[f"replaceme-{blocks}"], scratch, args)
        record["models"].append(entry)
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
