"""``blockfold analyze``: where the redundancy lies, from one calibration pass.

Writes ``analysis.json`` and PNG figures: the angular distance of every span (start × length) with
the best span per length; cosine and linear-CKA similarity between the residual streams at every
pair of layer boundaries; and per-layer linearity (CCA bound, NMSE) of attention sublayers and of
whole blocks. Cosine and distances are exact over all calibration tokens; CKA uses a fixed random
subset of tokens (``cka_tokens``), since exact streaming CKA for all pairs needs (L+1)² d×d sums.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from blockfold.data import CalibrationSet
from blockfold import distributed
from blockfold.jsonfile import write_json
from blockfold.models.handle import ModelHandle
from blockfold.pipelines import Runner
from blockfold.runtime import Execution
from blockfold.select import best_span, by_start, cca_bound, nmse
from blockfold.stats import SpanStatistics, SublayerLinearity
from blockfold.stats.similarity import StreamSubsample, pairwise_linear_cka
from blockfold.report import plots
from blockfold.surgery import staged_folder


def _finite(array: np.ndarray) -> list:
    return [[None if not math.isfinite(v) else float(v) for v in row] for row in array.tolist()]


def analyze(handle: ModelHandle, calibration: CalibrationSet, out: Path, cka_tokens: int = 1024, seed: int = 0,
            overwrite: bool = False, execution: Execution | None = None) -> dict:
    """Run the pass and write the folder ``out`` (staged, then renamed into place). Under torchrun
    every process shares the pass and the first writes the folder (the others return an empty dict)."""
    if not distributed.current().is_main:
        _measure(handle, calibration, cka_tokens, seed, execution)
        return {}
    with staged_folder(out, overwrite) as stage:
        return analyze_into(handle, calibration, stage, cka_tokens, seed, execution)


def analyze_into(handle: ModelHandle, calibration: CalibrationSet, out: Path, cka_tokens: int = 1024, seed: int = 0,
                 execution: Execution | None = None) -> dict:
    """Run the pass and write the analysis into the existing folder ``out``."""
    started = time.perf_counter()
    observers = _measure(handle, calibration, cka_tokens, seed, execution)
    return _write(handle.num_layers(), calibration, out, *observers, started)


def _measure(handle: ModelHandle, calibration: CalibrationSet, cka_tokens: int, seed: int,
             execution: Execution | None) -> tuple[SpanStatistics, StreamSubsample, SublayerLinearity, SublayerLinearity]:
    num_layers = handle.num_layers()
    observers = (SpanStatistics(num_layers, max_length=num_layers),
                 StreamSubsample(num_layers, cka_tokens, calibration.num_tokens, seed),
                 SublayerLinearity(num_layers, "attention"), SublayerLinearity(num_layers, "block"))
    Runner(handle, execution).run(calibration, list(observers), description="analysis pass")
    return observers


def _write(num_layers: int, calibration: CalibrationSet, out: Path, spans: SpanStatistics, subsample: StreamSubsample,
           attention: SublayerLinearity, blocks: SublayerLinearity, started: float) -> dict:
    table = spans.finalize()
    cosine = np.full((num_layers + 1, num_layers + 1), np.nan)
    for i in range(num_layers + 1):
        cosine[i, i] = 1.0
        for j in range(i + 1, num_layers + 1):
            cosine[i, j] = cosine[j, i] = table.cosine_all[i, j - i]
    sampled = subsample.hidden()
    cka_tokens = int(sampled[0].shape[0])
    cka = pairwise_linear_cka(sampled).numpy()
    best = {}
    for length in range(1, num_layers):  # every length with an admissible span, as the heatmap marks
        if by_start(table.angular_last, length):
            choice = best_span(table.angular_last, length, "angular_last")
            best[length] = {"start": choice.start, "blocks": [choice.start, choice.blocks[-1]], "angular_last": choice.score}
    linearity = {}
    for target, observer in (("attention", attention), ("block", blocks)):
        statistics = observer.finalize()
        linearity[target] = {"cca": [cca_bound(s, per_dimension=True) for s in statistics],
                             "nmse": [nmse(s) for s in statistics],
                             "cosine": [1.0 - s.mean_cosine for s in statistics]}
    figures = {
        "span_angular_last": plots.span_heatmap(table.angular_last, {n: b["start"] for n, b in best.items()},
                                                out / "span_angular_last.png",
                                                "angular distance of each span (last token); dots: best per length"),
        "similarity_cosine": plots.similarity_matrix(cosine, out / "similarity_cosine.png",
                                                     "mean cosine between residual streams", "cosine"),
        "similarity_cka": plots.similarity_matrix(cka, out / "similarity_cka.png",
                                                  f"linear CKA between residual streams ({cka_tokens} tokens)",
                                                  "linear CKA"),
        "linearity": plots.per_layer_lines(
            {f"{target} {name}": values[name] for target, values in linearity.items() for name in ("cca", "nmse")},
            out / "linearity.png", "how linear each sublayer is (lower: a linear map replaces it better)",
            "CCA bound per dimension / NMSE", log=True),
    }
    result = {
        "format": "blockfold-analysis/1",
        "num_layers": num_layers,
        "calibration": calibration.description,
        "seconds": time.perf_counter() - started,
        "span_distances": {"angular_last": _finite(table.angular_last), "angular_all": _finite(table.angular_all)},
        "best_span_per_length": best,
        "similarity": {"cosine": _finite(cosine), "linear_cka": _finite(cka), "cka_tokens": cka_tokens},
        "linearity": linearity,
        "figures": {name: path.name for name, path in figures.items()},
    }
    write_json(out / "analysis.json", result)
    return result
