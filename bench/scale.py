"""Scale-up benchmarks (issue #11): memory against depth and width, cost of each pipeline.

    .venv/bin/python bench/scale.py depth       # random SmolLM2-width models of 8, 32, 96 blocks, --blocks L/4
    .venv/bin/python bench/scale.py small       # SmolLM2-135M, 64 x 512 tokens: peak RSS and time, both pipelines
    .venv/bin/python bench/scale.py tinyllama   # random TinyLlama-width, 32 blocks, float32 (~6 GB): RSS vs weights
    .venv/bin/python bench/scale.py big         # random Llama-2-7B-width, 64 blocks, bfloat16 (~27 GB, more than the RAM)
    .venv/bin/python bench/scale.py keying      # the same checkpoint: the cost of its content fingerprint

Random-weight models of real shapes (bench/random_model.py) stand in for the big ones; they are
built once under ``--work`` (default /tmp/blockfold-scale). Every compress runs ``blockfold compress``
in a fresh process, whose peak resident memory (ru_maxrss: the whole process, model loading and
saving included) is read when it ends; timings of the same section come from one run on one machine,
and only their ratios are compared. Results go to bench/results/scale.json with the commit, the
command and the machine.
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

HERE = Path(__file__).resolve().parent
DATA = Path(os.environ.get("BLOCKFOLD_DATA", HERE.parent.parent / "shared" / "data"))
RESULTS = HERE / "results" / "scale.json"

#: runs blockfold's CLI and reports the process's peak RSS and wall time on its last line. The peak is
#: the kernel's high-water mark of this process's own memory (VmHWM), not ru_maxrss: Linux carries
#: ru_maxrss across exec from the forked copy of the parent, so a benchmark process that had just
#: built a 1.4 GB model reported that as every child's peak
RUNNER = r"""
import json, sys, time
from blockfold.cli import main
started = time.perf_counter()
code = main(sys.argv[1:])
status = open("/proc/self/status").read()
peak_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
print(json.dumps({"code": code, "seconds": time.perf_counter() - started, "peak_rss_mib": peak_kib / 1024}))
"""


def run_compress(model: str, out: Path, *flags: str) -> dict:
    """``blockfold compress`` in a fresh process: its peak RSS, wall time and manifest."""
    argv = ["compress", "--model", model, "--out", str(out), "--overwrite", *flags]
    done = subprocess.run([sys.executable, "-c", RUNNER, *argv], capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        raise SystemExit(f"compress failed: {' '.join(argv)}\n{done.stderr[-3000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    manifest = json.loads((out / "blockfold_manifest.json").read_text())
    execution = manifest["execution"]
    return {"argv": argv, **measured, "compress_seconds": manifest["compress_seconds"],
            "pass_seconds": execution["pass_seconds"], "passes": execution["passes"],
            "pipeline": execution["pipeline"], "removed_blocks": manifest["removed_blocks"],
            "statistics": manifest.get("selection", {}).get("statistics"),
            "tokens": manifest["calibration"]["tokens"]}


def random_model(work: Path, preset: str, layers: int, dtype: str) -> Path:
    sys.path.insert(0, str(HERE))
    import torch
    from random_model import build_random_model, preset_config

    folder = work / f"{preset}-{layers}-{dtype}"
    if not (folder / "config.json").is_file():
        config, _ = preset_config(preset, layers)
        build_random_model(folder, config, getattr(torch, dtype))
    return folder


def weight_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def calibration_flags(sequences: int, length: int, batch: int = 8) -> list[str]:
    return ["--calib", str(DATA / "c4_demo.jsonl"), "--calib-docs", "128", "--num-seqs", str(sequences),
            "--seq-len", str(length), "--batch-size", str(batch)]


def depth(args) -> dict:
    """Peak RSS of compress --blocks L/4 at 8, 32 and 96 blocks of SmolLM2's width: with the defaults,
    and with the same fixed statistics budget and chunk at every depth (memory independent of depth)."""
    rows = []
    budgets = {"default": [], "fixed budget": ["--stats-memory", args.depth_stats_memory, "--chunk-sequences", "1"]}
    for layers in (8, 32, 96):
        folder = random_model(args.work, "smollm2-width", layers, "float32")
        for name, extra in budgets.items():
            with tempfile.TemporaryDirectory(dir=args.work) as tmp:
                run = run_compress(str(folder), Path(tmp) / "out", "--blocks", str(layers // 4), "--pipeline",
                                   "sequential", *calibration_flags(4, 512), *extra)
            run.update(layers=layers, setting=name, weight_mib=weight_bytes(folder) / 2**20,
                       selection_and_fit_over_pass=(run["compress_seconds"] - run["pass_seconds"]) / run["pass_seconds"])
            rows.append(run)
            print(json.dumps({k: run[k] for k in ("layers", "setting", "peak_rss_mib", "weight_mib", "passes",
                                                  "selection_and_fit_over_pass")}), flush=True)
    summary = {}
    for name in budgets:
        peaks = {r["layers"]: r["peak_rss_mib"] for r in rows if r["setting"] == name}
        summary[name] = {"peak_rss_96_over_8": peaks[96] / peaks[8], "peak_rss_32_over_8": peaks[32] / peaks[8]}
    return {"rows": rows, "summary": summary}


def small(args) -> dict:
    """SmolLM2-135M with the issue's 64 x 512 tokens: peak RSS of the whole process for each pipeline,
    and, in one process, the time of a plain forward pass, of compress on the whole model and of
    compress layer by layer (ratios)."""
    import torch

    import blockfold
    from blockfold.data import build_calibration
    from blockfold.models.sources import resolve_model_path
    from blockfold.recipe import Recipe
    from blockfold.runtime import Execution

    folder = resolve_model_path("smollm2-135m")
    memory = {}
    for pipeline in ("whole", "sequential"):
        with tempfile.TemporaryDirectory(dir=args.work) as tmp:
            memory[pipeline] = run_compress("smollm2-135m", Path(tmp) / "out", "--blocks", "8", "--pipeline", pipeline,
                                            *calibration_flags(64, 512))
        print(json.dumps({pipeline: memory[pipeline]["peak_rss_mib"]}), flush=True)
    recipe = Recipe.parse({"blocks": 8, "calibration": {"source": str(DATA / "c4_demo.jsonl"), "max_documents": 128,
                                                        "num_sequences": 64, "sequence_length": 512}})
    resident = blockfold.load_model(str(folder))
    calibration = build_calibration(recipe.calibration, resident.tokenizer)
    timing = {}
    with torch.no_grad():
        started = time.perf_counter()
        for batch in calibration:
            resident.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        timing["forward_seconds"] = time.perf_counter() - started
    for pipeline in ("whole", "sequential"):
        handle = blockfold.open_model(str(folder), Execution(pipeline=pipeline))
        started = time.perf_counter()
        result = blockfold.compress(handle, recipe=recipe, calibration=calibration, execution=Execution(pipeline=pipeline))
        timing[f"{pipeline}_seconds"] = time.perf_counter() - started
        timing[f"{pipeline}_removed"] = result.manifest["removed_blocks"]
        del handle, result
    timing["whole_over_forward"] = timing["whole_seconds"] / timing["forward_seconds"]
    timing["sequential_over_whole"] = timing["sequential_seconds"] / timing["whole_seconds"]
    print(json.dumps(timing), flush=True)
    return {"memory": memory, "timing": timing}


def tinyllama(args) -> dict:
    folder = random_model(args.work, "tinyllama-width", 32, "float32")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        run = run_compress(str(folder), Path(tmp) / "out", "--blocks", "8", "--pipeline", "sequential",
                           *calibration_flags(16, 512), *args.extra)
    run["weight_mib"] = weight_bytes(folder) / 2**20
    run["peak_rss_over_weights"] = run["peak_rss_mib"] / run["weight_mib"]
    print(json.dumps({k: run[k] for k in ("peak_rss_mib", "weight_mib", "peak_rss_over_weights", "seconds")}), flush=True)
    return run


def big(args) -> dict:
    folder = random_model(args.work, "llama2-7b-width", 64, "bfloat16")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        run = run_compress(str(folder), Path(tmp) / "out", "--blocks", "16", "--pipeline", "sequential",
                           *calibration_flags(4, 256, batch=4), *args.extra)
    run["weight_mib"] = weight_bytes(folder) / 2**20
    run["machine_memory_mib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    print(json.dumps({k: run[k] for k in ("peak_rss_mib", "weight_mib", "machine_memory_mib", "seconds")}), flush=True)
    return run


def keying(args) -> dict:
    """The fingerprint that keys the statistics cache and resume folders of a streamed model hashes
    every shard's bytes once (models/digests.py): its cost on the 25 GiB checkpoint of ``big``, cold
    (an empty digest index) and warm (the index read), against reading the same bytes alone."""
    import blockfold
    from blockfold.models import digests
    from blockfold.runtime import Execution

    folder = random_model(args.work, "llama2-7b-width", 64, "bfloat16")
    files = sorted(folder.glob("*.safetensors"))
    size = sum(path.stat().st_size for path in files)
    started = time.perf_counter()
    for path in files:  # the bytes alone, as the hashing reads them
        with open(path, "rb", buffering=0) as handle:
            buffer = bytearray(16 << 20)
            while handle.readinto(buffer):
                pass
    read_seconds = time.perf_counter() - started
    with tempfile.TemporaryDirectory(dir=args.work) as cache:
        os.environ["BLOCKFOLD_CACHE"] = cache
        handle = blockfold.open_model(str(folder), Execution(pipeline="sequential"))
        started = time.perf_counter()
        handle.fingerprint()
        cold = time.perf_counter() - started
        started = time.perf_counter()
        handle.fingerprint()
        warm = time.perf_counter() - started
    row = {"files": len(files), "gib": size / 2**30, "read_seconds": read_seconds, "cold_seconds": cold,
           "warm_seconds": warm, "cold_gib_per_s": size / 2**30 / cold, "cold_over_read": cold / read_seconds,
           "parallel_files": digests.PARALLEL_FILES}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=["depth", "small", "tinyllama", "big", "keying"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/blockfold-scale"))
    parser.add_argument("--depth-stats-memory", default="64MiB", help="depth: the fixed statistics budget of the second setting")
    args, extra = parser.parse_known_args()  # flags it does not know go to compress (tinyllama, big)
    args.extra = extra
    args.work.mkdir(parents=True, exist_ok=True)
    from blockfold.api import provenance
    from blockfold.jsonfile import write_json

    started = provenance(["bench/scale.py", *sys.argv[1:]])
    result = {"depth": depth, "small": small, "tinyllama": tinyllama, "big": big, "keying": keying}[args.section](args)
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results[args.section] = {**result, "provenance": started}
    write_json(RESULTS, results, indent=1)


if __name__ == "__main__":
    main()
