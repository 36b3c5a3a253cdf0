"""Compressed models in the engines users serve with (issue #14): vLLM (CPU build) and llama.cpp
(llama-cpp-python), each in its own environment (``scripts/serve-check.sh`` sets them up).

    scripts/serve-check.sh smollm2-135m --engine llamacpp && scripts/serve-check.sh smollm2-135m --engine vllm
    .venv/bin/python bench/serving.py --json bench/results/serving.json

For each model: the original, ReplaceMe and NBL (calibration: 128 c4_demo documents, today's
defaults), greedy tokens of each engine against transformers (float32) on the same 20 LAMBADA prompt
ids (64 tokens, 16 new), prefill and decode throughput original against compressed in one run, and
the GGUF round trip: the source's own quantized file against the compressed model exported with
``--quant source``, perplexity in llama.cpp on WikiText-2 windows.

``--part llamacpp`` measures issue #14's llama.cpp export on its own (no vLLM) and merges it into
``--json`` under ``llamacpp``, keeping what is there:

    .venv/bin/python bench/serving.py --part llamacpp --work /tmp/serving-work

- export from a plain Hugging Face folder (the converted folder without its record of the GGUF it
  came from, so llama.cpp's metadata is built from config.json and tokenizer.json): the original and
  ReplaceMe compressed from that folder, at f16 and at a fresh ``q4_k_m``, greedy tokens against
  transformers and llama.cpp's tokenization of the same texts;
- perplexity of those files on the round trip's WikiText-2 windows, beside the source GGUF and the
  ``--quant source`` round trip (ReplaceMe compressed from the GGUF-converted folder, as above);
- prefill and decode tokens/s from llama.cpp's own performance counters (the time inside its decode
  calls, not Python's around them), best of ``--throughput-rounds`` runs taken in turn.

Compressed outputs are kept in ``--work`` and reused by a later invocation (to restart after an
engine failure without compressing again); delete that folder to measure from scratch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import blockfold
from blockfold.api import provenance
from blockfold.errors import BlockfoldError
from blockfold.eval import tokenize_windows
from blockfold.export import export_gguf
from blockfold.export.gguf import _source_gguf  # the source GGUF a converted model records
from blockfold.jsonfile import write_json
from blockfold.models.sources import resolve_model_path
from blockfold.serving import read_prompts, run_engine, transformers_greedy

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))
log = logging.getLogger("bench.serving")


def _windows(tokenizer, count: int, length: int) -> list[list[int]]:
    """The project's perplexity windows (each beginning with BOS where the tokenizer adds one)."""
    return tokenize_windows((DATA / "wikitext2_test.txt").read_text(), tokenizer, length, count).tolist()


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
        row[f"{label}_perplexity"] = _perplexity(path, windows, args)
    print("round trip", json.dumps(row), flush=True)
    return row


def _perplexity(gguf: Path, windows: list[list[int]], args) -> float:
    result = run_engine("llamacpp", {"model": str(gguf), "prompts": [], "new_tokens": 0, "threads": args.threads,
                                     "perplexity_windows": windows})
    return float(2.718281828459045 ** (result["nll"] / result["nll_tokens"]))


def plain_folder(converted: Path, target: Path) -> Path:
    """``converted`` as a plain Hugging Face folder: every file linked except ``blockfold_source.json``,
    the record of the GGUF it came from, so the exporter builds llama.cpp's metadata from config.json
    and tokenizer.json, and an output compressed from it names a source with no GGUF behind it."""
    target.mkdir(parents=True, exist_ok=True)
    for path in converted.iterdir():
        if path.name != "blockfold_source.json" and not (target / path.name).is_symlink():
            (target / path.name).symlink_to(path.resolve())
    return target


def _same_weights(first: Path, second: Path) -> bool:
    """Whether two compressed outputs hold the same tensors, bit for bit."""
    with safe_open(first / "model.safetensors", "pt") as a, safe_open(second / "model.safetensors", "pt") as b:
        return set(a.keys()) == set(b.keys()) and all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def _idle_share(seconds: float = 2.0) -> float:
    """The share of every core's time spent idle over the next ``seconds`` (/proc/stat; 1.0 elsewhere)."""
    def times() -> list[int]:
        return [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]

    if not Path("/proc/stat").is_file():
        return 1.0
    before = times()
    time.sleep(seconds)
    spent = [after - first for after, first in zip(times(), before)]
    return (spent[3] + spent[4]) / max(1, sum(spent))  # idle and iowait


def _wait_for_idle(args) -> tuple[float, float]:
    """Wait (up to ``--idle-wait`` seconds) until the machine is idle but for us: llama.cpp's threads
    wait for each other at every operation, so one busy core of two can cut its rate several-fold,
    far more than a fair share. The idle share measured last and the seconds waited."""
    started = time.monotonic()
    while True:
        idle = _idle_share()
        waited = time.monotonic() - started
        if idle >= args.idle_share or waited >= args.idle_wait:
            return idle, waited
        log.info("machine %.0f %% idle: waiting for %.0f %% before timing", 100 * idle, 100 * args.idle_share)
        time.sleep(10)


def _engine_rates(result: dict, idle: tuple[float, float]) -> dict:
    """Tokens/s from llama.cpp's counters, and from the seconds the runner timed around each call;
    with how idle the machine was just before (another user's work on a shared machine shows there)."""
    engine = result["engine"]
    return {"prefill_tokens_per_s": engine["prefill_tokens"] / engine["prefill_ms"] * 1e3,
            "decode_tokens_per_s": engine["decode_tokens"] / engine["decode_ms"] * 1e3,
            "prefill_tokens": engine["prefill_tokens"], "decode_tokens": engine["decode_tokens"],
            "python_prefill_tokens_per_s": result["prefill_tokens"] / result["prefill_seconds"],
            "python_decode_tokens_per_s": result["decode_tokens"] / result["decode_seconds"],
            "idle_share_before": idle[0], "waited_for_idle_s": idle[1]}


def _agreement(result: dict, reference: list[list[int]], gaps: list[list[float]], expected: list[list[int]]) -> dict:
    matching = [a == b for a, b in zip(reference, result["tokens"])]
    parted = [(index, next(step for step, (a, b) in enumerate(zip(ref, got)) if a != b))
              for index, (ref, got, same) in enumerate(zip(reference, result["tokens"], matching)) if not same]
    return {"matching": sum(matching), "prompts": len(matching),
            "gaps_where_parted": [gaps[index][step] for index, step in parted],
            "tokenization_agrees": sum(a == b for a, b in zip(expected, result["tokenized"]))}


def measure_llamacpp(model: str, blocks: int, scratch: Path, calibration: dict, args) -> dict:
    """Issue #14's llama.cpp export items for one model (see the module's docstring)."""
    converted = Path(resolve_model_path(model))
    plain = plain_folder(converted, scratch / f"{model}-hf")
    name = f"replaceme-{blocks}"
    folders = {"original": plain, name: scratch / f"{name}-from-hf"}
    from_gguf = scratch / name  # the matrix's output, compressed from the GGUF-converted folder
    for spec, folder in ((str(plain), folders[name]), (model, from_gguf)):
        if not (folder / "blockfold_manifest.json").is_file():  # saves are atomic: present means whole
            blockfold.compress(spec, recipe=blockfold.Recipe.of(blockfold.ReplaceMe(blocks=blocks), calibration)
                               ).save(folder)
    manifest = json.loads((folders[name] / "blockfold_manifest.json").read_text())
    entry = {"model": model, "variants": [], "source_has_gguf_record": _source_gguf(manifest, folders[name]) is not None,
             "same_weights_as_from_gguf": _same_weights(folders[name], from_gguf)}
    tokenizer = AutoTokenizer.from_pretrained(plain)
    texts, ids = read_prompts(DATA / "lambada_test.jsonl", tokenizer, args.prompts, 64)
    expected = [tokenizer(text)["input_ids"] for text in texts]
    windows = _windows(tokenizer, args.ppl_windows, 512)
    references, ggufs = {}, {}
    for variant, folder in folders.items():
        model_fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
        references[variant] = transformers_greedy(model_fp32, ids, args.new_tokens)
        del model_fp32
        for quant in args.fresh_quants.split(","):
            ggufs[variant, quant] = export_gguf(folder, scratch / f"{variant}-hf-{quant}.gguf", quant=quant,
                                                overwrite=True)
    rows = {variant: {"variant": variant, "exports": {}} for variant in folders}
    for quant in args.fresh_quants.split(","):
        rounds = {variant: [] for variant in folders}
        for turn in range(args.throughput_rounds):  # in turn, so a burst of other load slows both, not one
            for variant in folders:
                idle = _wait_for_idle(args)
                result = run_engine("llamacpp", {"model": str(ggufs[variant, quant]), "prompts": ids,
                                                 "new_tokens": args.new_tokens, "threads": args.threads,
                                                 "texts": texts, "warmup": True})
                if turn == 0:
                    rows[variant]["exports"][quant] = {
                        **_agreement(result, *references[variant], expected),
                        "gguf_mb": ggufs[variant, quant].stat().st_size / 1e6}
                rounds[variant].append(_engine_rates(result, idle))
        for variant in folders:
            row = rows[variant]["exports"][quant]
            row["throughput_rounds"] = rounds[variant]
            for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                row[key] = max(one[key] for one in rounds[variant])
            row["perplexity"] = _perplexity(ggufs[variant, quant], windows, args)
            print(model, variant, quant, json.dumps({k: v for k, v in row.items() if k != "throughput_rounds"}),
                  flush=True)
    entry["variants"] = list(rows.values())
    entry["round_trip"] = round_trip(model, from_gguf, scratch, args)
    return entry


def _merged(path: Path, update: dict) -> dict:
    """The results already at ``path`` with ``update``'s keys replaced: each part keeps the other's."""
    record = json.loads(path.read_text()) if path.is_file() else {}
    return {**record, **update}


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
    parser.add_argument("--part", choices=["engines", "llamacpp"], default="engines",
                        help="engines: every variant in vLLM and llama.cpp; llamacpp: only the llama.cpp export "
                             "items (plain HF folder, fresh K-quant, llama.cpp's own throughput), merged into --json")
    parser.add_argument("--fresh-quants", default="f16,q4_k_m", help="--part llamacpp: types exported from the folder")
    parser.add_argument("--throughput-rounds", type=int, default=3,
                        help="--part llamacpp: runs per file, original and compressed in turn; the fastest counts")
    parser.add_argument("--idle-share", type=float, default=0.9,
                        help="--part llamacpp: time a run once this share of the CPU time is idle (over 2 s)")
    parser.add_argument("--idle-wait", type=float, default=900,
                        help="--part llamacpp: the most seconds to wait for that before timing anyway")
    args = parser.parse_args()
    logging.basicConfig(format="serving: %(message)s")
    log.setLevel(logging.INFO)  # this bench's waits; the libraries' own progress stays at warnings
    command = provenance(["bench/serving.py", *sys.argv[1:]])
    calibration = {"source": str(DATA / "c4_demo.jsonl"), "max_documents": 128}
    if args.part == "llamacpp":
        part = {"provenance": command, "prompts": args.prompts, "new_tokens": args.new_tokens,
                "threads": args.threads, "ppl_windows": args.ppl_windows,
                "throughput_rounds": args.throughput_rounds, "idle_share": args.idle_share, "models": []}
        for spec in args.models.split(","):
            model, blocks = spec.split(":")[:2]
            (args.work / model).mkdir(parents=True, exist_ok=True)
            part["models"].append(measure_llamacpp(model, int(blocks), args.work / model, calibration, args))
            write_json(args.json, _merged(Path(args.json), {"llamacpp": part}), indent=1)
        return
    record = {"provenance": command, "prompts": args.prompts,
              "new_tokens": args.new_tokens, "threads": args.threads, "models": []}
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
        kept = {key: value for key, value in _merged(Path(args.json), {}).items() if key == "llamacpp"}
        write_json(args.json, {**record, **kept}, indent=1)


if __name__ == "__main__":
    main()
