"""Baselines users compare against, built from the same pieces: nothing is put in place of what is removed.

* ``uidl``: the contiguous span with the smallest angular distance, removed as it is
  (UIDL / ShortGPT-style depth pruning without healing).
* ``drop-block``: DROP's block dropping: the blocks whose output is most similar to their input
  (mean cosine over all real tokens), wherever they are.
"""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.adapters import get_adapter
from blockfold.data import CalibrationSet
from blockfold.methods.replaceme import compress_replaceme
from blockfold.recipe import Recipe
from blockfold.stats import SpanStatistics, stream_activations
from blockfold.surgery import remove_blocks


def compress_uidl(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, calibration: CalibrationSet
) -> dict:
    update = {"estimator": "identity", "criterion": recipe.criterion or "angular_last"}
    return compress_replaceme(model, tokenizer, recipe.model_copy(update=update), calibration)


def compress_drop_blocks(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, calibration: CalibrationSet
) -> dict:
    adapter = get_adapter(model)
    num_layers = adapter.num_layers(model)
    count = recipe.num_blocks_to_remove(num_layers)
    statistics = SpanStatistics(num_layers, max_length=1)
    stream_activations(model, adapter, calibration, [statistics])
    cosine = statistics.finalize().cosine_all[:num_layers, 1]  # block i: cos(h[i], h[i+1])
    distances = {block: float(1.0 - cosine[block]) for block in range(num_layers)}
    blocks = sorted(sorted(distances, key=distances.get)[:count])
    remove_blocks(model, adapter, blocks)
    return {
        "removed_blocks": blocks,
        "selection": {"criterion": "cosine_distance_per_block", "candidates": distances,
                      "score": sum(distances[b] for b in blocks) / count},
    }
