"""LaCo: the collapse is the paper's merge of attention and MLP weights, the search finds a merge
known by construction to change nothing, every pipeline gives the same result, and the output is a
plain checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (MOE_ARCHITECTURES, generate_without_blockfold, handle_of, random_calibration, tiny_folder_and_corpus,
                      tiny_model, tiny_tokenizer)

import blockfold
from blockfold.adapters import get_adapter
from blockfold.cli import main
from blockfold.errors import BlockfoldError
from blockfold.methods.laco import collapse, mergeable


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_neox", *MOE_ARCHITECTURES])
def test_collapse_adds_the_later_blocks_differences_to_the_attention_and_mlp_only(arch):
    model = tiny_model(arch)
    adapter = get_adapter(model)
    before = [copy.deepcopy(layer) for layer in adapter.layers(model)]
    if arch == "qwen2_moe":  # its dense and sparse blocks alternate: nothing to collapse, and the search says so
        assert not any(mergeable(handle_of(model), first, 1) for first in range(5))
        with pytest.raises(BlockfoldError, match="no 2 consecutive blocks"):
            blockfold.compress(model, tiny_tokenizer(), blockfold.LaCo(blocks=1, merge_layers=2),
                               calibration=random_calibration())
        return
    collapse(handle_of(model), 1, 2)
    layers = adapter.layers(model)
    assert len(layers) == len(before) - 2
    for part in (adapter.attention, adapter.mlp):
        merged = dict(part(layers[1]).named_parameters())
        sources = [dict(part(before[k]).named_parameters()) for k in (1, 2, 3)]
        for name, value in merged.items():
            expected = sources[0][name].double() + sum(s[name].double() - sources[0][name].double() for s in sources[1:])
            assert torch.allclose(value.double(), expected, atol=1e-6), name
    norm = adapter.input_norm(layers[1])
    assert torch.equal(norm.weight, adapter.input_norm(before[1]).weight), "the norms stay block 1's"
    assert torch.equal(adapter.down_proj(layers[2]).weight if not adapter.is_sparse(layers[2]) else
                       adapter.mlp_output_projections(layers[2])[0].module.down_proj,
                       adapter.down_proj(before[4]).weight if not adapter.is_sparse(before[4]) else
                       adapter.mlp_output_projections(before[4])[0].module.down_proj)


def _do_nothing_copy_of_next(model, block: int) -> None:
    """Block ``block`` adds nothing (its attention and MLP weights are zero) and has the next block's
    norms: collapsing the next block into it gives back exactly the next block, so the model is unchanged."""
    adapter = get_adapter(model)
    layers = adapter.layers(model)
    with torch.no_grad():
        for part in (adapter.attention, adapter.mlp):
            for param in part(layers[block]).parameters():
                param.zero_()
        nexts = dict(layers[block + 1].named_parameters())
        for name, param in layers[block].named_parameters():
            if "norm" in name:
                param.copy_(nexts[name])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_merge_that_changes_nothing_is_found(arch):
    model = tiny_model(arch)
    _do_nothing_copy_of_next(model, 3)
    ids = torch.randint(4, 96, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.LaCo(blocks=1, merge_layers=2),
                                calibration=random_calibration())
    assert result.manifest["collapsed"] == [{"into": 3, "blocks": [4]}]
    assert result.manifest["selection"]["score"] == pytest.approx(1.0, abs=1e-6)
    others = {b: s for b, s in result.manifest["selection"]["candidates"].items() if b != 3}
    assert max(others.values()) < 1.0 - 1e-4, "the other merges change the model"
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() < 1e-4


def test_the_budget_is_met_exactly_with_a_smaller_last_merge():
    result = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), blockfold.LaCo(blocks=3, merge_layers=3),
                                calibration=random_calibration())
    sizes = [len(merge["blocks"]) for merge in result.manifest["collapsed"]]
    assert sizes == [2, 1] and len(result.manifest["removed_blocks"]) == 3
    assert result.model.config.num_hidden_layers == 3


def test_cli_laco_output_reloads_without_blockfold(tmp_path):
    folder, corpus = tiny_folder_and_corpus(tmp_path)
    out = tmp_path / "out"
    assert main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(out), "--num-seqs", "8",
                 "--seq-len", "32", "--method", "laco", "--blocks", "2", "--merge-layers", "3",
                 "--similarity-sequences", "4"]) == 0
    assert "collapsed (LaCo)" in (out / "README.md").read_text()
    assert len(generate_without_blockfold(out, [[5, 6, 7, 8]], tmp_path)[0]) > 4
