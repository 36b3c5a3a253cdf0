"""The composition matrix: every method × every way to run it saves what the plain run saves.

A cell is (method case, architecture, mode). The plain run is the Python API on the saved model,
whole pipeline, CPU, float32; every other mode must save the same removed blocks and replaced layers
and every tensor equal within ``TOLERANCE`` (or the accelerator's, against a CPU run in the same
half precision), or refuse in the same single line where the plain run refuses. Tiny random-weight
models of three families (a pre-norm Llama, a sandwich-norm Gemma 3, a mixture of experts), so the
whole matrix stays fast.

Joining the matrix is registering: a method in ``blockfold.settings.SETTINGS`` gets a case from its
budget alone (``VARIANTS`` adds the variants worth their own row and the few settings that keep a
case tiny); a mode is a function in ``MODES``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from transformers import AutoModelForCausalLM
from conftest import checkpoint_tensors, quantize_w4a16, tiny_model, tiny_tokenizer
from simulated_device import DEVICE, simulated_accelerator

import blockfold
from blockfold.cli import main, setting_flags
from blockfold.errors import BlockfoldError
from blockfold.pipelines import persist
from blockfold.runtime import DTYPES, Execution
from blockfold.settings import SETTINGS, AttentionBudget, BlockBudget, ParameterBudget, RefitStage

ARCHITECTURES = ("llama", "gemma3_text", "qwen2_moe")

#: the healing stage's case: a few LoRA steps after the default method, on a tiny share of the corpus
HEAL = {"mode": "lora", "steps": 2, "data": {"num_sequences": 4, "sequence_length": 24, "batch_size": 2}}
#: stages a case adds to its recipe (beside the method's settings)
STAGES: dict[str, dict] = {"replaceme+heal": {"heal": HEAL}}
#: cells that must refuse, in one line saying so, where the plain run saves: the healing stage trains the
#: whole model in memory, and LLM-Pruner's importance needs its gradients, so a run layer by layer refuses
#: them before any pass
REFUSED = {("replaceme+heal", "sequential"): "the healing stage trains the whole model in memory",
           ("replaceme+heal", "offload-disk"): "the healing stage trains the whole model in memory",
           ("llm-pruner", "sequential"): "needs gradients through the whole model in memory",
           ("llm-pruner", "offload-disk"): "needs gradients through the whole model in memory"}
#: variants with their own row, and settings that keep a method's case tiny (merged over its budget)
VARIANTS: dict[str, tuple[str, dict]] = {
    "replaceme": ("replaceme", {}),
    "replaceme-mid": ("replaceme", {"span_start": 2}),  # the default refit runs blocks after the span
    "replaceme-spans2": ("replaceme", {"spans": 2}),
    "replaceme-greedy": ("replaceme", {"greedy": True}),
    "replaceme-shortlist": ("replaceme", {"shortlist": 2}),  # a sweep with a stream per candidate span
    "replaceme+heal": ("replaceme", {}),
    "laco": ("laco", {"merge_layers": 2}),
    "streamline": ("streamline", {"train_steps": 2}),
    "slicegpt": ("slicegpt", {"slicing": 0.25}),  # a width of its own: the share of the hidden size sliced
    # the one budget every method takes, resolved against the model into blocks or attention layers
    "replaceme-sparsity": ("replaceme", {"sparsity": 0.3}),
    "drop-attn": ("drop-attn", {}),
    "drop-attn-sparsity": ("drop-attn", {"sparsity": 0.1}),
}
BUDGET_FIELDS = {"blocks", "attention_layers", "ratio", "sparsity", "slicing"}
#: per-tensor tolerance, relative to the tensor's largest entry: closed forms, and numerical fits
#: (Adam, L-BFGS), which amplify the last bits of sums added in another order
TOLERANCE = {"closed": 1e-5, "numerical": 1e-3}
NUMERICAL = {"streamline", "replaceme+heal"}
#: the accelerator's half-precision run against the CPU's in the same dtype: the same kernels in other
#: orders, whose last-bit differences the least-squares fits amplify (a fitted weight moved by up to 28 %
#: of its tensor's largest entry). The yardstick is the half precision's own error: each tensor within
#: this many times the CPU half run's distance from the float32 run (1.9 at most, measured) ...
HALF_TOLERANCE = 3.0
#: ... or, where float32 chose other blocks (ties that half precision breaks otherwise), within this
#: share of the tensor's largest entry
HALF_COARSE = 0.3
CALIBRATION = {"num_sequences": 8, "sequence_length": 24, "batch_size": 4}


def _cases() -> dict[str, tuple[str, dict]]:
    """Every registered method, by its budget unless a variant says more; and every method that takes
    the refit stage but does not run it by default, once more with it (``+refit``)."""
    cases = {}
    for method, settings_class in SETTINGS.items():
        budget = ({"attention_layers": 2} if issubclass(settings_class, AttentionBudget)
                  else {"sparsity": 0.3} if issubclass(settings_class, ParameterBudget)
                  else {"blocks": 2} if issubclass(settings_class, BlockBudget) else {})
        variants = {name: extra for name, (of, extra) in VARIANTS.items() if of == method} or {method: {}}
        for name, extra in variants.items():  # a variant's own budget replaces the method's
            cases[name] = (method, {**({} if BUDGET_FIELDS & extra.keys() else budget), **extra})
        if issubclass(settings_class, RefitStage) and settings_class(**budget).refit == "none":
            first = next(iter(variants.values()))
            cases[f"{method}+refit"] = (method, {**budget, **first, "refit": "all"})
    return cases


CASES = _cases()


@dataclasses.dataclass
class Outcome:
    """What a cell saved (its folder and manifest) or the one line it refused with."""

    folder: Path | None = None
    manifest: dict | None = None
    refusal: str | None = None


@dataclasses.dataclass
class Workspace:
    root: Path
    corpus: Path

    def model(self, arch: str) -> Path:
        return self.root / "models" / arch

    def recipe(self, case: str, **calibration) -> dict:
        method, settings = CASES[case]
        return {"method": method, "settings": settings,
                "calibration": {"source": str(self.corpus), **CALIBRATION, **calibration}, **STAGES.get(case, {})}

    def out(self, *parts: str) -> Path:
        return self.root.joinpath("outputs", *parts)


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("composition")
    for arch in ARCHITECTURES:
        tiny_model(arch).save_pretrained(root / "models" / arch)
        tiny_tokenizer().save_pretrained(root / "models" / arch)
    quantize_w4a16(root / "models" / ARCHITECTURES[0], root / "models" / QUANTIZED)
    generator = torch.Generator().manual_seed(0)
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(f"w{int(w)}" for w in torch.randint(0, 90, (3000,), generator=generator)))
    return Workspace(root, corpus)


def _api(workspace: Workspace, case: str, arch: str, out: Path, recipe=None, **execution) -> Outcome:
    try:
        result = blockfold.compress(str(workspace.model(arch)), recipe=recipe or workspace.recipe(case),
                                    execution=Execution(**execution))
        result.save(out)
    except BlockfoldError as error:
        return Outcome(refusal=str(error))
    return Outcome(out, result.manifest)


def _cli(argv: list[str], out: Path, capsys) -> Outcome:
    capsys.readouterr()
    code = main([*argv, "--out", str(out)])
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("blockfold: error")]
    if code != 0:
        assert code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr
        return Outcome(refusal=errors[0].removeprefix("blockfold: error: "))
    return Outcome(out, json.loads((out / "blockfold_manifest.json").read_text()))


def _flags(settings: dict) -> list[str]:
    by_field = {field: dest for dest, (field, _) in setting_flags().items()}
    argv = []
    for field, value in settings.items():
        flag = "--" + by_field[field].replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def _calibration_flags(workspace: Workspace) -> list[str]:
    return ["--calib", str(workspace.corpus), "--num-seqs", str(CALIBRATION["num_sequences"]),
            "--seq-len", str(CALIBRATION["sequence_length"]), "--batch-size", str(CALIBRATION["batch_size"])]


# -- the modes ----------------------------------------------------------------------------------
def _stage_flags(case: str) -> list[str]:
    """The case's stages as compress flags (the healing stage: --heal, --heal-steps, --set heal.data.*)."""
    heal = STAGES.get(case, {}).get("heal")
    if heal is None:
        return []
    return ["--heal", heal["mode"], "--heal-steps", str(heal["steps"]),
            *(flag for key, value in heal["data"].items() for flag in ("--set", f"heal.data.{key}={value}"))]


def mode_flags(workspace, case, arch, out, capsys, monkeypatch) -> Outcome:
    method, settings = CASES[case]
    return _cli(["compress", "--model", str(workspace.model(arch)), "--method", method, *_flags(settings),
                 *_stage_flags(case), *_calibration_flags(workspace)], out, capsys)


def mode_recipe_file(workspace, case, arch, out, capsys, monkeypatch) -> Outcome:
    path = out.parent / f"{out.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(workspace.recipe(case)))
    return _cli(["compress", "--model", str(workspace.model(arch)), "--recipe", str(path)], out, capsys)


def mode_recipe_file_and_flags(workspace, case, arch, out, capsys, monkeypatch) -> Outcome:
    """A file with another budget and calibration size, the case's given back as flags."""
    recipe = workspace.recipe(case, num_sequences=3)
    budget = next(key for key in ("attention_layers", "sparsity", "slicing", "blocks") if key in recipe["settings"])
    recipe["settings"] = {**recipe["settings"], budget: 0.1 if budget in ("sparsity", "slicing") else 1}
    path = out.parent / f"{out.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe))
    return _cli(["compress", "--model", str(workspace.model(arch)), "--recipe", str(path),
                 *_flags({budget: CASES[case][1][budget]}), "--num-seqs", str(CALIBRATION["num_sequences"])],
                out, capsys)


def mode_api_settings_object(workspace, case, arch, out, capsys, monkeypatch) -> Outcome:
    """The typed settings class (``blockfold.ReplaceMe(blocks=2)``) instead of a dict."""
    method, settings = CASES[case]
    recipe = workspace.recipe(case)
    try:
        typed = blockfold.Recipe(method=method, settings=SETTINGS[method](**settings),
                                 calibration=recipe["calibration"], **STAGES.get(case, {}))
    except Exception as error:  # a validation error of the settings class: the plain run refuses it too
        return Outcome(refusal=str(error))
    return _api(workspace, case, arch, out, recipe=typed)


def mode_sequential(workspace, case, arch, out, capsys, monkeypatch) -> Outcome:
    return _api(workspace, case, arch, out, pipeline="sequential")


def mode_offload_disk(workspace, case, arch, out, capsys, monkeypatch) -> Outcome:
    spill = out.parent / f"{out.name}.spill"
    spill.mkdir(parents=True)
    outcome = _api(workspace, case, arch, out, pipeline="sequential", offload="disk", offload_dir=str(spill))
    assert not list(spill.iterdir()), "spilled activations left behind"
    return outcome


class _Killed(BaseException):
    """Stands for the process dying: nothing in blockfold catches it."""


def mode_resume(workspace, case, arch, out, capsys, monkeypatch) -> Outcome:
    """Killed after half the groups of its first pass (checkpointed after each group), then run again:
    it resumes that pass and saves what the plain run saves."""
    resume = out.parent / f".{out.name}.resume"
    execution = {"resume_dir": str(resume), "checkpoint_seconds": 0, "chunk_sequences": 2}
    real_writer, killed = persist.Checkpoints.writer, []

    def dying_writer(self, number, key, groups, group_size, observers):
        after = real_writer(self, number, key, groups, group_size, observers)

        def after_group(done):
            after(done)
            if number == 1 and done == groups // 2 and not killed:
                killed.append(done)
                raise _Killed()
        return after_group

    monkeypatch.setattr(persist.Checkpoints, "writer", dying_writer)
    try:
        first = _api(workspace, case, arch, out, **execution)
    except _Killed:
        first = None
    monkeypatch.setattr(persist.Checkpoints, "writer", real_writer)
    if first is not None:  # no checkpointed pass to kill (a method that runs its own loops), or refused
        assert first.refusal is not None or first.manifest["execution"]["passes"] == 0 or not killed
        return first
    outcome = _api(workspace, case, arch, out, **execution)
    if outcome.manifest is not None:
        assert outcome.manifest["execution"]["resumed_passes"] >= 1
    return outcome


def mode_stats_cache(workspace, case, arch, out, capsys, monkeypatch) -> Outcome:
    """The second of two runs with one statistics cache: every pass it can load, loaded."""
    cache = out.parent / f"{out.name}.cache"
    first = _api(workspace, case, arch, out.parent / f"{out.name}.first", stats_cache=str(cache))
    outcome = _api(workspace, case, arch, out, stats_cache=str(cache))
    # sweeps (a method's own layer program: candidate streams, the refit's recorded activations) keep no sums
    if first.manifest is not None and first.manifest["execution"]["passes"] > first.manifest["execution"]["sweeps"]:
        assert outcome.manifest["execution"]["cached_passes"] >= 1
    return outcome


def mode_torchrun(workspace, case, arch, out, capsys, monkeypatch) -> Outcome:
    """Two gloo processes sharing the passes (all cells run in one spawn, ``torchrun_outputs``)."""
    recorded = _torchrun_outputs(workspace)[f"{case}/{arch}"]
    if "refusal" in recorded:
        return Outcome(refusal=recorded["refusal"])
    folder = Path(recorded["folder"])
    return Outcome(folder, json.loads((folder / "blockfold_manifest.json").read_text()))


def _in_memory(workspace: Workspace, case: str, arch: str, out: Path, dtype: str, device=None) -> Outcome:
    """The saved model loaded by plain transformers in ``dtype`` (onto ``device``), compressed in memory."""
    model = AutoModelForCausalLM.from_pretrained(workspace.model(arch), dtype=DTYPES[dtype])
    model = model.to(device) if device is not None else model
    try:
        result = blockfold.compress(model, tiny_tokenizer(), workspace.recipe(case))
        result.save(out)
    except BlockfoldError as error:
        return Outcome(refusal=str(error))
    return Outcome(out, result.manifest)


def _half(dtype: str) -> Callable:
    def mode(workspace, case, arch, out, capsys, monkeypatch) -> Outcome:
        with simulated_accelerator():
            return _in_memory(workspace, case, arch, out, dtype, DEVICE)

    mode.__doc__ = f"The simulated accelerator in {dtype}, against the CPU in {dtype}."
    return mode


#: mode name → the function running a cell in it
MODES: dict[str, Callable] = {
    "flags": mode_flags, "recipe-file": mode_recipe_file, "recipe-file+flags": mode_recipe_file_and_flags,
    "api-settings": mode_api_settings_object, "sequential": mode_sequential, "offload-disk": mode_offload_disk,
    "resume": mode_resume, "stats-cache": mode_stats_cache, "torchrun": mode_torchrun,
    "accelerator-bfloat16": _half("bfloat16"), "accelerator-float16": _half("float16"),
}
HALF_MODES = {"accelerator-bfloat16": "bfloat16", "accelerator-float16": "float16"}


# -- the references -----------------------------------------------------------------------------
_REFERENCES: dict[tuple, Outcome] = {}


def _reference(workspace: Workspace, case: str, arch: str, dtype: str = "float32") -> Outcome:
    key = (case, arch, dtype)
    if key not in _REFERENCES:
        out = workspace.out("plain", dtype, f"{case}-{arch}")
        _REFERENCES[key] = (_api(workspace, case, arch, out) if dtype == "float32"
                            else _in_memory(workspace, case, arch, out, dtype))
    return _REFERENCES[key]


_TORCHRUN: dict[str, dict] = {}


def _torchrun_rank(rank: int, port: int, root: str, cells: list[tuple[str, str]], calibration: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    workspace = Workspace(Path(root), Path(calibration.pop("corpus")))
    recorded = {}
    try:
        for case, arch in cells:
            out = workspace.out("torchrun", f"{case}-{arch}")
            try:
                result = blockfold.compress(str(workspace.model(arch)), recipe=workspace.recipe(case))
                if rank == 0:
                    result.save(out)
                recorded[f"{case}/{arch}"] = {"folder": str(out)}
            except BlockfoldError as error:
                recorded[f"{case}/{arch}"] = {"refusal": str(error)}
        if rank == 0:
            (workspace.root / "torchrun.json").write_text(json.dumps(recorded))
    finally:
        dist.destroy_process_group()


def _torchrun_outputs(workspace: Workspace) -> dict[str, dict]:
    if not _TORCHRUN:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cells = [(case, arch) for case, arch, mode in CELLS if mode == "torchrun"]
        mp.spawn(_torchrun_rank, args=(port, str(workspace.root), cells, {"corpus": str(workspace.corpus)}),
                 nprocs=2, join=True)
        _TORCHRUN.update(json.loads((workspace.root / "torchrun.json").read_text()))
    return _TORCHRUN


# -- the cells ----------------------------------------------------------------------------------
#: modes that differ only in how the recipe reaches the same code, not in how the model runs: one
#: architecture is enough (the property test in test_recipe_merge.py covers every setting)
INTERFACE_MODES = {"flags", "recipe-file", "recipe-file+flags", "api-settings"}
#: cells the simulated accelerator cannot run: transformers' train() hands the model to its hub-kernel
#: registry, which rejects the simulated device's type ("lazy", which no real device has); the healing
#: stage on a real GPU is bench/gpu_check.py's
NOT_SIMULATED = {("replaceme+heal", mode) for mode in HALF_MODES}


def _architectures_of(case: str) -> tuple[str, ...]:
    """The refit stage after a method takes one route (a twin, or DROP's recorded pass) on every family: a
    ``+refit`` case runs on the Llama alone (the family-specific refit, sandwich inputs and skipped expert
    blocks, runs in every ReplaceMe case on all three). The shortlist's one family-specific step is where
    it reads the MLP's contribution, which a sandwich norm moves: the Llama and Gemma. Both keep the
    default test run inside its 15 minutes."""
    if case.endswith("+refit"):
        return ARCHITECTURES[:1]
    return ARCHITECTURES[:2] if case == "replaceme-shortlist" else ARCHITECTURES


#: a compressed-tensors W4A16 copy of the Llama (conftest.quantize_w4a16): a quantized input is read as its float
#: model and written back layer by layer as stored, quantized again, or in float, so its cells are the cases that
#: write each kind (a fold and refit, NBL's new layers, a refit after another removal, SliceGPT's narrowed
#: layers, healing's trained ones) in the modes that read or write it otherwise (the three above the API's)
QUANTIZED = "llama-w4a16"
QUANTIZED_CASES = ("replaceme", "nbl", "drop-block+refit", "slicegpt", "replaceme+heal")
QUANTIZED_MODES = ("recipe-file", "sequential", "torchrun")

CELLS = [(case, arch, mode) for mode in MODES for case in CASES for arch in _architectures_of(case)
         if (mode not in INTERFACE_MODES or arch == ARCHITECTURES[0]) and (case, mode) not in NOT_SIMULATED]
CELLS += [(case, QUANTIZED, mode) for mode in QUANTIZED_MODES for case in QUANTIZED_CASES]


def _saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A saved checkpoint's tensors; a quantized layer's (compressed-tensors) as the weight they store, so
    a layer quantized again is compared by its values, not by the bits of its packed words."""
    config = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    if config.get("quant_method") != "compressed-tensors":
        return checkpoint_tensors(folder)
    from blockfold.models.compressed_tensors import CompressedTensorsReader

    reader = CompressedTensorsReader(folder, config)
    return {name: reader.get(name) for name in reader.names()}


def _stored_as(folder: Path) -> tuple[dict, list[str]]:
    """The saved quantization config and which tensors hold packed weights."""
    config = json.loads((folder / "config.json").read_text()).get("quantization_config")
    return config, sorted(name for name in checkpoint_tensors(folder) if name.endswith("weight_packed"))


def _as_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each low-rank pair (``X.first.weight``, ``X.second.weight``) as the one
    weight it stands for, ``second @ first``: the factors of a product are unique only up to an invertible
    map between them, which half precision chooses otherwise where singular values lie close."""
    weights = dict(tensors)
    for name in [name for name in tensors if name.endswith(".first.weight")]:
        module = name.removesuffix(".first.weight")
        weights[f"{module}.weight (factored)"] = weights.pop(f"{module}.second.weight").double() @ weights.pop(name).double()
    return weights


def _assert_same_output(got: Outcome, expected: Outcome, tolerance: float, where: str,
                        float32: Outcome | None = None) -> None:
    """``got`` saved what ``expected`` saved: the same blocks and layers, and every tensor within
    ``tolerance`` of its largest entry; for a half-precision run (``float32``: the plain float32 run),
    finite and within ``HALF_TOLERANCE`` times the CPU half-precision run's own distance from float32."""
    if expected.refusal is not None:
        assert got.refusal == expected.refusal, f"{where}: the plain run refuses ({expected.refusal}), this gave {got}"
        assert "\n" not in got.refusal
        return
    assert got.refusal is None, f"{where}: refused ({got.refusal}) where the plain run saves"
    for field in ("removed_blocks", "replaced"):
        assert got.manifest.get(field) == expected.manifest.get(field), f"{where}: {field}"
    saved, wanted = _as_weights(_saved_weights(got.folder)), _as_weights(_saved_weights(expected.folder))
    assert saved.keys() == wanted.keys(), where
    assert _stored_as(got.folder) == _stored_as(expected.folder), f"{where}: other layers stored quantized"
    full = (_as_weights(_saved_weights(float32.folder)) if float32 is not None and float32.folder is not None
            else None)
    if full is not None and full.keys() != wanted.keys():  # float32 chose other blocks: no precision yardstick
        full = None
    for name, value in wanted.items():
        assert torch.isfinite(saved[name].double()).all(), f"{where}: {name} is not finite"
        difference = float((saved[name].double() - value.double()).abs().max()) if value.numel() else 0.0
        largest = float(value.double().abs().max()) or 1.0
        if float32 is None:
            bound = tolerance * largest
        elif full is not None:  # no more than the half precision's own error, against float32, allows
            bound = HALF_TOLERANCE * max(float((full[name].double() - value.double()).abs().max()), 1e-3 * largest)
        else:
            bound = HALF_COARSE * largest
        assert difference <= bound, f"{where}: {name} off by {difference:.3g} (bound {bound:.3g})"


@pytest.mark.parametrize("case, arch, mode", CELLS, ids=[f"{m}/{c}/{a}" for c, a, m in CELLS])
def test_cell(workspace, case, arch, mode, capsys, monkeypatch):
    dtype = HALF_MODES.get(mode, "float32")
    expected = _reference(workspace, case, arch, dtype)
    got = MODES[mode](workspace, case, arch, workspace.out(mode, f"{case}-{arch}"), capsys, monkeypatch)
    if (case, mode) in REFUSED and expected.refusal is None:  # where the plain run refuses, the same line is due
        assert got.refusal is not None and REFUSED[case, mode] in got.refusal and "\n" not in got.refusal, got
        return
    tolerance = TOLERANCE["numerical" if case in NUMERICAL else "closed"]
    _assert_same_output(got, expected, tolerance, f"{mode}/{case}/{arch}",
                        _reference(workspace, case, arch) if mode in HALF_MODES else None)


def test_every_registered_method_is_in_the_matrix():
    assert {method for method, _ in CASES.values()} == set(SETTINGS)


@pytest.mark.parametrize("case, arch", [(case, arch) for case in CASES for arch in ARCHITECTURES])
def test_the_dry_run_plans_the_passes_the_run_makes(workspace, case, arch):
    """``--dry-run``'s plan comes from each method's registered planner; its pass count must be the
    plain run's, so a method whose code and plan drift apart fails here."""
    from blockfold.plan import plan_for

    expected = _reference(workspace, case, arch)
    recipe = blockfold.Recipe.parse(workspace.recipe(case))
    if expected.refusal is not None:
        return
    plan = plan_for(str(workspace.model(arch)), recipe, Execution())
    assert plan.numbers["passes"] == expected.manifest["execution"]["passes"], plan.render()


#: cases whose forward work the plan knows exactly beyond whole passes (which the pass-count test checks):
#: a stream per candidate, a model shrinking step by step. The refit stage's is counted as one pass, which
#: it is not: it runs both streams through the blocks it refits, some several times, behind a cut the plan
#: cannot know before the selection.
EXACT_FORWARDS = ["drop-block", "sleb", "prune-comp", "laco"]
#: cases whose plan counts as a whole pass one that stops after the chosen span, so it bounds the work from
#: above: LLM-Streamline's second pass (and its training steps, counted exactly)
BOUNDED_FORWARDS = ["streamline"]


@pytest.mark.parametrize("case", EXACT_FORWARDS + BOUNDED_FORWARDS)
def test_the_dry_run_plans_the_block_forwards_the_run_makes(workspace, case):
    """``--dry-run``'s forward work (in passes of the calibration set through every block) is the token
    positions the plain run's blocks, and any copy of one, are run on (at most, where the plan cannot know
    where the chosen span ends)."""
    from blockfold.plan import plan_for

    recipe = blockfold.Recipe.parse(workspace.recipe(case))
    folder = workspace.model("llama")
    model = AutoModelForCausalLM.from_pretrained(folder)
    counted = [0]

    def count(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        counted[0] += hidden.shape[0] * hidden.shape[1] if hidden.dim() == 3 else hidden.shape[0]

    layers = blockfold.adapters.get_adapter(model).layers(model)
    for layer in layers:
        layer.register_forward_pre_hook(count, with_kwargs=True)
    blockfold.compress(model, tiny_tokenizer(), recipe)
    plan = plan_for(str(folder), recipe, Execution())
    forwards = counted[0] / (plan.numbers["tokens"] * len(layers))
    if case in BOUNDED_FORWARDS:
        assert forwards <= plan.numbers["forward_passes"] < forwards + 1, plan.render()
    else:
        assert plan.numbers["forward_passes"] == pytest.approx(forwards, rel=1e-9), plan.render()
