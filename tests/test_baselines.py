"""Baselines on tiny models whose redundant blocks are known by construction."""

from __future__ import annotations

import pytest
import torch
from conftest import random_calibration, silence_blocks, tiny_model

import blockfold
from blockfold.adapters import get_adapter


@pytest.mark.parametrize("identity_blocks", [[1, 4], [2, 3]])
def test_drop_block_removes_the_blocks_that_do_nothing(tokenizer, identity_blocks):
    model = tiny_model("llama")
    silence_blocks(model, identity_blocks)
    ids = torch.randint(4, 96, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(model, tokenizer, {"method": "drop-block", "blocks": 2}, calibration=random_calibration())
    assert result.manifest["removed_blocks"] == identity_blocks
    assert all(result.manifest["selection"]["candidates"][b] < 1e-6 for b in identity_blocks)
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() < 1e-4, "removing do-nothing blocks changes nothing"


def test_uidl_removes_the_contiguous_do_nothing_span_without_a_transform(tokenizer):
    model = tiny_model("llama")
    silence_blocks(model, [3, 4])
    down_before = get_adapter(model).down_proj(get_adapter(model).layers(model)[2]).weight.clone()
    result = blockfold.compress(model, tokenizer, {"method": "uidl", "blocks": 2}, calibration=random_calibration())
    assert result.manifest["removed_blocks"] == [3, 4]
    assert result.manifest["transform"]["estimator"] == "identity"
    assert torch.equal(get_adapter(model).down_proj(get_adapter(model).layers(model)[2]).weight, down_before)


def test_left_padding_scores_only_real_predictions():
    """SLEB's calibration perplexity counts a prediction only where the position making it is real:
    left- and right-padded batches of the same sequences score the same tokens the same."""
    from blockfold.data import Batch
    from blockfold.data.calibration import batch_sequences
    from blockfold.eval.perplexity import next_token_nll

    model = tiny_model("llama").eval()
    adapter = get_adapter(model)
    sequences = [torch.arange(4, 14), torch.arange(20, 26)]
    scores = {}
    for side in ("left", "right"):
        batch: Batch = batch_sequences(sequences, 2, 0, side)[0]
        with torch.no_grad():
            hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids).last_hidden_state
            scores[side] = next_token_nll(model, adapter, hidden, batch.input_ids, batch.attention_mask)
    assert scores["left"][1] == scores["right"][1] == 9 + 5
    assert abs(scores["left"][0] - scores["right"][0]) < 1e-3 * scores["right"][0]
