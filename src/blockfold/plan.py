"""``compress --dry-run``: the memory and time plan of a job, from the model's config alone.

It answers, before any weight is read: will the model run whole or one layer at a time, how much
memory the weights, the activations and the float64 statistics take, how many passes the method
makes, and about how long they take. The numbers come from the same places the run takes them
(the skeleton's parameter counts, the observers' own memory declarations, the runner's budgets),
so the plan and the run agree. docs/scale.md walks through it for Llama-3-8B and Llama-3.1-70B.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockfold.recipe import Recipe
from blockfold.runtime import DTYPE_NAMES, DTYPES, Execution, free_memory, resolve_device
from blockfold.settings import MethodSettings, RefitStage

#: accelerators a plan for a memory size is timed against: (name, dense bf16 TFLOP/s, fp64 TFLOP/s)
ACCELERATORS = (("A100 80GB", 312.0, 19.5), ("H100 80GB", 989.0, 67.0))
#: share of peak a transformer forward reaches (matmul-bound, batch of long sequences)
FORWARD_EFFICIENCY = 0.4
#: share of peak the float64 statistics reach (large square products)
STATS_EFFICIENCY = 0.6
#: host-to-device bandwidth for weights read layer by layer (PCIe 4.0 x16), bytes/s
HOST_TO_DEVICE = 25e9


@dataclass
class PlanContext:
    """What a method's planner is told: its settings and the model's shape, the calibration set, the
    memory the float64 statistics may take (``budget``), the pipeline that will run it and the execution
    settings (a statistics cache or a resume changes what a first pass can record)."""

    settings: MethodSettings
    adapter: object
    model: object  # a skeleton: parameters on the meta device
    num_layers: int
    hidden_size: int
    element: int  # bytes per activation element
    calibration: object
    tokens: int
    budget: int
    pipeline: str
    execution: Execution


@dataclass
class MethodPlan:
    """What a method costs: passes over the calibration set, bytes of float64 sums, statistics FLOPs
    per token, the observers whose windows the sequential pipeline keeps, and what it will do, in words."""

    passes: int = 1
    sums: int = 0
    stats_flops_per_token: float = 0.0
    observers: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    weight_copies: int = 1  # copies of the weights resident at once (a twin, a candidate model)
    #: forward work beyond one run of every block per pass (a stream per candidate, fewer sequences),
    #: in passes of the calibration set through every block
    extra_forward: float = 0.0
    #: bytes of activations kept from one pass for a later stage (the stream the refit reads)
    recorded: int = 0

    @property
    def forward_passes(self) -> float:
        return self.passes + self.extra_forward


def plan_no_pass(context: PlanContext) -> MethodPlan:
    """A method that declares no planner runs no calibration pass."""
    return MethodPlan(passes=0, notes=["no calibration pass"])


def planner_of(settings_class: type[MethodSettings]):
    """The method's planner: ``settings_class.planner`` (``module:function``), or none."""
    if settings_class.planner is None:
        return plan_no_pass
    from blockfold.methods import function_at

    return function_at(settings_class.planner)


@dataclass
class Plan:
    rows: list[tuple[str, str]] = field(default_factory=list)
    numbers: dict = field(default_factory=dict)

    def add(self, label: str, value: str) -> None:
        self.rows.append((label, value))

    def render(self) -> str:
        width = max(len(label) for label, _ in self.rows)
        return "\n".join(f"{label:<{width}}  {value}" for label, value in self.rows)


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _config(spec: str):
    from transformers import AutoConfig

    path = Path(spec).expanduser()
    if path.suffix == ".json" and path.is_file():
        return AutoConfig.from_pretrained(path)
    from blockfold.models.sources import read_config, resolve_model_path

    return read_config(resolve_model_path(spec))


def _cpu_throughput() -> tuple[float, float]:
    """This machine's float32 and float64 matrix-product rate (FLOP/s), from a short probe."""
    rates = []
    for dtype in (torch.float32, torch.float64):
        a = torch.randn(1024, 1024, dtype=dtype)
        a @ a
        started = time.perf_counter()
        for _ in range(3):
            a @ a
        rates.append(3 * 2 * 1024**3 / (time.perf_counter() - started))
    return rates[0], rates[1]


def _active_parameters(adapter, layers, config) -> float:
    """Parameters of all blocks that one token multiplies: a mixture of experts runs
    ``num_experts_per_tok`` of its experts, not all of them."""
    total = float(sum(p.numel() for p in layers.parameters()))
    for layer in layers:
        if adapter.is_sparse(layer):
            experts = getattr(adapter.mlp(layer), adapter.experts_attr)
            count = getattr(experts, "num_experts", None) or getattr(config, "num_local_experts", None) or config.num_experts
            routed = sum(p.numel() for p in experts.parameters())
            total -= routed * (1 - config.num_experts_per_tok / count)
    return total


def plan_for(spec: str, recipe: Recipe, execution: Execution, accelerator_memory: int | None = None) -> Plan:
    """The plan of compressing ``spec`` as ``recipe`` says, on this machine's device, or on an
    accelerator with ``accelerator_memory`` bytes (a plan for a GPU this machine does not have)."""
    from blockfold.adapters import get_adapter
    from blockfold.models.multimodal import compressed_view
    from blockfold.models.sources import skeleton
    from blockfold.pipelines import ACTIVATION_SHARE, CPU_ACTIVATION_BYTES, STATS_SHARE

    config = _config(spec)
    adapter = get_adapter(config)
    on_accelerator = accelerator_memory is not None
    device = torch.device("cuda") if on_accelerator else resolve_device(execution.device)
    on_accelerator = on_accelerator or device.type != "cpu"
    source = getattr(config, "dtype", None)
    source = source if isinstance(source, torch.dtype) else DTYPES.get(str(source).removeprefix("torch."), torch.float32)
    dtype = DTYPES[execution.dtype] if execution.dtype != "auto" else (source if on_accelerator else torch.float32)
    container = skeleton(config, dtype)  # a multimodal wrapper's vision tower counts in its memory, not its passes
    model = compressed_view(container)
    layers = adapter.layers(model)
    num_layers, d = len(layers), adapter.hidden_size(model)
    element = dtype.itemsize
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    per_layer_params = max(sizes)  # the largest block (a mixture of experts may keep some blocks dense)
    total_params = sum(p.numel() for p in container.parameters())
    outside = (total_params - sum(sizes)) * element
    weights = total_params * element
    memory = accelerator_memory if accelerator_memory is not None else free_memory(device) or 0
    pipeline = execution.pipeline
    if pipeline == "auto":
        pipeline = "whole" if memory and weights <= 0.5 * memory else "sequential"
    calibration = recipe.calibration
    if adapter.is_vision:  # images at the encoder's own size: one token per patch (and class token)
        calibration = calibration.model_copy(update={"sequence_length": adapter.tokens_per_image(
            model.config, model.config.image_size, model.config.image_size)})
    tokens = calibration.num_sequences * calibration.sequence_length
    settings = recipe.settings.for_model(adapter.model_size(model))

    plan = Plan()
    plan.add("model", f"{spec}: {config.model_type}, {num_layers} blocks, hidden {d}, {total_params / 1e9:.2f}B parameters")
    plan.add("device", (f"an accelerator with {gib(memory)}" if accelerator_memory else f"{device} ({gib(memory)} free)")
             + f", weights in {DTYPE_NAMES[dtype]}")
    plan.add("weights", f"{gib(weights)}: {gib(per_layer_params * element)} per block, {gib(outside)} outside the blocks")
    plan.add("pipeline", pipeline + (" (the whole model resident)" if pipeline == "whole"
                                     else " (one block at a time; resident: one block plus embeddings or head)"))
    if getattr(recipe.settings, "sparsity", None) is not None and getattr(settings, "sparsity", None) is None:
        budget = settings.budget_field
        plan.add("budget", f"sparsity {recipe.settings.sparsity:g}: {getattr(settings, budget)} "
                           f"{budget.replace('_', ' ')}")
    plan.add("calibration", f"{calibration.num_sequences} {'images' if adapter.is_vision else 'sequences'} x "
                            f"{calibration.sequence_length} = {tokens:,} tokens")
    plan.add("activation buffer", f"{gib(tokens * d * element)} for all tokens at one boundary ({DTYPE_NAMES[dtype]})")

    # -- the method's statistics: its planner, registered beside its function ----------------
    budget = execution.stats_memory or int(STATS_SHARE * max(memory - (weights if pipeline == "whole" else
                                                                        per_layer_params * element), 0))
    context = PlanContext(settings, adapter, model, num_layers, d, element, calibration, tokens, budget, pipeline,
                          execution)
    method_plan = planner_of(type(settings))(context)
    if isinstance(settings, RefitStage) and settings.refit != "none" and not settings.refits_within:
        from blockfold.methods.refit import plan_refit_after

        plan_refit_after(context, method_plan)
    passes, sums, notes = method_plan.passes, method_plan.sums, method_plan.notes
    forward_passes = method_plan.forward_passes
    observers, stats_flops_per_token = method_plan.observers, method_plan.stats_flops_per_token
    plan.add("statistics", f"{gib(sums)} of float64 sums (budget {gib(budget)}): " + "; ".join(notes))

    on_device = method_plan.recorded if execution.offload in ("auto", "none") else 0  # kept beside the sums

    # -- chunks of the sequential pipeline ------------------------------------------------
    window = sum(obs.window_bytes_per_token(d, element) for obs in observers)
    per_token = d * element * (1 + 2 * 3) + window
    if pipeline == "sequential":
        chunk_budget = (int(ACTIVATION_SHARE["cuda"] * max(memory - per_layer_params * element - sums, 0))
                        if on_accelerator else CPU_ACTIVATION_BYTES)
        per_sequence = per_token * calibration.sequence_length
        chunk = execution.chunk_sequences or max(1, min(calibration.num_sequences, chunk_budget // per_sequence))
        chunks = math.ceil(calibration.num_sequences / chunk)
        plan.add("chunks", f"{chunk} sequences per chunk ({gib(chunk * per_sequence)} of activations and windows): "
                           f"{chunks} chunk(s), each block read {chunks} time(s) per pass")
        peak = per_layer_params * element + max(outside, chunk * per_sequence) + sums + on_device
    else:
        chunks = 1
        per_batch = per_token * calibration.batch_size * calibration.sequence_length
        plan.add("batches", f"{calibration.batch_size} sequences per batch ({gib(per_batch)} of activations and windows)")
        peak = method_plan.weight_copies * weights + per_batch + sums + on_device
    plan.add("passes", f"{passes} over the calibration set")
    if recipe.heal is not None:
        heal = recipe.heal
        plan.add("healing", f"then {heal.steps} {heal.mode} training steps on {heal.data.num_sequences} x "
                            f"{heal.data.sequence_length} tokens (the model resident, with its gradients)")
    plan.add("peak memory", f"about {gib(peak)} on the device" + (f" of {gib(memory)}" if memory else ""))

    # -- time -----------------------------------------------------------------------------
    text_config = model.config  # a multimodal model's language model's
    head_dim = getattr(text_config, "head_dim", None) or d // text_config.num_attention_heads
    attention_flops = 4 * calibration.sequence_length * text_config.num_attention_heads * head_dim / 2  # causal: half
    forward = forward_passes * tokens * (2 * _active_parameters(adapter, layers, text_config) + num_layers * attention_flops)
    stats = tokens * stats_flops_per_token
    transfer = passes * chunks * weights if pipeline == "sequential" else 0
    plan.add("work", f"{forward / 1e15:.1f} PFLOP forward ({DTYPE_NAMES[dtype]}), {stats / 1e15:.2f} PFLOP of float64 "
                     f"statistics, {gib(transfer)} of weights moved to the device")
    if on_accelerator:
        for name, dense, fp64 in ACCELERATORS:
            seconds = (forward / (dense * 1e12 * FORWARD_EFFICIENCY) + stats / (fp64 * 1e12 * STATS_EFFICIENCY)
                       + transfer / HOST_TO_DEVICE)
            plan.add(f"time on {name}", f"about {seconds / 60:.0f} min ({FORWARD_EFFICIENCY:.0%} of bf16 peak, "
                                        f"{STATS_EFFICIENCY:.0%} of fp64 peak, {HOST_TO_DEVICE / 1e9:.0f} GB/s host to device)")
    else:
        rate32, rate64 = _cpu_throughput()
        seconds = forward / rate32 + stats / rate64
        plan.add("time here", f"about {seconds / 60:.0f} min at this CPU's measured {rate32 / 1e9:.0f} GFLOP/s "
                              f"(float32) and {rate64 / 1e9:.0f} GFLOP/s (float64)")
    plan.numbers = {"weights_bytes": weights, "per_layer_bytes": per_layer_params * element, "outside_bytes": outside,
                    "pipeline": pipeline, "tokens": tokens, "sums_bytes": sums, "budget_bytes": budget,
                    "passes": passes, "forward_passes": forward_passes, "chunks": chunks, "peak_bytes": peak, "forward_flops": forward,
                    "stats_flops": stats, "transfer_bytes": transfer}
    return plan
