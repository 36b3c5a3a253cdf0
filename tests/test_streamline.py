"""LLM-Streamline: the block that replaces the span learns what the span did, a span whose later
blocks do nothing is replaced exactly, and the output is a plain checkpoint."""

from __future__ import annotations

import pytest
import torch
from conftest import (generate_without_blockfold, random_calibration, silence_blocks, tiny_folder_and_corpus, tiny_model,
                      tiny_tokenizer)

import blockfold
from blockfold.cli import main


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_moe"])
def test_training_lowers_the_replacement_error(arch):
    model = tiny_model(arch)
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.Streamline(blocks=2, train_steps=30, learning_rate=1e-3),
                                calibration=random_calibration())
    replacement = result.manifest["replacement"]
    assert len(replacement["replaces"]) == 3 and result.manifest["removed_blocks"] == replacement["replaces"][1:]
    assert replacement["mse_last"] < 0.7 * replacement["mse_first"]
    assert model.config.num_hidden_layers == 4


def test_a_span_whose_later_blocks_do_nothing_is_kept_exactly():
    """Where the span's later blocks add nothing, the target is the span's first block's own output, so
    the untrained block is already exact and training leaves it there."""
    model = tiny_model("llama")
    silence_blocks(model, (2, 3, 4, 5))
    ids = torch.randint(4, 96, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.Streamline(blocks=2, train_steps=5),
                                calibration=random_calibration())
    assert result.manifest["replacement"]["replaces"] in ([2, 3, 4], [3, 4, 5])  # cosine 1 across either
    assert result.manifest["replacement"]["mse_first"] < 1e-10
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() < 1e-4


def test_cli_streamline_output_reloads_without_blockfold(tmp_path):
    folder, corpus = tiny_folder_and_corpus(tmp_path)
    out = tmp_path / "out"
    assert main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(out), "--num-seqs", "8",
                 "--seq-len", "32", "--method", "streamline", "--blocks", "2", "--train-steps", "4"]) == 0
    assert "LLM-Streamline" in (out / "README.md").read_text()
    assert len(generate_without_blockfold(out, [[5, 6, 7, 8]], tmp_path)[0]) > 4
