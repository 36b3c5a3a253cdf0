"""``blockfold sweep``: every method at every budget, measured the same way, into one run folder.

For each (method, budget) the original model is copied, compressed with one shared calibration set,
and measured: perplexity, harness tasks (the original's are cached by weight fingerprint), relative
performance, parameters, KV-cache bytes per token, prefill speed against the original (same
process, interleaved), and CO₂eq of the compress and of the evaluation (codecarbon's offline
tracker). An optional placement study fixes the span length and measures every start. Everything
goes to ``sweep.json``, which the CLI then renders as the report (``blockfold report`` renders it again).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import yaml
from pydantic import Field, model_validator

import blockfold
from blockfold import distributed
from blockfold.adapters import get_adapter
from blockfold.api import environment
from blockfold.data import build_calibration
from blockfold.errors import BlockfoldError
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.eval.speed import decode_seconds, kv_cache_bytes, parameter_counts, prefill_seconds
from blockfold.jsonfile import write_json
from blockfold.pipelines.persist import calibration_digest, changed_since
from blockfold.recipe import CalibrationConfig, Recipe
from blockfold.runtime import Execution, peak_memory
from blockfold.schema import Strict
from blockfold.surgery import staged_folder

SWEEP_VERSION = 1
logger = logging.getLogger(__name__)


class SweepConfig(Strict):
    sweep_version: int = SWEEP_VERSION
    model: str
    methods: list[str] = Field(default_factory=lambda: ["replaceme", "uidl"])
    budgets: list[int] = Field(default_factory=lambda: [2, 4, 6, 8])
    #: the share of the blocks' parameters each run removes, instead of ``budgets``: one axis for depth and
    #: width methods alike, each method at the count of its own units nearest it
    sparsities: list[float] = Field(default_factory=list)
    tasks: list[str] = Field(default_factory=list)
    limit: int | None = Field(None, ge=1)
    fewshot: int = Field(0, ge=0)
    ppl_text: str | None = None  # PATH or PATH[FIRST:LAST] (eval.perplexity.read_eval_text)
    #: further perplexity texts, measured beside ``ppl_text`` (e.g. C4 documents the calibration never saw)
    held_out: list[str] = Field(default_factory=list)
    ppl_windows: int | None = Field(40, ge=1)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    placement_blocks: int | None = Field(None, ge=1)
    speed_length: int = Field(512, ge=8)
    decode_tokens: int = Field(32, ge=1)  # greedy steps the decode speed-up is timed on
    analysis: bool = True  # also run `analyze` (span heatmap, layer similarity, linearity) into analysis/
    save_models: bool = False  # keep every compressed checkpoint under models/<method>-<budget>/
    country_iso_code: str = "USA"
    task_batch_size: int = Field(8, ge=1)
    # what the models are measured in (perplexity, tasks, speed); compression always runs in the
    # loaded precision. bfloat16 halves the evaluation time on CPUs with AVX512-BF16 or AMX
    eval_dtype: Literal["float32", "bfloat16"] = "float32"
    # where and in what precision the compressions run (the models stay resident for evaluation)
    execution: Execution = Field(default_factory=Execution)
    #: an image encoder's held-out images, in place of text: each run's embedding agreement with the original,
    #: k-NN accuracy where they sit in class subfolders and, for CLIP / SigLIP, zero-shot accuracy
    images: str | None = None

    @model_validator(mode="after")
    def _known_methods(self):
        for spec in self.methods:  # a wrong name or setting fails here, before hours of work
            method, settings = parse_method_spec(spec)
            Recipe.parse({"method": method, **settings}, origin=f"--methods {spec}")
        return self

    @model_validator(mode="after")
    def _one_axis(self):
        if self.sparsities and "budgets" in self.model_fields_set:
            raise ValueError("give budgets (--budgets) or sparsities (--sparsity), not both")
        if any(not 0 < s < 1 for s in self.sparsities):
            raise ValueError("every sparsity is a share of the blocks' parameters, between 0 and 1 (e.g. 0.1,0.25)")
        return self

    def axis(self) -> list[int] | list[float]:
        """The budgets the runs take: sparsities where given, else blocks (or attention layers)."""
        return self.sparsities or self.budgets


def parse_method_spec(spec: str) -> tuple[str, dict]:
    """``sleb:score_sequences=2;refit=all`` → (``sleb``, its settings): a method with settings of its own, as
    a sweep's row (values read as YAML scalars: numbers, true/false, names)."""
    method, _, rest = spec.partition(":")
    settings = {}
    for item in filter(None, rest.split(";")):
        key, equals, value = item.partition("=")
        if not equals:
            raise ValueError(f"--methods {spec}: write each setting as KEY=VALUE, e.g. sleb:score_sequences=2;refit=all")
        settings[key.strip()] = yaml.safe_load(value)
    return method.strip(), settings


def in_eval_dtype(model, dtype: str, copy_first: bool):
    """``model`` in ``dtype`` for measuring: a converted copy (``copy_first``) or the model itself."""
    target = getattr(torch, dtype)
    if model.dtype == target:
        return model
    return (copy.deepcopy(model) if copy_first else model).to(target)


@contextmanager
def emissions(record: dict, key: str, country: str):
    """Adds ``record[key] = kg CO₂eq`` of the block (codecarbon offline tracker; NaN if unavailable)."""
    # codecarbon logs its set-up (INFO) and that several trackers may run (WARNING) before log_level applies;
    # its import sets the level, so the level is raised after it
    codecarbon_logger = logging.getLogger("codecarbon")
    level = codecarbon_logger.level
    try:
        from codecarbon import OfflineEmissionsTracker

        codecarbon_logger.setLevel(logging.ERROR)
        tracker = OfflineEmissionsTracker(country_iso_code=country, output_methods=[], log_level="error")
        tracker.start()
    except Exception:  # codecarbon missing or unable to measure here: the run goes on without it
        tracker = None
    finally:
        codecarbon_logger.setLevel(level)
    try:
        yield
    finally:
        record[key] = float(tracker.stop() or 0.0) if tracker is not None else float("nan")


def _measure_model(model, tokenizer, config: SweepConfig, texts: dict, fingerprint_cache: Path | None) -> dict:
    """Size, perplexity on every text of ``texts`` (name → windows; the first is the run's ``perplexity``)
    and task accuracy."""
    from blockfold.models import model_fingerprint

    result = {"parameters": parameter_counts(model), "kv_cache_bytes_per_token": kv_cache_bytes(model, 64) / 64}
    if texts:
        measured = {name: perplexity(model, windows, description=f"perplexity: {name}") for name, windows in texts.items()}
        result.update(next(iter(measured.values())))
        result["perplexities"] = {name: value["perplexity"] for name, value in measured.items()}
    if config.tasks:
        from blockfold.eval.tasks import cached_evaluate

        result["tasks"] = cached_evaluate(model, tokenizer, config.tasks, fingerprint_cache, model_fingerprint(model),
                                          limit=config.limit, fewshot=config.fewshot,
                                          batch_size=config.task_batch_size)
        accuracies = [r["metrics"]["acc"] for r in result["tasks"].values() if "acc" in r["metrics"]]
        result["average_accuracy"] = float(np.mean(accuracies)) if accuracies else None
    return result


def _measure_encoder(handle, config: SweepConfig, reference: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
    """Size and what an image encoder's embeddings keep on ``config.images``: agreement with ``reference``
    (the original's embeddings), k-NN accuracy, and zero-shot accuracy for a dual encoder; and its embeddings."""
    from blockfold.eval.vision import embedding_agreement, image_embeddings, knn_accuracy, zero_shot_accuracy

    embeddings, labels = image_embeddings(handle, config.images)
    result = {"parameters": parameter_counts(handle.model), "images": {"count": len(embeddings)}}
    if labels is not None:
        result["images"]["knn_accuracy"] = knn_accuracy(embeddings, labels)
        if handle.container is not None and hasattr(handle.container, "get_text_features"):
            result["zero_shot"] = zero_shot_accuracy(handle, config.images, embedded=(embeddings, labels))
    if reference is not None:
        result["embedding_agreement"] = embedding_agreement(embeddings, reference)
    return result, embeddings


def _image_speedup(original, compressed, config: SweepConfig, count: int = 8) -> dict:
    """One forward of ``count`` held-out images, where an encoder's cut blocks save their share."""
    from blockfold.data.images import image_files, pixel_batches

    batches, _ = pixel_batches(image_files(config.images)[:count], original.tokenizer, original.adapter,
                               original.config, count)
    pixels = batches[0].pixel_values.to(original.device, original.dtype)

    def timed(model) -> float:
        with torch.no_grad():
            started = time.perf_counter()
            model(pixel_values=pixels)
            return time.perf_counter() - started

    return {"images": len(pixels), **_speedup(original.model, compressed.model, timed, len(pixels))}


def _speedup(original, compressed, timed, tokens: int, repeats: int = 5) -> dict:
    """Tokens/s of both under ``timed(model)`` (seconds for ``tokens`` tokens), interleaved after one untimed
    call each: the median of ``repeats`` and the range of the per-pair ratios, so a speed-up on a noisy
    machine says when it is inside the noise (``within_noise``: the pairs disagree on which model is
    faster). A ratio from one run, not a benchmark: with 3 cold repeats a 2-of-30-block model once
    measured 0.97x."""
    for model in (original, compressed):
        timed(model)
    times = {"original": [], "compressed": []}
    for _ in range(repeats):
        for name, model in (("original", original), ("compressed", compressed)):
            times[name].append(timed(model))
    original_s, compressed_s = (float(np.median(times[k])) for k in ("original", "compressed"))
    pairs = [o / c for o, c in zip(times["original"], times["compressed"])]
    return {"original_tokens_per_s": tokens / original_s, "tokens_per_s": tokens / compressed_s,
            "speedup": original_s / compressed_s, "pair_speedups": pairs,
            "speedup_range": [min(pairs), max(pairs)], "within_noise": min(pairs) <= 1.0 <= max(pairs)}


def _prefill_speedup(original, compressed, length: int) -> dict:
    """Prefill of ``length`` tokens (the KV cache filled, one logit row)."""
    return {"length": length, **_speedup(original, compressed, lambda model: prefill_seconds(model, length), length)}


def _decode_speedup(original, compressed, new_tokens: int, prompt_length: int = 64) -> dict:
    """Greedy decoding of ``new_tokens`` one at a time after a prompt (prefill excluded), where a cut
    block or attention layer saves its share of every step."""
    return {"new_tokens": new_tokens, "prompt_length": prompt_length,
            **_speedup(original, compressed, lambda model: decode_seconds(model, prompt_length, new_tokens), new_tokens)}


class SweepProgress:
    """What a sweep has finished, kept in ``.<out>.resume`` beside its output so a sweep stopped part way
    (a session's end, a lost machine) resumes where it stopped: the original's measurements, each finished
    run's record and saved checkpoint. Left by a sweep of another configuration, model or calibration, it
    is refused, not resumed; only the first process writes it."""

    def __init__(self, folder: Path, writes: bool):
        self.folder, self.writes = folder, writes

    def claim(self, identity: dict) -> None:
        path = self.folder / "sweep-run.json"
        changed = changed_since(path, identity)
        if changed:
            raise BlockfoldError(f"{self.folder} holds a sweep with another {', '.join(changed)}: give --no-resume "
                                 "to start afresh (it deletes it), or another --out")
        if changed is not None:
            finished = len(list((self.folder / "runs").glob("*.json")))
            logger.info("sweep: resuming from %s (%d run(s) finished)", self.folder, finished)
        elif self.writes:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_json(path, identity)

    def get(self, name: str) -> dict | None:
        path = self.folder / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def put(self, name: str, record: dict) -> None:
        if self.writes:
            (self.folder / name).parent.mkdir(parents=True, exist_ok=True)
            write_json(self.folder / f"{name}.json", record)

    def models(self) -> Path:
        return self.folder / "models"


def run_sweep(config: SweepConfig, out: Path, overwrite: bool = False, resume: bool = True) -> dict:
    """Run the sweep into ``out`` (``sweep.json``, ``analysis/``, ``models/``), staged in a temporary
    folder beside it and renamed into place only when everything is written. Finished runs are kept in
    ``.<out>.resume`` meanwhile, and a sweep started again resumes from them (``resume=False``: afresh)."""
    folder = Path(out).parent / f".{Path(out).name}.resume"
    if not resume and distributed.current().is_main:
        shutil.rmtree(folder, ignore_errors=True)
    progress = SweepProgress(folder, writes=distributed.current().is_main)
    if not distributed.current().is_main:  # under torchrun: the same sweep, its passes shared, written by rank 0
        with tempfile.TemporaryDirectory() as scratch:
            return _run_into(config, Path(scratch), progress)
    with staged_folder(out, overwrite) as stage:
        result = _run_into(config, stage, progress)
    shutil.rmtree(folder, ignore_errors=True)  # written: nothing left to resume
    return result


def _run_into(config: SweepConfig, stage: Path, progress: SweepProgress) -> dict:
    from blockfold.eval.tasks import relative_performance, task_configs
    from blockfold.methods import METHODS, PassCache
    from blockfold.models import load_model
    from blockfold.models.sources import cache_dir
    from blockfold.settings import SETTINGS, SpanSelection

    unknown = [m for m in config.methods if parse_method_spec(m)[0] not in METHODS]
    if unknown:
        raise BlockfoldError(f"unknown methods {unknown}: use {', '.join(sorted(METHODS))}")
    if config.tasks:
        task_configs(config.tasks)  # fail on unknown tasks before hours of work
    execution = config.execution
    handle = load_model(config.model, dtype=execution.dtype, device=execution.device, check=get_adapter)
    model, tokenizer = handle.model, handle.tokenizer
    encoder = handle.adapter.is_vision
    if encoder and (config.images is None or config.tasks or config.held_out):
        raise BlockfoldError(f"{config.model} is an image encoder: its sweep is measured on images (--images FOLDER; "
                             "class subfolders give k-NN and, for CLIP / SigLIP, zero-shot accuracy), not on text or "
                             "tasks")
    if config.images is not None and not encoder:
        raise BlockfoldError(f"{config.model} is a language model: --images is for image encoders")
    read = [] if encoder else [read_eval_text(spec) for spec in ([config.ppl_text] if config.ppl_text else [])
                                                                 + config.held_out]
    texts = {text.name: tokenize_windows(text, tokenizer, 512, config.ppl_windows) for text in read}
    calibration = build_calibration(config.calibration, tokenizer, model)
    task_cache = cache_dir() / "tasks"
    cache = PassCache()  # every compression of these weights shares the first pass it needs
    started = time.perf_counter()
    result = {
        "format": f"blockfold-sweep/{SWEEP_VERSION}", "config": config.model_dump(mode="json"),
        "environment": environment(), "processes": distributed.current().world_size,
        "source_model": {"spec": config.model, "fingerprint": handle.fingerprint()},
        "calibration": calibration.description, "runs": [], "skipped": [], "kind": "encoder" if encoder else "decoder",
    }
    size = handle.adapter.model_size(handle.model)
    progress.claim({"config": result["config"], "model": result["source_model"]["fingerprint"],
                    "calibration": calibration_digest(calibration.batches)})
    original_measured = model if encoder else in_eval_dtype(model, config.eval_dtype, copy_first=True)
    original = progress.get("original")
    measured, reference = {}, None
    if encoder or original is None:  # an encoder's embeddings, which every run is compared with, again on a resume
        with emissions(measured, "eval_kg_co2eq", config.country_iso_code):
            if encoder:
                found, reference = _measure_encoder(handle, config)
                measured.update(found)
            else:
                measured.update(_measure_model(original_measured, tokenizer, config, texts, task_cache))
    if original is None:
        original = measured
        progress.put("original", original)
    result["original"] = original

    def one_run(spec: str, budget: int | float) -> None:
        name = _folder_name(spec, budget)
        finished = progress.get(f"runs/{name}")
        if finished is not None:
            result["runs"].append(finished)
            return
        method, settings = parse_method_spec(spec)
        if config.sparsities:
            budget_field, value = "sparsity", budget
        else:
            budget_field, value = method_budget(SETTINGS[method], budget, handle.num_layers())
        recipe = Recipe.parse({"method": method, **settings, budget_field: value,
                               "calibration": config.calibration.model_dump()}, origin=f"{spec} at {budget}")
        try:  # a sparsity a method cannot reach on this model (NBL's attention is a small share) skips the run
            recipe.settings.for_model(size)
        except BlockfoldError as error:
            result["skipped"].append({"method": spec, "budget": budget, "reason": str(error)})
            logger.warning("sweep: %s at %s skipped: %s", spec, budget, error)
            return
        run = {"method": spec, "budget": budget, "budget_kind": budget_field, "budget_value": value,
               "sparsity": None}
        with emissions(run, "compress_kg_co2eq", config.country_iso_code), \
                peak_memory(handle.device, run, "compress_peak_memory_bytes"):
            compressed = blockfold.compress(handle.fresh_copy(), recipe=recipe, calibration=calibration,
                                            execution=execution, cache=cache)
        manifest = compressed.manifest
        run.update({"settings": manifest["recipe"]["settings"],
                    "removed_blocks": manifest.get("removed_blocks"), "replaced": manifest.get("replaced"),
                    "sparsity": manifest["sparsity"],
                    "compress_seconds": manifest["compress_seconds"],
                    "selection": {k: manifest["selection"].get(k) for k in ("criterion", "start", "score")}})
        if config.save_models:
            manifest["source_model"] = result["source_model"]
            compressed.save(progress.models() / name, save_dtype=execution.save_dtype, overwrite=True)
            run["checkpoint"] = f"models/{name}"
        if encoder:
            with emissions(run, "eval_kg_co2eq", config.country_iso_code):
                run.update(_measure_encoder(compressed.handle, config, reference)[0])
            run["speed"] = _image_speedup(handle, compressed.handle, config)
        else:
            candidate = in_eval_dtype(compressed.model, config.eval_dtype, copy_first=False)
            with emissions(run, "eval_kg_co2eq", config.country_iso_code):
                run.update(_measure_model(candidate, tokenizer, config, texts, task_cache))
            if config.tasks:
                run["relative_performance"] = relative_performance(run["tasks"], original["tasks"])
            run["speed"] = _prefill_speedup(original_measured, candidate, config.speed_length)
            run["decode_speed"] = _decode_speedup(original_measured, candidate, config.decode_tokens)
            del candidate
        result["runs"].append(run)
        progress.put(f"runs/{name}", run)
        if distributed.current().is_main:
            quality = (f"embedding cosine {run['embedding_agreement']['cosine_mean']:.4f}" if encoder
                       else f"ppl {run.get('perplexity', float('nan')):.2f}")
            print(f"sweep: {spec} {budget}: {quality}"
                  + (f", RP {run['relative_performance']['average']['rp']:.3f}" if config.tasks else ""), flush=True)
        del compressed

    lengths = _span_lengths(config.sparsities, size) if config.sparsities else config.budgets
    to_run = [spec for spec in config.methods for budget in config.axis()
              if progress.get(f"runs/{_folder_name(spec, budget)}") is None]
    if progress.get("shared_calibration_pass") is not None:
        result["shared_calibration_pass"] = progress.get("shared_calibration_pass")
    if lengths and any(issubclass(SETTINGS[parse_method_spec(m)[0]], SpanSelection) for m in to_run):
        # ReplaceMe and UIDL at every budget share one calibration pass (identical results); its
        # time and CO₂eq are recorded once, apart from the runs'
        shared = {}
        with emissions(shared, "kg_co2eq", config.country_iso_code):
            pass_started = time.perf_counter()
            _shared_span_pass(handle, calibration, lengths, execution, cache)
            shared["seconds"] = time.perf_counter() - pass_started
        result["shared_calibration_pass"] = shared
        progress.put("shared_calibration_pass", shared)
    for method in config.methods:
        for budget in config.axis():
            one_run(method, budget)
    if config.placement_blocks:  # a length among the budgets reuses the shared pass
        result["placement"] = placement_study(handle, calibration, config.placement_blocks,
                                              next(iter(texts.values()), None), config.eval_dtype,
                                              execution, cache)
    if config.analysis and encoder:
        logger.info("sweep: the analysis (span heatmap, layer similarity) is for language models; skipped")
    elif config.analysis:
        from blockfold.analyze import analyze_into

        (stage / "analysis").mkdir()
        analyze_into(handle, calibration, stage / "analysis", cka_tokens=1024, seed=config.calibration.seed,
                     execution=execution)
        result["analysis"] = "analysis/analysis.json"
    result["seconds"] = time.perf_counter() - started
    if progress.models().is_dir() and progress.writes:  # the checkpoints kept while the sweep ran
        shutil.move(progress.models(), stage / "models")
    (stage / "sweep.json").write_text(json.dumps(result, indent=1))
    return result


def _folder_name(spec: str, budget: int | float) -> str:
    """A run's checkpoint folder: ``uidl-8``, ``sleb-score_sequences-2-refit-all-8``, ``svd-llm-0.25``."""
    return "-".join(filter(None, re.split(r"[:;=,\s/]+", spec))) + f"-{budget}"


def _span_lengths(sparsities: list[float], size) -> list[int]:
    """The span lengths the span methods take at ``sparsities`` (those a span can reach)."""
    from blockfold.settings import ReplaceMe

    lengths = set()
    for sparsity in sparsities:
        with contextlib.suppress(BlockfoldError):
            lengths.add(ReplaceMe(sparsity=sparsity).for_model(size).blocks)
    return sorted(lengths)


def _span_job(handle, calibration, execution: Execution, cache):
    from blockfold.methods import Job
    from blockfold.pipelines import Runner
    from blockfold.settings import ReplaceMe

    return Job(handle, ReplaceMe(), calibration, Runner(handle, execution), cache)


def _shared_span_pass(handle, calibration, lengths: list[int], execution: Execution, cache) -> None:
    """Measure, once, everything any span method at any of ``lengths`` needs, into ``cache``."""
    from blockfold.methods.replaceme import measure_spans

    job = _span_job(handle, calibration, execution, cache)
    measure_spans(job, lengths, max(lengths), job.settings.criterion, all_criteria=True)


def method_budget(settings_class, blocks: int, num_layers: int) -> tuple[str, int | float]:
    """A sweep budget of ``blocks`` in the method's own terms: the count itself for a method that removes
    or replaces blocks or attention layers, the same share of the blocks (``blocks / num_layers``) as the
    sparsity or slicing of a width method, so every method of a sweep column has about as many parameters."""
    field = settings_class.budget_field
    return field, blocks if field in ("blocks", "attention_layers") else blocks / num_layers


def placement_study(handle, calibration, blocks: int, windows, eval_dtype: str = "float32",
                    execution: Execution | None = None, cache=None) -> dict:
    """With ``blocks`` fixed: every admissible start, every criterion's score, and the perplexity of
    the model compress builds with that span (ReplaceMe, lstsq, ``span_start``: on sandwich blocks its
    own fold, linearized-norm or through-norm), measured in ``eval_dtype``; Spearman ρ of each
    criterion with log ppl."""
    from blockfold.estimate import fit_span_map
    from blockfold.methods import PassCache
    from blockfold.methods.replaceme import measure_spans
    from blockfold.select import SPAN_CRITERIA, span_criteria
    from blockfold.settings import ReplaceMe

    if windows is None:
        raise BlockfoldError("the placement study measures perplexity: give a perplexity text")
    execution = execution or Execution()
    cache = cache if cache is not None else PassCache()  # every start's compress reuses this one pass
    job = _span_job(handle, calibration, execution, cache)
    measured = measure_spans(job, [blocks], blocks, job.settings.criterion, all_criteria=True)
    scores = span_criteria(measured.distances, measured.tables, measured.moments,
                           lambda eq: fit_span_map(eq, "lstsq", warn=False)[0])
    rows = []
    for start in sorted(measured.tables[0].normal_equations):
        recipe = Recipe.of(ReplaceMe(blocks=blocks, span_start=start, estimator="lstsq"))
        compressed = blockfold.compress(handle.fresh_copy(), recipe=recipe, calibration=calibration,
                                        execution=execution, cache=cache)
        measured_model = in_eval_dtype(compressed.model, eval_dtype, copy_first=False)
        ppl = perplexity(measured_model, windows, description=f"placement {start}")["perplexity"]
        row = {"start": start, "perplexity": ppl, **{name: float(scores[name][start, blocks]) for name in SPAN_CRITERIA}}
        if "regime" in compressed.manifest["transform"]:  # sandwich blocks: the fold compress chose there
            row["regime"] = compressed.manifest["transform"]["regime"]
        rows.append(row)
        del compressed, measured_model
    log_ppl = [float(np.log(r["perplexity"])) for r in rows]
    summary = {}
    for name in SPAN_CRITERIA:
        values = [r[name] for r in rows]
        choice = rows[int(np.argmin(values))]
        summary[name] = {"spearman_with_log_ppl": spearman(values, log_ppl), "choice": choice["start"],
                         "choice_perplexity": choice["perplexity"]}
    best = min(rows, key=lambda r: r["perplexity"])
    return {"blocks": blocks, "rows": rows, "criteria": summary, "best": {"start": best["start"], "perplexity": best["perplexity"]}}


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (average ranks for ties)."""
    def ranks(values):
        order = np.argsort(values, kind="stable")
        ranked = np.empty(len(values))
        ranked[order] = np.arange(len(values))
        for value in set(values):  # ties share their mean rank
            tied = np.array(values) == value
            ranked[tied] = ranked[tied].mean()
        return ranked

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])
