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
from blockfold.settings import AttentionBudget, ReplaceMe, SpanSelection

#: accelerators a plan for a memory size is timed against: (name, dense bf16 TFLOP/s, fp64 TFLOP/s)
ACCELERATORS = (("A100 80GB", 312.0, 19.5), ("H100 80GB", 989.0, 67.0))
#: share of peak a transformer forward reaches (matmul-bound, batch of long sequences)
FORWARD_EFFICIENCY = 0.4
#: share of peak the float64 statistics reach (large square products)
STATS_EFFICIENCY = 0.6
#: host-to-device bandwidth for weights read layer by layer (PCIe 4.0 x16), bytes/s
HOST_TO_DEVICE = 25e9


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
    from blockfold.models.multimodal import language_model_view
    from blockfold.models.sources import skeleton
    from blockfold.pipelines import ACTIVATION_SHARE, CPU_ACTIVATION_BYTES, STATS_SHARE
    from blockfold.select import split_budget
    from blockfold.stats import SpanStatistics, SublayerLinearity
    from blockfold.stats.magnitude import BoundaryEquations, StreamMagnitude
    from blockfold.stats.similarity import StreamSimilarity

    config = _config(spec)
    adapter = get_adapter(config)
    on_accelerator = accelerator_memory is not None
    device = torch.device("cuda") if on_accelerator else resolve_device(execution.device)
    on_accelerator = on_accelerator or device.type != "cpu"
    source = getattr(config, "dtype", None)
    source = source if isinstance(source, torch.dtype) else DTYPES.get(str(source).removeprefix("torch."), torch.float32)
    dtype = DTYPES[execution.dtype] if execution.dtype != "auto" else (source if on_accelerator else torch.float32)
    container = skeleton(config, dtype)  # a multimodal wrapper's vision tower counts in its memory, not its passes
    model = language_model_view(container)
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
    settings = recipe.settings

    plan = Plan()
    plan.add("model", f"{spec}: {config.model_type}, {num_layers} blocks, hidden {d}, {total_params / 1e9:.2f}B parameters")
    plan.add("device", (f"an accelerator with {gib(memory)}" if accelerator_memory else f"{device} ({gib(memory)} free)")
             + f", weights in {DTYPE_NAMES[dtype]}")
    plan.add("weights", f"{gib(weights)}: {gib(per_layer_params * element)} per block, {gib(outside)} outside the blocks")
    plan.add("pipeline", pipeline + (" (the whole model resident)" if pipeline == "whole"
                                     else " (one block at a time; resident: one block plus embeddings or head)"))
    plan.add("calibration", f"{calibration.num_sequences} {'images' if adapter.is_vision else 'sequences'} x "
                            f"{calibration.sequence_length} = {tokens:,} tokens")
    plan.add("activation buffer", f"{gib(tokens * d * element)} for all tokens at one boundary ({DTYPE_NAMES[dtype]})")

    # -- the method's statistics ----------------------------------------------------------
    passes, stats_flops_per_token, sums, observers, notes = 1, 0.0, 0, [], []
    budget = execution.stats_memory or int(STATS_SHARE * max(memory - (weights if pipeline == "whole" else
                                                                        per_layer_params * element), 0))
    if isinstance(settings, SpanSelection):
        n = settings.num_blocks(num_layers)
        counts = settings.span_counts(n)
        lengths = sorted({length for count in counts for length in split_budget(n, count)})
        criterion = settings.criterion
        need_all = criterion in ("fit_error", "fit_error_stream")
        weighted = criterion == "fit_error_stream"  # the per-token weighted sums serve it alone
        estimator = getattr(settings, "estimator", "identity")
        starts = {length: num_layers - length for length in lengths}
        full = sum(SpanStatistics.sums_bytes_for(count, d, "full", weighted) for count in starts.values())
        moments = StreamSimilarity.sums_bytes_for(num_layers, len(lengths), d) if criterion in ("cka", "cca") else 0
        observers.append(SpanStatistics(num_layers, n, max(lengths)))
        if estimator == "identity" and not need_all:
            sums, mode = moments, "no normal equations (plain removal: scalars only)"
        elif full + moments <= budget:
            sums, mode = full + moments, f"full normal equations for all {sum(starts.values())} candidates"
            stats_flops_per_token = sum(starts.values()) * (8 if weighted else 4) * d * d
        elif need_all:
            per_start = SpanStatistics.sums_bytes_for(1, d, "full", weighted)
            keep = max(1, (budget - moments) // (per_start * len(lengths)))
            sums = keep * per_start * len(lengths) + moments
            passes += 1
            stats_flops_per_token = keep * len(lengths) * (8 if weighted else 4) * d * d
            mode = (f"{gib(full)} for all candidates exceeds the budget: pass 1 screens every start with d-sized sums, "
                    f"pass 2 accumulates full sums for the best {keep} per length")
        else:
            sums, mode = moments, "distances only; the chosen span's sums in a refit pass"
            passes += 1
        notes.append(mode)
        if getattr(settings, "greedy", False):
            passes = n
        if isinstance(settings, ReplaceMe) and (settings.estimator == "cosine" or not adapter.folds_exactly):
            passes += 1  # the token subsample for the numerical fit
        # later spans are refitted on the compressed model; a refit records the original streams to the
        # span's end, then runs both streams through the later blocks, twice
        refit = 2 if getattr(settings, "refit", "none") != "none" else 0
        build = {count: count - 1 + refit for count in counts}
        passes += build[counts[0]] if len(counts) == 1 else sum(b + 1 for b in build.values()) + max(build.values())
        if refit:
            intermediate = getattr(model.config, "intermediate_size", None) or 4 * d
            # AᵀA and AᵀR; with the stream scale also AᵀH (the rest of the block's output)
            refit_sums = intermediate * (intermediate + (2 if settings.refit_scale else 1) * d) * 8
            sums = max(sums, refit_sums)
            copies = 5 if settings.refit == "all" else 3  # "all" also keeps the original's two normed inputs
            notes.append(f"refit: {gib(refit_sums)} of sums per down-projection, and the original and compressed "
                         f"streams kept for all calibration tokens ({gib(copies * tokens * d * element)})")
        if len(counts) > 1:
            notes.append(f"spans auto: the model built with {', '.join(map(str, counts))} spans on a copy (another "
                         f"{'copy of the weights' if pipeline == 'whole' else 'skeleton over the checkpoint'}), "
                         "each fitted without an eighth of the calibration and scored with one pass of its loss on it, then the chosen count's model built "
                         "again in place (counted at most: touching spans build one model once)")
    elif settings.ranks_sublayers is not None:
        count = (settings.num_attention_layers(num_layers) if isinstance(settings, AttentionBudget)
                 else settings.num_blocks(num_layers))
        target = settings.ranks_sublayers
        per_layer = SublayerLinearity.sums_bytes_for(1, d)
        observers.append(SublayerLinearity(num_layers, target))
        criterion = settings.resolved_criterion(adapter) if hasattr(settings, "resolved_criterion") else "cosine"
        rounds = count if settings.greedy else 1
        if per_layer * num_layers <= budget:
            sums, per_round = per_layer * num_layers, 1
            stats_flops_per_token = num_layers * 10 * d * d
            notes.append(f"five d x d moments for each of the {num_layers} layers ({target})")
        else:
            group = max(1, budget // per_layer)
            fit_passes = math.ceil(count / group) if recipe.method != "drop-attn" else 0
            score_passes = 1 if criterion == "cosine" else math.ceil(num_layers / group)
            sums, per_round = min(group, num_layers) * per_layer, score_passes + fit_passes
            stats_flops_per_token = (num_layers * (criterion != "cosine") + count) * 10 * d * d
            notes.append(f"{gib(per_layer * num_layers)} for all layers exceeds the budget: {score_passes} pass(es) to "
                         f"score the layers ({criterion}), {fit_passes} for the chosen layers' moments, "
                         f"{group} layer(s) per pass")
        passes = rounds * per_round
    elif recipe.method == "drop-block":
        observers.append(SpanStatistics(num_layers, 1))
        notes.append("distances only")
    elif recipe.method == "prune-comp":
        n = settings.num_blocks(num_layers)
        observers.extend([SpanStatistics(num_layers, 1), StreamMagnitude(num_layers)])
        passes = n if settings.importance == "block_influence" else 2 * n
        notes.append("distances and per-channel magnitudes, one pass per removed block"
                     + ("" if settings.importance == "block_influence" else
                        f" after one stream per candidate block ({gib(num_layers * tokens * d * element)})"))
    elif recipe.method == "linear-patch":
        n = settings.num_blocks(num_layers)
        observers.extend([SpanStatistics(num_layers, n), BoundaryEquations(1, 1 + n)])
        sums, passes = 2 * d * d * 8, 2
        stats_flops_per_token = 4 * d * d + (2 * d * d if settings.patch == "hadamard" else 0)
        notes.append("span distances, then the chosen span's boundary normal equations"
                     + (" and rotated magnitudes" if settings.patch == "hadamard" else ""))
    elif recipe.method == "streamline":
        n = settings.num_blocks(num_layers)
        observers.append(SpanStatistics(num_layers, n + 1))
        passes = 2  # distances, then the stream before and after the chosen span (training reads it back)
        notes.append(f"span distances; the stream before and after the span kept for all calibration tokens "
                     f"({gib(2 * tokens * d * element)}), then {settings.train_steps} training steps on one block")
    elif recipe.method == "laco":
        n = settings.num_blocks(num_layers)
        rounds = math.ceil(n / (settings.merge_layers - 1))
        share = min(settings.similarity_sequences, calibration.num_sequences) / calibration.num_sequences
        passes = math.ceil(share * (1 + rounds * (num_layers + 1) / 2))  # about L²/2 blocks per round
        notes.append(f"{rounds} round(s), each one stream per candidate merge over {settings.similarity_sequences} "
                     f"sequences ({gib(num_layers * settings.similarity_sequences * calibration.sequence_length * d * element)})")
    elif recipe.method == "sleb":
        n = settings.num_blocks(num_layers)
        passes = n
        notes.append(f"one stream per candidate block: {gib(num_layers * tokens * d * element)} of hidden states "
                     "(use a small calibration set)")
    plan.add("statistics", f"{gib(sums)} of float64 sums (budget {gib(budget)}): " + "; ".join(notes))

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
        peak = per_layer_params * element + max(outside, chunk * per_sequence) + sums
    else:
        chunks = 1
        per_batch = per_token * calibration.batch_size * calibration.sequence_length
        plan.add("batches", f"{calibration.batch_size} sequences per batch ({gib(per_batch)} of activations and windows)")
        copies = 2 if isinstance(settings, SpanSelection) and len(settings.span_counts(settings.num_blocks(num_layers))) > 1 else 1
        peak = copies * weights + per_batch + sums  # spans auto: the original beside one candidate's copy
    plan.add("passes", f"{passes} over the calibration set")
    plan.add("peak memory", f"about {gib(peak)} on the device" + (f" of {gib(memory)}" if memory else ""))

    # -- time -----------------------------------------------------------------------------
    text_config = model.config  # a multimodal model's language model's
    head_dim = getattr(text_config, "head_dim", None) or d // text_config.num_attention_heads
    attention_flops = 4 * calibration.sequence_length * text_config.num_attention_heads * head_dim / 2  # causal: half
    forward = passes * tokens * (2 * _active_parameters(adapter, layers, text_config) + num_layers * attention_flops)
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
                    "passes": passes, "chunks": chunks, "peak_bytes": peak, "forward_flops": forward,
                    "stats_flops": stats, "transfer_bytes": transfer}
    return plan
