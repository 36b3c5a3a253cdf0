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

LayerNorm families (Phi-2, Cohere with untied embeddings) are converted: a LayerNorm subtracts the stream's mean, i.e. reads
only its part orthogonal to the all-ones direction, so the basis is taken in that part (at most ``d - 1``
directions) and the rotated stream holds exactly what the LayerNorm would have kept; its norms become
RMSNorms (``StreamRMSNorm``) and their biases move into the readers' biases (``W b`` added), the LM
head's included (it gains one where it had none).

Families it cannot rotate are refused: sandwich norms (a gain after the sublayer does not commute with
``Q``), mixtures of experts (stacked expert weights), LayerNorm with tied embeddings (the head reads the
embeddings' mean, which the rotated stream drops: Cohere), and attention that takes its heads' width from
the hidden size (GPT-NeoX).
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


def kept_width(d: int, slicing: float, layer_norms: bool) -> int:
    """The stream's width after slicing: ``sliced_width``, and never the all-ones direction a LayerNorm
    subtracts (at most ``d - 1``)."""
    k = sliced_width(d, slicing)
    return min(k, d - 1) if layer_norms else k


def _stream_norms(adapter, model) -> dict[str, torch.nn.Module]:
    """The norms that read the residual stream, by dotted name in ``model`` (a shared one once)."""
    decoder_prefix = next(name for name, module in model.named_modules() if module is adapter.layers(model))
    names = {}
    for index, layer in enumerate(adapter.layers(model)):
        for norm in (adapter.input_norm(layer), adapter.pre_mlp_norm(layer)):
            name = next(name for name, module in layer.named_children() if module is norm)
            names.setdefault(f"{decoder_prefix}.{index}.{name}", norm)
    final = getattr(adapter.decoder(model), adapter.final_norm_attr)
    names[next(name for name, module in model.named_modules() if module is final)] = final
    return names


def subtracts_mean(norm: torch.nn.Module) -> bool:
    """A LayerNorm (mean subtraction), as opposed to an RMSNorm."""
    return "LayerNorm" in type(norm).__name__ and "RMS" not in type(norm).__name__


def check_rotatable(adapter, model) -> None:
    """Refuse, in one line naming the reason, the families whose stream cannot be rotated exactly."""
    layers = adapter.layers(model)
    reason = None
    norms = _stream_norms(adapter, model) if not adapter.is_vision else {}
    layer_norms = any(subtracts_mean(norm) for norm in norms.values())
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if adapter.post_attention_norm or adapter.post_mlp_norm:
        reason = "its blocks norm each sublayer's output (sandwich norms), whose gain does not commute with a rotation"
    elif any(adapter.is_sparse(layer) for layer in layers):
        reason = "its mixture-of-experts blocks keep their experts stacked in one parameter"
    elif adapter.is_vision:
        reason = "it is an image encoder"
    elif adapter.head_width_from_hidden:
        reason = "its attention takes the heads' width from the hidden size, which slicing narrows"
    elif layer_norms and head is not None and head.weight is embeddings.weight:
        reason = ("its LayerNorm head shares the embeddings' weights, and reads their mean, which a rotation into "
                  "the LayerNorm's directions drops")
    elif any(getattr(norm, "bias", None) is not None and not subtracts_mean(norm) for norm in norms.values()):
        reason = "its RMSNorms have biases"
    elif any(reader.bias is None for layer in layers
             for norm, sublayer in ((adapter.input_norm(layer), "attention"), (adapter.pre_mlp_norm(layer), "mlp"))
             if getattr(norm, "bias", None) is not None for reader in adapter.input_projections(layer, sublayer)):
        reason = "its projections have no bias to take their LayerNorm's"
    if reason is not None:
        raise BlockfoldError(f"slicegpt cannot rotate this {model.config.model_type} model: {reason}; compress it "
                             "with a method that removes blocks or factors projections (blockfold methods)")


def centered_basis(d: int) -> torch.Tensor:
    """An orthonormal basis (``d × (d - 1)``, float64) of the directions orthogonal to the all-ones one: the
    part of the stream a LayerNorm reads."""
    ones = torch.full((d, 1), d ** -0.5, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.cat([ones, torch.eye(d, dtype=torch.float64)[:, : d - 1]], dim=1))
    return q[:, 1:]


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
    norms = _stream_norms(adapter, model)
    layer_norms = any(subtracts_mean(norm) for norm in norms.values())
    k = kept_width(d, settings.slicing, layer_norms)
    observer = StreamCovariance(job.num_layers)
    job.run([observer], description="residual stream moments")
    gram = observer.covariance().double().cpu()
    within = centered_basis(d) if layer_norms else torch.eye(d, dtype=torch.float64)
    gram = within.T @ gram @ within  # the moments of what the norms read
    principal = principal_directions(gram)[:, :k]
    basis = within @ principal
    kept_energy = float((principal * (gram @ principal)).sum() / gram.trace())
    scale = math.sqrt(d / k)  # a norm over k dimensions, rescaled to what it was over d
    offset = adapter.norm_weight_offset

    def norm_to_scale(norm) -> None:
        handle.transform(norm, "weight", lambda weight: torch.full((k,), scale - offset, dtype=weight.dtype,
                                                                   device=weight.device))

    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    readers: dict[str, list] = {name: [] for name in norms}
    by_norm = {id(norm): name for name, norm in norms.items()}
    for layer in layers:
        readers[by_norm[id(adapter.input_norm(layer))]] += adapter.input_projections(layer, "attention")
        readers[by_norm[id(adapter.pre_mlp_norm(layer))]] += adapter.input_projections(layer, "mlp")
    final_name = next(reversed(norms))
    if not tied:
        readers[final_name].append(head)

    rms_norms, head_bias = {}, None
    for name, norm in norms.items():
        gain = handle.saved_value(norm, "weight").double().cpu() + offset
        bias = handle.saved_value(norm, "bias").double().cpu() if getattr(norm, "bias", None) is not None else None
        fold = gain[:, None] * basis
        for reader in readers[name]:  # W (g x + b) + c becomes (W diag(g) Q) x' + (W b + c)
            if bias is not None:
                shift = handle.saved_value(reader, "weight").double().cpu() @ bias
                if reader.bias is None:  # the LM head (check_rotatable refused any other reader without one)
                    head_bias = shift
                else:
                    handle.transform(reader, "bias", lambda value, shift=shift: value + shift.to(value.device))
            handle.transform(reader, "weight", lambda weight, fold=fold: weight @ fold.to(weight.device))
        if subtracts_mean(norm):  # becomes an RMSNorm of the rotated stream, at the scale
            rms_norms[name] = scale
        elif not (tied and name == final_name):
            norm_to_scale(norm)

    handle.transform(embeddings, "weight", lambda weight: weight @ basis.to(weight.device))
    embeddings.embedding_dim = k
    for layer in layers:
        for writer in [adapter.attention_output_projection(layer), *adapter.mlp_output_projections(layer)]:
            fold_into_projection(handle, writer, basis)
    head_map = None
    if tied:  # the head is the rotated embeddings: the final norm's gain becomes a map after it
        final_norm = norms[final_name]
        final_gain = handle.saved_value(final_norm, "weight").double().cpu() + offset
        head_map = basis.T @ (final_gain[:, None] * basis)
        norm_to_scale(final_norm)
    for module in model.modules():  # what the weights' new shapes say
        if isinstance(module, torch.nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    # a LayerNorm's variance over d dimensions is the sliced stream's over k times k / d: its epsilon scales
    # with d / k, which makes the conversion exact (an RMSNorm family keeps its epsilon, off by eps (1 - k/d))
    eps = next((adapter.norm_eps(norm) for norm in norms.values() if subtracts_mean(norm)), None)
    attach_sliced(handle, k, head_map, rms_norms, eps * d / k if eps is not None else None, head_bias)
    if tied:
        model.tie_weights()
    return {
        "removed_blocks": [],
        "sliced": {"hidden_size": [d, k], "slicing": 1 - k / d, "tied_head_map": head_map is not None,
                   "layer_norms_converted": len(rms_norms)},
        "selection": {"criterion": "principal directions", "score": 1 - kept_energy, "kept_energy": kept_energy},
    }


def plan_slicegpt(context: PlanContext) -> MethodPlan:
    """SliceGPT's plan for ``--dry-run``: one pass for the stream's pooled second moment."""
    from blockfold.plan import MethodPlan, gib

    check_rotatable(context.adapter, context.model)
    d = context.hidden_size
    layer_norms = any(subtracts_mean(norm) for norm in _stream_norms(context.adapter, context.model).values())
    plan = MethodPlan(passes=1, sums=StreamCovariance.sums_bytes_for(d))
    plan.observers.append(StreamCovariance(context.num_layers))
    plan.stats_flops_per_token = context.num_layers * 4 * d * d
    plan.notes.append(f"the residual stream's d x d second moment, pooled over the blocks ({gib(plan.sums)}), "
                      f"sliced to {kept_width(d, context.settings.slicing, layer_norms)} of {d} dimensions")
    return plan


__all__ = ["compress_slicegpt", "plan_slicegpt", "sliced_width"]
