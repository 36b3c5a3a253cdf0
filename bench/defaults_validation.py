"""Defaults validated on data they were not chosen on (issue #12).

The default span criterion, NBL's default ranking and the "best configuration" map were chosen on the
first 40 WikiText-2 windows.
This measures every candidate on those windows and on held-out text: later WikiText-2 windows, C4
documents the calibration never saw, and LAMBADA passages, on SmolLM2-135M and Gemma-3-270m.

    .venv/bin/python bench/defaults_validation.py                       # both models, both studies
    .venv/bin/python bench/defaults_validation.py --models smollm2-135m:8:4 --studies span
    .venv/bin/python bench/defaults_validation.py --models gemma3-270m:4:4 --studies fold   # sandwich folds

Spans: one calibration pass scores every criterion; each distinct choice is compressed once
(``compress --span-start``) and measured on every text. NBL: one compression per linearity
criterion at the same number of attention layers, all from one statistics pass.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import blockfold
from blockfold.api import as_handle, provenance
from blockfold.data import build_calibration
from blockfold.errors import BlockfoldError
from blockfold.estimate import fit_span_map
from blockfold.eval import perplexity, tokenize_windows
from blockfold.jsonfile import write_json
from blockfold.methods import Job, PassCache
from blockfold.methods.replaceme import measure_spans
from blockfold.pipelines import Runner
from blockfold.recipe import CalibrationConfig, Recipe
from blockfold.select import LINEARITY_CRITERIA, SPAN_CRITERIA, best_span, span_criteria
from blockfold.adapters import get_adapter
from blockfold.settings import NBL, ReplaceMe

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))
CALIBRATION_DOCUMENTS = 128  # c4_demo documents 0-127 calibrate; 200-299 are held out


def evaluation_texts(tokenizer, windows: int) -> dict:
    """Name → token windows of 512: the data the defaults were chosen on, then three held-out sets."""
    wikitext = tokenize_windows((DATA / "wikitext2_test.txt").read_text(encoding="utf-8"), tokenizer, 512, None)
    c4 = [json.loads(line)["text"] for line in (DATA / "c4_demo.jsonl").read_text(encoding="utf-8").splitlines()[200:]]
    lambada = [json.loads(line)["text"] for line in (DATA / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()]
    return {
        "WikiText-2 windows 0-39 (chosen on)": wikitext[:40],
        f"WikiText-2 windows 40-{39 + windows} (held out)": wikitext[40 : 40 + windows],
        "C4 documents 200-299 (held out)": tokenize_windows("\n\n".join(c4), tokenizer, 512, windows),
        "LAMBADA passages (held out)": tokenize_windows("\n\n".join(lambada), tokenizer, 512, windows),
    }


def measure(model, texts: dict, label: str) -> dict:
    return {name: perplexity(model, windows, description=f"{label}: {name[:12]}")["perplexity"]
            for name, windows in texts.items()}


def span_study(loaded, blocks: int, calibration, texts: dict) -> dict:
    cache = PassCache()
    handle = as_handle(copy.deepcopy(loaded.model), loaded.tokenizer, None)
    job = Job(handle, ReplaceMe(blocks=blocks), calibration, Runner(handle), cache)
    measured = measure_spans(job, [blocks], blocks, ReplaceMe.model_fields["criterion"].default, all_criteria=True)
    scores = span_criteria(measured.distances, measured.tables, measured.moments,
                           lambda eq: fit_span_map(eq, "lstsq", warn=False)[0])
    choices = {name: best_span(scores[name], blocks, name).start for name in SPAN_CRITERIA}
    by_start = {}
    for start in sorted(set(choices.values())):
        result = blockfold.compress(as_handle(copy.deepcopy(loaded.model), loaded.tokenizer, None),
                                    recipe=Recipe(blocks=blocks, span_start=start), calibration=calibration, cache=cache)
        by_start[start] = measure(result.model, texts, f"span {start}")
        print(json.dumps({"start": start, **by_start[start]}), flush=True)
    return {"default": ReplaceMe.model_fields["criterion"].default, "blocks": blocks,
            "rows": [{"candidate": name, "start": start, "perplexity": by_start[start]} for name, start in choices.items()]}


#: the maps "Best configuration" compares on the default span (BENCHMARKS.md, issue #5)
ESTIMATORS = {"lstsq": {"estimator": "lstsq"}, "orthogonal": {"estimator": "orthogonal"},
              "cosine + L1 1e-4": {"estimator": "cosine", "cosine": {"l1_penalty": 1e-4}}}


def map_study(loaded, blocks: int, calibration, texts: dict, candidates: dict[str, dict], default: str) -> dict:
    """The default span, one compression per candidate's ReplaceMe settings, one calibration pass;
    on sandwich blocks each row records the fold it got."""
    cache, rows = PassCache(), []
    for name, settings in candidates.items():
        try:
            result = blockfold.compress(as_handle(copy.deepcopy(loaded.model), loaded.tokenizer, None),
                                        recipe=Recipe(blocks=blocks, **settings), calibration=calibration, cache=cache)
        except BlockfoldError as error:  # a candidate that cannot be built on this span is a finding, not a crash
            rows.append({"candidate": name, "refused": str(error)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        row = {"candidate": name, "layers": result.manifest["removed_blocks"],
               "recipe": result.recipe.model_dump(mode="json"), "perplexity": measure(result.model, texts, f"map {name}")}
        if "regime" in result.manifest["transform"]:
            row["regime"] = result.manifest["transform"]["regime"]
        rows.append(row)
        print(json.dumps(row["perplexity"]), flush=True)
    return {"default": default, "rows": rows}


#: the estimators whose own map can score a span differently from lstsq (cosine is scored by lstsq)
SCORED_ESTIMATORS = {"diagonal": {"estimator": "diagonal"}, "orthogonal": {"estimator": "orthogonal"},
                     "lowrank": {"estimator": "lowrank", "rank": 32}, "identity": {"estimator": "identity"}}


def selection_study(loaded, blocks: int, calibration, texts: dict) -> dict:
    """Issue #16 item 3: for each estimator and each fit criterion, the span picked when every
    candidate is scored with that estimator's own map against the span picked when scored with the
    lstsq map; each distinct (estimator, span) compressed once and measured. One pass serves all."""
    cache = PassCache()
    handle = as_handle(copy.deepcopy(loaded.model), loaded.tokenizer, None)
    job = Job(handle, ReplaceMe(blocks=blocks), calibration, Runner(handle), cache)
    measured = measure_spans(job, [blocks], blocks, ReplaceMe.model_fields["criterion"].default, all_criteria=True)
    lstsq_scores = span_criteria(measured.distances, measured.tables, measured.moments,
                                 lambda eq: fit_span_map(eq, "lstsq", warn=False)[0])
    rows, measured_at = [], {}
    for name, settings in SCORED_ESTIMATORS.items():
        own = (None if name == "identity" else
               lambda eq, s=settings: fit_span_map(eq, s["estimator"], rank=s.get("rank"), warn=False)[0])
        own_scores = span_criteria(measured.distances, measured.tables, measured.moments, own)
        for criterion in ("fit_error", "fit_error_stream"):
            for scored_with, scores in (("own map", own_scores), ("lstsq map", lstsq_scores)):
                start = best_span(scores[criterion], blocks, criterion).start
                if (name, start) not in measured_at:
                    result = blockfold.compress(as_handle(copy.deepcopy(loaded.model), loaded.tokenizer, None),
                                                recipe=Recipe(blocks=blocks, span_start=start, **settings),
                                                calibration=calibration, cache=cache)
                    measured_at[name, start] = measure(result.model, texts, f"{name} at {start}")
                rows.append({"estimator": name, "criterion": criterion, "scored_with": scored_with, "start": start,
                             "perplexity": measured_at[name, start]})
                print(json.dumps(rows[-1]), flush=True)
    return {"blocks": blocks, "rows": rows}


def compare_study(loaded, blocks: int, calibration) -> dict:
    """Issue #16 item 3: ``span_scoring: compare`` for each estimator and fit criterion: which span it
    keeps (lstsq's or the folded map's, by held-out calibration loss) where the two differ. No text is
    measured here: the selection study measured every span either scoring picks."""
    cache = PassCache()
    rows = []
    for name, settings in SCORED_ESTIMATORS.items():
        for criterion in ("fit_error", "fit_error_stream"):
            result = blockfold.compress(as_handle(copy.deepcopy(loaded.model), loaded.tokenizer, None),
                                        recipe=Recipe(blocks=blocks, criterion=criterion, span_scoring="compare",
                                                      **settings),
                                        calibration=calibration, cache=cache)
            rows.append({"estimator": name, "criterion": criterion, "start": result.manifest["removed_blocks"][0],
                         "comparison": result.manifest["selection"].get("span_scoring_comparison")})
            print(json.dumps(rows[-1]), flush=True)
    return {"blocks": blocks, "rows": rows}


#: sandwich-norm models: auto (linearized-norm) against through-norm, the fold version 3's auto chose on Gemma
FOLDS = {"auto": {"sandwich_fold": "auto"}, "through-norm": {"sandwich_fold": "through-norm"}}


def nbl_study(loaded, layers: int, calibration, texts: dict) -> dict:
    rows, cache = [], PassCache()  # one statistics pass serves every ranking
    for criterion in LINEARITY_CRITERIA:
        result = blockfold.compress(copy.deepcopy(loaded.model), loaded.tokenizer,
                                    Recipe.of(NBL(attention_layers=layers, linearity_criterion=criterion)),
                                    calibration=calibration, cache=cache)
        rows.append({"candidate": criterion, "layers": result.manifest["replaced"]["layers"],
                     "perplexity": measure(result.model, texts, f"nbl {criterion}")})
        print(json.dumps(rows[-1]), flush=True)
    return {"default": NBL().resolved_criterion(get_adapter(loaded.model)), "rows": rows}


def verdict(study: dict) -> dict:
    """Per text: the best candidate, and the default's perplexity over the best's."""
    out, measured = {}, [row for row in study["rows"] if "perplexity" in row]  # refused candidates have none
    for text in measured[0]["perplexity"]:
        best = min(measured, key=lambda row: row["perplexity"][text])
        default = next(row for row in measured if row["candidate"] == study["default"])
        out[text] = {"best": best["candidate"], "default_over_best": default["perplexity"][text] / best["perplexity"][text]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m:8:8,gemma3-270m:4:4",
                        help="model:blocks:attention layers, comma-separated")
    parser.add_argument("--studies", default="span,nbl",
                        help="span, nbl, estimator (the maps of 'Best configuration'), fold (sandwich-norm models), "
                             "selection (each estimator's span scored by its own map or by lstsq), "
                             "compare (the span span_scoring compare keeps for each estimator)")
    parser.add_argument("--windows", type=int, default=40, help="windows of 512 tokens per held-out text")
    parser.add_argument("--calib", default="c4", choices=["c4", "self"],
                        help="c4: c4_demo documents 0-127 (the issue-2 recipe); self: text the model writes (the CLI's default)")
    parser.add_argument("--json", default="bench/results/defaults_validation.json")
    args = parser.parse_args()
    started = provenance(["bench/defaults_validation.py", *sys.argv[1:]])
    results = {"models": {}, "provenance": started}
    for item in args.models.split(","):
        spec, blocks, layers = item.split(":")
        loaded = blockfold.load_model(spec)
        config = (CalibrationConfig(source=str(DATA / "c4_demo.jsonl"), max_documents=CALIBRATION_DOCUMENTS)
                  if args.calib == "c4" else CalibrationConfig(source="self"))
        calibration = build_calibration(config, loaded.tokenizer, loaded.model)
        studies = args.studies.split(",")
        model_results = {"calibration": calibration.description}
        if set(studies) != {"compare"}:  # every other study measures text
            texts = evaluation_texts(loaded.tokenizer, args.windows)
            model_results["original"] = measure(loaded.model, texts, "original")
        if "span" in studies:
            model_results["span"] = span_study(loaded, int(blocks), calibration, texts)
            model_results["span"]["verdict"] = verdict(model_results["span"])
        if "estimator" in studies:
            model_results["estimator"] = map_study(loaded, int(blocks), calibration, texts, ESTIMATORS, "lstsq")
            model_results["estimator"]["verdict"] = verdict(model_results["estimator"])
        if "fold" in studies:
            model_results["fold"] = map_study(loaded, int(blocks), calibration, texts, FOLDS, "auto")
            model_results["fold"]["verdict"] = verdict(model_results["fold"])
        if "selection" in studies:
            model_results["selection"] = selection_study(loaded, int(blocks), calibration, texts)
        if "compare" in studies:
            model_results["compare"] = compare_study(loaded, int(blocks), calibration)
        if "nbl" in studies:
            model_results["nbl"] = nbl_study(loaded, int(layers), calibration, texts)
            model_results["nbl"]["verdict"] = verdict(model_results["nbl"])
        results["models"][item] = model_results  # model:blocks:layers, so budgets of one model stay apart
        write_json(args.json, results, indent=1)
        del loaded


if __name__ == "__main__":
    main()
