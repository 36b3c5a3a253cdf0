"""SliceGPT (Ashkboos et al. 2024), a width baseline: rotate the residual stream into its principal directions
on calibration data and slice away the least used ones, so every weight that reads or writes the stream
loses rows or columns.

Computational invariance: with an RMSNorm's gain folded into the projections that read its output, the
norm commutes with any orthogonal ``Q`` (``‖x Q‖ = ‖x‖``), so a model whose stream is ``x Q`` computes the
same function once each reader's weight is ``W diag(g) Q`` and each writer's ``Qᵀ W``. Slicing keeps the
first ``k`` columns of ``Q``; the norms then average over ``k`` dimensions instead of ``d``, so their gains
become ``√(d/k)``. With tied embeddings (the embeddings rotated by ``Q`` are also the LM head) the final
norm's gain goes into one ``k × k`` map after the final norm.

One basis for every block, from the pooled second moment of the unit-length streams the blocks read (one
pass over the original). The paper gives each block its own basis, with a shortcut map between them,
measured on the already sliced model (a pass per block); measured on the original in one pass, per-block
bases compound: each block boundary projects the stream onto another subspace (SmolLM2-135M, untied,
8 of 576 dimensions sliced: held-out WikiText-2 107.5 with per-block bases, 37.4 with one; original 33.6).

Families it cannot rotate are refused: sandwich norms (a gain after the sublayer does not commute with
``Q``), LayerNorm (mean subtraction: not converted yet), mixtures of experts (stacked expert weights).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from blockfold.errors import BlockfoldError
from blockfold.estimate.signs import column_signs
from blockfold.methods.base import Job
from blockfold.stats.covariance import StreamCovariance
from blockfold.surgery import attach_sliced, fold_into_projection

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext


def sliced_width(hidden_size: int, slicing: float) -> int:
    """The width kept: ``(1 - slicing)`` of the hidden size, rounded to a multiple of 8 where the hidden size
    is one (what matrix kernels run fastest on), at least 8."""
    kept = (1.0 - slicing) * hidden_size
    return max(8, round(kept / 8) * 8) if hidden_size % 8 == 0 else max(1, round(kept))


def check_rotatable(adapter, model) -> None:
    """Refuse, in one line naming the reason, the families whose stream cannot be rotated exactly."""
    layers = adapter.layers(model)
    reason = None
    if adapter.post_attention_norm or adapter.post_mlp_norm:
        reason = "its blocks norm each sublayer's output (sandwich norms), whose gain does not commute with a rotation"
    elif any(adapter.is_sparse(layer) for layer in layers):
        reason = "its mixture-of-experts blocks keep their experts stacked in one parameter"
    elif any(getattr(norm, "bias", None) is not None or "LayerNorm" in type(norm).__name__
             for layer in layers for norm in (adapter.input_norm(layer), adapter.pre_mlp_norm(layer))):
        reason = "its norms are LayerNorms (mean subtraction), which blockfold does not convert to RMSNorms yet"
    elif adapter.is_vision:
        reason = "it is an image encoder"
    if reason is not None:
        raise BlockfoldError(f"slicegpt cannot rotate this {model.config.model_type} model: {reason}; compress it "
                             "with a method that removes blocks or factors projections (blockfold methods)")


def principal_directions(gram: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of ``gram`` by decreasing eigenvalue, each with its largest entry positive (so runs
    on other hardware agree), as the columns of an orthogonal matrix (float64)."""
    values, vectors = torch.linalg.eigh(gram.double())
    vectors = vectors.flip(-1)
    return vectors * column_signs(vectors)


@torch.no_grad()
def compress_slicegpt(job: Job) -> dict:
    settings, adapter, handle, model = job.settings, job.adapter, job.handle, job.model
    check_rotatable(adapter, model)
    layers, d = adapter.layers(model), job.hidden_size
    k = sliced_width(d, settings.slicing)
    observer = StreamCovariance(job.num_layers)
    job.run([observer], description="residual stream moments")
    gram = observer.covariance().double().cpu()
    basis = principal_directions(gram)[:, :k]
    kept_energy = float((basis * (gram @ basis)).sum() / gram.trace())
    scale = math.sqrt(d / k)  # an RMSNorm over k dimensions, rescaled to what it was over d
    offset = adapter.norm_weight_offset

    def norm_to_scale(norm) -> None:
        handle.transform(norm, "weight", lambda weight: torch.full((k,), scale - offset, dtype=weight.dtype,
                                                                   device=weight.device))

    def read_through(norm, readers, basis) -> None:
        """Fold ``norm``'s gain and the basis into each reader: ``W ← W diag(g) Q``; the gain becomes the scale."""
        gain = handle.saved_value(norm, "weight").double().cpu() + offset
        fold = gain[:, None] * basis
        for reader in readers:
            handle.transform(reader, "weight", lambda weight, fold=fold: weight @ fold.to(weight.device))
        norm_to_scale(norm)

    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    handle.transform(embeddings, "weight", lambda weight: weight @ basis.to(weight.device))
    embeddings.embedding_dim = k
    for layer in layers:
        read_through(adapter.input_norm(layer), adapter.input_projections(layer, "attention"), basis)
        read_through(adapter.pre_mlp_norm(layer), adapter.input_projections(layer, "mlp"), basis)
        for writer in [adapter.attention_output_projection(layer), *adapter.mlp_output_projections(layer)]:
            fold_into_projection(handle, writer, basis)
    final_norm = getattr(adapter.decoder(model), adapter.final_norm_attr)
    final_gain = handle.saved_value(final_norm, "weight").double().cpu() + offset
    head_map = None
    if tied:  # the head is the rotated embeddings: the final norm's gain becomes a map after it
        head_map = basis.T @ (final_gain[:, None] * basis)
        norm_to_scale(final_norm)
    else:
        read_through(final_norm, [head], basis)
    for module in model.modules():  # what the weights' new shapes say
        if isinstance(module, torch.nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    attach_sliced(handle, k, head_map)
    if tied:
        model.tie_weights()
    return {
        "removed_blocks": [],
        "sliced": {"hidden_size": [d, k], "slicing": 1 - k / d, "tied_head_map": head_map is not None},
        "selection": {"criterion": "principal directions", "score": 1 - kept_energy, "kept_energy": kept_energy},
    }


def plan_slicegpt(context: PlanContext) -> MethodPlan:
    """SliceGPT's plan for ``--dry-run``: one pass for the stream's pooled second moment."""
    from blockfold.plan import MethodPlan, gib

    check_rotatable(context.adapter, context.model)
    d = context.hidden_size
    plan = MethodPlan(passes=1, sums=StreamCovariance.sums_bytes_for(d))
    plan.observers.append(StreamCovariance(context.num_layers))
    plan.stats_flops_per_token = context.num_layers * 4 * d * d
    plan.notes.append(f"the residual stream's d x d second moment, pooled over the blocks ({gib(plan.sums)}), "
                      f"sliced to {sliced_width(d, context.settings.slicing)} of {d} dimensions")
    return plan


__all__ = ["compress_slicegpt", "plan_slicegpt", "sliced_width"]
