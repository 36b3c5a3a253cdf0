"""LinearPatch: the compressed model is the model with the span removed and ``h ← h P`` applied to the
stream at the gap, exactly, on every architecture; the Hadamard matrices are orthonormal; the patch
is the identity where the span did nothing; the output reloads with its shipped code."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (ARCHITECTURES, MOE_ARCHITECTURES, generate_without_blockfold, random_calibration, silence_blocks,
                      tiny_folder_and_corpus, tiny_model, tiny_tokenizer)

import blockfold
from blockfold.adapters import get_adapter
from blockfold.cli import main
from blockfold.estimate.hadamard import hadamard
from blockfold.methods.linear_patch import hadamard_patch


@pytest.mark.parametrize("size", [1, 2, 12, 20, 28, 32, 36, 576, 640, 896, 960, 3584])
def test_hadamard_matrices_are_orthonormal_with_equal_magnitudes(size):
    matrix = hadamard(size)
    assert torch.allclose(matrix @ matrix.T, torch.eye(size, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(matrix.abs(), torch.full_like(matrix, size**-0.5))


def test_a_size_without_a_construction_is_refused_with_the_way_out():
    with pytest.raises(blockfold.BlockfoldError, match="--patch full"):
        hadamard(6)  # no Hadamard matrix of order 6 exists (orders above 2 are multiples of 4)


def test_hadamard_patch_is_the_rotated_scaling():
    before = torch.rand(12, dtype=torch.float64) + 0.5
    patch, _ = hadamard_patch(before, before)
    assert torch.allclose(patch, torch.eye(12, dtype=torch.float64), atol=1e-12)
    patch, info = hadamard_patch(before, 3 * before)
    assert torch.allclose(patch, 3 * torch.eye(12, dtype=torch.float64), atol=1e-12) and info["scale_mean"] == pytest.approx(3)


@pytest.mark.parametrize("arch", ARCHITECTURES + MOE_ARCHITECTURES)
@pytest.mark.parametrize("patch", ["hadamard", "full"])
def test_output_is_the_span_removed_and_the_patch_applied_at_the_gap(arch, patch):
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    ids = torch.randint(4, 96, (2, 12))
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.LinearPatch(blocks=2, patch=patch),
                                calibration=random_calibration())
    start = result.manifest["patch"]["block"]
    assert result.manifest["removed_blocks"] == [start, start + 1]
    adapter = get_adapter(reference)
    linear = getattr(adapter.layers(model)[start], adapter.attention_attr).linear
    assert not linear.bias.any()
    matrix = torch.eye(32, dtype=torch.float64) + linear.weight.double().T  # the block computes h + h Wᵀ
    layers = adapter.layers(reference)
    hook = layers[start - 1].register_forward_hook(
        lambda module, inputs, output: ((output[0].double() @ matrix).float(), *output[1:]) if isinstance(output, tuple)
        else (output.double() @ matrix).float())
    del layers[start : start + 2]
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
        expected = reference(ids, use_cache=False).logits
    hook.remove()
    assert model.config.num_hidden_layers == reference.config.num_hidden_layers - 1
    assert (got - expected).abs().max() <= 1e-4 * max(expected.abs().max(), 1)


def test_a_span_that_does_nothing_gets_the_identity_patch():
    model = tiny_model("llama")
    silence_blocks(model, (3, 4))
    ids = torch.randint(4, 96, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.LinearPatch(blocks=2), calibration=random_calibration())
    assert result.manifest["removed_blocks"] == [3, 4]
    assert result.manifest["patch"]["scale_min"] == pytest.approx(1.0) == result.manifest["patch"]["scale_max"]
    assert result.manifest["patch"]["relative_fit_error"] == pytest.approx(0.0, abs=1e-10)
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() < 1e-4


def test_cli_linear_patch_reloads_with_its_shipped_code(tmp_path, capsys):
    folder, corpus = tiny_folder_and_corpus(tmp_path)
    out = tmp_path / "out"
    assert main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(out), "--num-seqs", "8",
                 "--seq-len", "32", "--method", "linear-patch", "--blocks", "3", "--patch", "full"]) == 0
    readme = (out / "README.md").read_text()
    assert "linear patch on the residual stream" in readme and "trust_remote_code=True" in readme
    assert len(generate_without_blockfold(out, [[5, 6, 7, 8]], tmp_path)[0]) > 4
    code = main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(tmp_path / "bad"),
                 "--method", "linear-patch", "--ridge-alpha", "0.1"])
    assert code != 0 and "--patch full" in capsys.readouterr().err
