"""SLEB: remove blocks one at a time, each time the block whose removal raises calibration perplexity least.

Cost: every step scores every remaining block with the full model's loss. Instead of one forward pass
per candidate, each batch is run once with the current model while each block's input (hidden state
and the keyword arguments the decoder passes it: masks, rotary embeddings) is kept; skipping block b
then only re-runs the blocks after b from b's input. That halves the work on average and is exact.
Use a small calibration set on CPU: the work is about (blocks²/2) block-passes per step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.adapters import DecoderAdapter, get_adapter
from blockfold.data import Batch, CalibrationSet
from blockfold.recipe import Recipe
from blockfold.surgery import remove_blocks


class _PassThrough(nn.Module):
    """Stands in for a block removed during the search, keeping every other block's index (and so its
    mask type and cache slot) unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _Captured(Exception):
    """Raised after the last block: the search needs block inputs only."""


def _logits(model: PreTrainedModel, adapter: DecoderAdapter, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(getattr(adapter.decoder(model), adapter.final_norm_attr)(hidden))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


def _token_nll(logits: torch.Tensor, batch: Batch) -> tuple[float, int]:
    """Summed next-token negative log-likelihood over real tokens, and how many were scored."""
    mask = batch.attention_mask[:, 1:].bool()
    targets = batch.input_ids[:, 1:][mask]
    nll = F.cross_entropy(logits[:, :-1][mask].float(), targets.to(logits.device), reduction="sum")
    return float(nll), int(mask.sum())


@torch.no_grad()
def candidate_losses(model: PreTrainedModel, adapter: DecoderAdapter, calibration: CalibrationSet,
                     candidates: list[int]) -> dict[int, float]:
    """Calibration perplexity of the model with each candidate block skipped (the others as they are)."""
    layers = adapter.layers(model)
    device = next(model.parameters()).device
    inputs: dict[int, tuple[tuple, dict]] = {}
    capturing = [False]  # hooks act only during the capture pass, not while re-running later blocks

    def keep_input(index):
        def hook(module, args, kwargs):
            if capturing[0]:
                inputs[index] = (args, kwargs)
        return hook

    def stop(module, args, output):
        if capturing[0]:
            raise _Captured

    handles = [layer.register_forward_pre_hook(keep_input(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[len(layers) - 1].register_forward_hook(stop))
    totals = {block: [0.0, 0] for block in candidates}
    try:
        for batch in tqdm(list(calibration), desc="scoring blocks", unit="batch", leave=False):
            inputs.clear()
            capturing[0] = True
            try:
                adapter.decoder(model)(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                                       position_ids=batch.position_ids.to(device), use_cache=False)
            except _Captured:
                pass
            finally:
                capturing[0] = False
            for block in candidates:
                args, kwargs = inputs[block]
                hidden = args[0] if args else kwargs["hidden_states"]
                for later in range(block + 1, len(layers)):
                    later_args, later_kwargs = inputs[later]
                    hidden = layers[later](hidden, *later_args[1:], **{k: v for k, v in later_kwargs.items() if k != "hidden_states"})
                nll, count = _token_nll(_logits(model, adapter, hidden), batch)
                totals[block][0] += nll
                totals[block][1] += count
    finally:
        for handle in handles:
            handle.remove()
    return {block: math.exp(nll / count) for block, (nll, count) in totals.items()}


def compress_sleb(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, recipe: Recipe,
                  calibration: CalibrationSet) -> dict:
    adapter = get_adapter(model)
    layers = adapter.layers(model)
    num_layers = len(layers)
    count = recipe.num_blocks_to_remove(num_layers)
    removed: list[int] = []
    steps = []
    originals = list(layers)
    try:
        for _ in tqdm(range(count), desc="SLEB", unit="block"):
            candidates = [block for block in range(num_layers) if block not in removed]
            perplexities = candidate_losses(model, adapter, calibration, candidates)
            best = min(perplexities, key=perplexities.get)
            removed.append(best)
            layers[best] = _PassThrough()
            steps.append({"removed": best, "calibration_perplexity": perplexities[best], "candidates": perplexities})
    finally:
        for block in removed:
            layers[block] = originals[block]
    remove_blocks(model, adapter, sorted(removed))
    return {
        "removed_blocks": sorted(removed),
        "selection": {"criterion": "calibration_perplexity_greedy", "order": removed,
                      "score": steps[-1]["calibration_perplexity"], "candidates": steps[0]["candidates"],
                      "steps": steps},
    }
