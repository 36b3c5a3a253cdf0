"""Cost of `compress` relative to one plain forward pass, and peak memory against calibration size.

    .venv/bin/python bench/compress_cost.py --model smollm2-135m --sequences 64,256

For the first size: the wall time of one plain forward pass of the original model (with its LM
head, no gradients) over the calibration batches, then the wall time of `blockfold.compress` with
the lstsq estimator on the same batches (loading and saving excluded), measured in the same
process one after the other, and their ratio. For every size, a fresh subprocess runs `compress`
and reports its peak RSS, so the sizes can be compared (memory must stay flat in tokens).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


def _setup(model_spec: str, sequences: int, calib: str):
    import blockfold
    from blockfold.data import build_calibration
    from blockfold.recipe import CalibrationConfig, Recipe

    loaded = blockfold.load_model(model_spec)
    config = CalibrationConfig(source=calib, num_sequences=sequences)
    calibration = build_calibration(config, loaded.tokenizer)
    return loaded, Recipe(blocks=8, calibration=config), calibration


def measure_peak_rss(model_spec: str, sequences: int, calib: str) -> dict:
    """Peak RSS of the compress phase alone: the kernel's high-water mark is reset just before it
    (``clear_refs`` 5), so model loading does not mask what compress itself needs."""
    import blockfold
    from blockfold.runtime import peak_memory, resident_memory

    loaded, recipe, calibration = _setup(model_spec, sequences, calib)
    gc.collect()
    record = {}
    with peak_memory(torch.device("cpu"), record, "peak"):
        before = resident_memory("VmRSS") / 2**20
        started = time.perf_counter()
        blockfold.compress(loaded.model, loaded.tokenizer, recipe, calibration=calibration)
    peak = record["peak"] / 2**20
    return {"sequences": sequences, "tokens": calibration.num_tokens, "compress_seconds": time.perf_counter() - started,
            "rss_before_compress_mib": before, "peak_rss_during_compress_mib": peak,
            "compress_extra_mib": peak - before,
            "process_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure_ratio(model_spec: str, sequences: int, calib: str) -> dict:
    import blockfold

    loaded, recipe, calibration = _setup(model_spec, sequences, calib)
    with torch.no_grad():
        started = time.perf_counter()
        for batch in calibration:
            loaded.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        forward = time.perf_counter() - started
    started = time.perf_counter()
    result = blockfold.compress(loaded.model, loaded.tokenizer, recipe, calibration=calibration)
    compress = time.perf_counter() - started
    return {"sequences": sequences, "tokens": calibration.num_tokens, "forward_seconds": forward,
            "compress_seconds": compress, "ratio": compress / forward, "removed": result.manifest["removed_blocks"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sequences", default="64,256")
    parser.add_argument("--calib", default=str(DATA / "c4_demo.jsonl"))
    parser.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--memory-only", action="store_true", help="skip the timing part")
    parser.add_argument("--json", default="bench/results/compress_cost.json")
    args = parser.parse_args()
    if args.rss_child:
        print(json.dumps(measure_peak_rss(args.model, args.rss_child, args.calib)))
        return
    from blockfold.api import provenance
    from blockfold.jsonfile import write_json

    started = provenance(["bench/compress_cost.py", *sys.argv[1:]])
    sizes = [int(s) for s in args.sequences.split(",")]
    ratio = measure_ratio(args.model, sizes[0], args.calib) if not args.memory_only else None
    print(json.dumps(ratio))
    memory = []
    for size in sizes:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--calib", args.calib,
                              "--rss-child", str(size)], check=True, capture_output=True, text=True).stdout
        memory.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(memory[-1]))
    result = {"time": ratio, "memory": memory,
              "peak_rss_ratio": memory[-1]["peak_rss_during_compress_mib"] / memory[0]["peak_rss_during_compress_mib"],
              "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "provenance": started}
    write_json(args.json, result, indent=2)
    print(f"compress / forward = {ratio['ratio'] if ratio else float('nan'):.2f}; peak RSS {memory[-1]['sequences']} vs "
          f"{memory[0]['sequences']} sequences = {result['peak_rss_ratio']:.3f}")


if __name__ == "__main__":
    main()
