"""Optional, cheap healing of a compressed model by next-token training on a little text.

Two modes, both leaving a standard checkpoint (no new parameters):

* ``lt``: train only the down-projections the ReplaceMe maps were folded into (the paper's "train
  only the linear transform"; the manifest names them), everything else frozen;
* ``lora``: LoRA adapters (peft) on every linear layer of the decoder blocks, merged back into the
  weights after training.

A down-projection folded with ``linearized-norm`` (Gemma's sandwich blocks) holds the map scaled by
about 1e-6, so that the post-MLP norm acts linearly on its tiny output. Plain training would move it
by about the learning rate per step and wreck that fold; ``lt`` trains it in its own scale instead
(the learning rate times the fold's scale: with Adam, the same as training ``W / scale``), and
``lora`` leaves it out (an adapter's update is not small there).

On a half-precision model the optimizer steps float32 master copies of the trained weights (an Adam
step of 1e-4 is below bfloat16's resolution for most weights and would round away), and in float16
the loss is scaled so that small gradients do not underflow: the scale halves on an overflow (the step
is skipped) and doubles after a run of finite steps, as mixed-precision training does.
"""

from __future__ import annotations

import math
import time
import warnings

import torch
from transformers import PreTrainedModel

from blockfold.adapters import get_adapter
from blockfold.data import CalibrationSet
from blockfold.errors import BlockfoldError
from blockfold.progress import bar
from blockfold.recipe import HealConfig


def folded_blocks(manifest: dict | None) -> list[int]:
    """Current indices of the blocks whose down-projection holds a folded map, from the manifest
    (which records them in the original numbering)."""
    if not manifest or manifest.get("method") not in ("replaceme", None) or "removed_blocks" not in manifest:
        raise BlockfoldError(
            "--mode lt trains the down-projections ReplaceMe folded its maps into, and this model has no ReplaceMe "
            "manifest naming them: heal a blockfold replaceme output, or use --mode lora"
        )
    removed = manifest["removed_blocks"]
    spans = manifest.get("spans") or [{"folded_into_block": manifest["transform_folded_into_block"]}]
    original = sorted({span["folded_into_block"] for span in spans if span.get("transform", {}).get("estimator") != "identity"})
    if not original:
        raise BlockfoldError("this model's spans were removed without a map (identity estimator): use --mode lora")
    return [_current_index(block, removed) for block in original]


def _current_index(block: int, removed: list[int]) -> int:
    """A kept block's index after the ``removed`` ones (original numbering) are gone."""
    return block - sum(1 for r in removed if r < block)


def linearized_scales(manifest: dict | None) -> dict[int, float]:
    """Current index → scale of each block whose down-projection was folded with ``linearized-norm``."""
    if not manifest or "removed_blocks" not in manifest:
        return {}
    return {_current_index(span["folded_into_block"], manifest["removed_blocks"]):
            span["transform"]["linearized_norm"]["down_proj_scale"]
            for span in manifest.get("spans") or [] if span.get("transform", {}).get("regime") == "linearized-norm"}


def _trainable_lt(model: PreTrainedModel, blocks: list[int], scales: dict[int, float],
                  learning_rate: float) -> list[dict]:
    """Parameter groups: each folded block's down-projections (every expert's in a mixture), at the learning
    rate times its fold's scale."""
    adapter = get_adapter(model)
    model.requires_grad_(False)
    groups = []
    for block in blocks:
        weights = [getattr(p.module, p.weight) for p in adapter.mlp_output_projections(adapter.layers(model)[block])]
        for weight in weights:
            weight.requires_grad_(True)
        groups.append({"params": weights, "lr": learning_rate * scales.get(block, 1.0)})
    return groups


def _lora_targets(model: PreTrainedModel, excluded_blocks: set[int]) -> list[str]:
    """Full names of every nn.Linear inside the decoder blocks, but the linearized down-projections."""
    adapter = get_adapter(model)
    names = {module: name for name, module in model.named_modules()}
    targets = []
    for index, layer in enumerate(adapter.layers(model)):
        skipped = adapter.down_proj(layer) if index in excluded_blocks else None
        targets += [names[module] for module in layer.modules() if isinstance(module, torch.nn.Linear) and module is not skipped]
    return targets


class MasterWeights:
    """Float32 copies of the half-precision parameters in ``groups``, which the optimizer steps instead;
    ``step`` copies the gradients in (unscaled), steps, and writes the rounded copies back. A float16
    model's loss is scaled dynamically (``scale``)."""

    #: finite steps after which the float16 loss scale doubles
    GROWTH_INTERVAL = 50

    def __init__(self, groups: list[dict], loss_scaling: bool):
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self.groups, self.stepped = [], []
        for group in groups:
            params = []
            for param in group["params"]:
                if param.dtype in (torch.float16, torch.bfloat16):
                    self.pairs.append((param, torch.nn.Parameter(param.detach().float())))
                    params.append(self.pairs[-1][1])
                else:
                    params.append(param)
            self.groups.append({**group, "params": params})
            self.stepped += params
        self.loss_scaling, self.scale = loss_scaling, 2.0 ** 12 if loss_scaling else 1.0
        self._finite_steps, self.skipped = 0, 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scale).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients into the masters and step, or skip the step after an overflow."""
        for param, master in self.pairs:
            master.grad = param.grad.float() if param.grad is not None else None
            param.grad = None
        gradients = [param.grad for param in self.stepped if param.grad is not None]
        for gradient in gradients:
            gradient.div_(self.scale)
        if self.loss_scaling and not all(bool(torch.isfinite(gradient).all()) for gradient in gradients):
            self.scale, self._finite_steps, self.skipped = self.scale / 2, 0, self.skipped + 1
            optimizer.zero_grad()
            return
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for param, master in self.pairs:
                param.copy_(master)
        self._finite_steps += 1
        if self.loss_scaling and self._finite_steps % self.GROWTH_INTERVAL == 0:
            self.scale *= 2


def heal(model: PreTrainedModel, data: CalibrationSet, config: HealConfig, manifest: dict | None = None) -> PreTrainedModel:
    """Train ``model`` as ``config`` says on ``data``'s batches; returns the (merged) model and
    records what was done in ``manifest["healing"]`` when a manifest is given."""
    torch.manual_seed(config.seed)
    device = next(model.parameters()).device
    scales = linearized_scales(manifest)
    if config.mode == "lt":
        blocks = folded_blocks(manifest)
        groups = _trainable_lt(model, blocks, scales, config.learning_rate)
        trained = model
        what = {"blocks": blocks}
    else:
        from peft import LoraConfig, get_peft_model

        targets = _lora_targets(model, set(scales))
        model.requires_grad_(False)
        with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing a user can act on
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            trained = get_peft_model(model, LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                                       lora_dropout=0.0, target_modules=targets, bias="none"))
        groups = [{"params": [p for p in trained.parameters() if p.requires_grad]}]
        what = {"target_modules": sorted({name.rsplit(".", 1)[-1] for name in targets}), "lora_rank": config.lora_rank,
                "lora_alpha": config.lora_alpha}
    if scales:
        what["linearized_down_proj_blocks"] = {"blocks": sorted(scales), "handled_as": "trained in the fold's scale"
                                               if config.mode == "lt" else "left out of the adapters"}
    parameters = [p for group in groups for p in group["params"]]
    half = {p.dtype for p in trained.parameters()} & {torch.float16, torch.bfloat16}
    masters = MasterWeights(groups, loss_scaling=torch.float16 in half)
    optimizer = torch.optim.AdamW(masters.groups, lr=config.learning_rate, weight_decay=0.0)
    batches = list(data)
    if not batches:
        raise BlockfoldError("healing data has no batches: give a non-empty --data")
    trained.train()
    losses, started = [], time.perf_counter()
    progress = bar(range(config.steps), desc=f"healing ({config.mode})", unit="step")
    for step in progress:
        batch = batches[step % len(batches)]
        ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        labels = ids.masked_fill(mask == 0, -100)
        loss = trained(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        value = float(loss.detach())
        if not math.isfinite(value):
            raise BlockfoldError(f"healing diverged at step {step} (loss {value}): lower --lr")
        masters.backward(loss)
        masters.step(optimizer)
        losses.append(value)
        progress.set_postfix(loss=f"{value:.3f}")
    trained.eval()
    if config.mode == "lora":
        model = trained.merge_and_unload()
    model.requires_grad_(False)
    window = max(1, min(10, len(losses) // 4))
    if manifest is not None:
        manifest["healing"] = {
            **config.model_dump(mode="json", exclude={"data"}), **what, "data": data.description,
            "trained_parameters": sum(p.numel() for p in parameters),
            "loss_first_steps": sum(losses[:window]) / window, "loss_last_steps": sum(losses[-window:]) / window,
            "seconds": time.perf_counter() - started,
            **({"master_weights": "float32", "loss_scale": masters.scale if masters.loss_scaling else None,
                "skipped_steps": masters.skipped} if half else {}),
        }
    return model
