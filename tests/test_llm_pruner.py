"""LLM-Pruner: the first-order Taylor importance prunes what the loss does not use, pruning nothing leaves the
model as it was, the blocks lose the share asked for, and the pruned checkpoint loads and generates
without blockfold."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import generate_without_blockfold, random_calibration, tiny_model, tiny_tokenizer

import blockfold
from blockfold.errors import BlockfoldError
from blockfold.methods.llm_pruner import pruned_layers
from blockfold.runtime import Execution

DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def test_the_paper_keeps_the_first_eighth_and_the_last_sixteenth_of_the_blocks():
    assert pruned_layers(32) == list(range(4, 30)) and pruned_layers(30) == list(range(4, 28))


@pytest.mark.parametrize("arch", DENSE)
def test_pruning_nothing_reproduces_the_model(arch):
    model = tiny_model(arch)
    ids = torch.randint(4, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(copy.deepcopy(model), tiny_tokenizer(), blockfold.LLMPruner(sparsity=1e-6),
                                calibration=random_calibration(8, 24))
    with torch.no_grad():
        assert torch.equal(result.handle.model(ids).logits, expected)


def test_channels_the_loss_does_not_use_go_first_and_the_blocks_lose_the_share_asked_for():
    model = tiny_model("llama")
    dead = [3, 17, 40]
    with torch.no_grad():
        mlp = model.model.layers[2].mlp
        mlp.gate_proj.weight[dead] = 0
        mlp.up_proj.weight[dead] = 0
        mlp.down_proj.weight[:, dead] = 0
        kept_before = mlp.gate_proj.weight.clone()
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.LLMPruner(sparsity=0.2),
                                calibration=random_calibration(16, 32))
    pruned = result.handle.model.model.layers[2].mlp.gate_proj.weight
    remaining = {index for index in range(kept_before.shape[0])
                 if any(torch.equal(kept_before[index], row) for row in pruned)}
    assert not remaining & set(dead), "a channel with no weight survived while others were pruned"
    assert result.manifest["sparsity"]["blocks"] == pytest.approx(0.2, abs=0.02)
    for index in (0, 5):  # the first and the last blocks stay whole
        assert result.handle.model.model.layers[index].mlp.gate_proj.weight.shape == kept_before.shape


def test_a_pruned_model_saves_loads_and_generates_without_blockfold(tmp_path):
    result = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), blockfold.LLMPruner(sparsity=0.3),
                                calibration=random_calibration(16, 32))
    result.save(tmp_path / "out")
    ids = [[5, 6, 7, 8]]
    with torch.no_grad():
        in_memory = result.handle.model.generate(torch.tensor(ids), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert generate_without_blockfold(tmp_path / "out", ids, tmp_path) == in_memory.tolist()


@pytest.mark.parametrize("arch, reason", [("qwen2_moe", "mixture-of-experts"), ("phi3", "fuses or names them otherwise"),
                                          ("gpt_neox", "fuses or names them otherwise")])
def test_what_it_cannot_prune_is_refused_in_one_line(arch, reason):
    with pytest.raises(BlockfoldError, match=reason) as error:
        blockfold.compress(tiny_model(arch), tiny_tokenizer(), blockfold.LLMPruner(),
                           calibration=random_calibration(8, 24))
    assert "\n" not in str(error.value)


def test_a_share_beyond_the_pruned_blocks_and_a_layer_by_layer_run_are_refused(tmp_path):
    with pytest.raises(BlockfoldError, match="give a --sparsity below"):
        blockfold.compress(tiny_model("llama"), tiny_tokenizer(), blockfold.LLMPruner(sparsity=0.9),
                           calibration=random_calibration(8, 24))
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    with pytest.raises(BlockfoldError, match="needs gradients through the whole model"):
        blockfold.compress(str(folder), recipe={"method": "llm-pruner"}, calibration=random_calibration(8, 24),
                           execution=Execution(pipeline="sequential"))
