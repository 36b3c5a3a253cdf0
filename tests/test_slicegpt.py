"""SliceGPT: rotating each layer's stream is exact (slicing nothing reproduces the model), slicing keeps the
principal directions, a LayerNorm family is converted exactly, the families it cannot rotate are refused in
one line, and the sliced checkpoint loads and generates without blockfold, tied embeddings included."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import generate_without_blockfold, random_calibration, tiny_model, tiny_tokenizer

import blockfold
from blockfold.errors import BlockfoldError
from blockfold.methods.slicegpt import principal_directions, sliced_width

ROTATABLE = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def _tied(arch: str):
    model = tiny_model(arch, tied=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ROTATABLE)
def test_slicing_nothing_reproduces_the_model(arch, tied):
    model = _tied(arch) if tied else tiny_model(arch)
    ids = torch.randint(4, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    expected = _logits(model, ids)
    result = blockfold.compress(copy.deepcopy(model), tiny_tokenizer(), blockfold.SliceGPT(slicing=0.0),
                                calibration=random_calibration(16, 32))
    assert float((_logits(result.handle.model, ids) - expected).abs().max()) <= 1e-4 * float(expected.abs().max())
    assert result.manifest["sliced"]["tied_head_map"] == tied


@pytest.mark.parametrize("arch", ["phi", "cohere"])
def test_a_layernorm_family_is_converted_exactly_and_reloads_without_blockfold(tmp_path, arch):
    """Phi-2's (and an untied Cohere's) LayerNorms read the stream's part orthogonal to the all-ones
    direction: rotated within it (d - 1 directions kept at slicing 0), the norms become RMSNorms, their
    biases move into the readers' (the LM head's included), and the model computes what it did."""
    model = tiny_model(arch)
    ids = torch.randint(4, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    expected = _logits(model, ids)
    result = blockfold.compress(copy.deepcopy(model), tiny_tokenizer(), blockfold.SliceGPT(slicing=0.0),
                                calibration=random_calibration(16, 32))
    d = model.config.hidden_size
    assert result.manifest["sliced"]["hidden_size"] == [d, d - 1]
    assert result.manifest["sliced"]["layer_norms_converted"] == model.config.num_hidden_layers + 1  # shared, final
    assert float((_logits(result.handle.model, ids) - expected).abs().max()) <= 1e-4 * float(expected.abs().max())
    sliced = blockfold.compress(copy.deepcopy(model), tiny_tokenizer(), blockfold.SliceGPT(slicing=0.25),
                                calibration=random_calibration(16, 32))
    sliced.save(tmp_path / "out")
    with torch.no_grad():
        in_memory = sliced.handle.model.generate(ids[:1, :4], max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert generate_without_blockfold(tmp_path / "out", ids[:1, :4].tolist(), tmp_path) == in_memory.tolist()


@pytest.mark.parametrize("arch, why", [("gemma3_text", "sandwich norms"), ("qwen2_moe", "mixture-of-experts"),
                                       ("gpt_neox", "heads' width from the hidden size"),
                                       ("cohere-tied", "LayerNorm head shares the embeddings"),
                                       ("phi-tied", "LayerNorm head shares the embeddings")])
def test_a_family_it_cannot_rotate_is_refused_in_one_line(arch, why):
    model = tiny_model(arch.removesuffix("-tied"), tied=True) if arch.endswith("-tied") else tiny_model(arch)
    with pytest.raises(BlockfoldError, match="slicegpt cannot rotate") as error:
        blockfold.compress(model, tiny_tokenizer(), blockfold.SliceGPT(), calibration=random_calibration(8, 24))
    assert "\n" not in str(error.value) and why in str(error.value)


def test_the_kept_width_is_a_multiple_of_eight_where_the_hidden_size_is():
    assert sliced_width(576, 0.25) == 432 and sliced_width(1536, 0.3) == 1072 and sliced_width(30, 0.5) == 15


def test_principal_directions_are_orthogonal_and_ordered_by_variance():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(500, 16, generator=generator, dtype=torch.float64) * torch.linspace(3, 0.1, 16, dtype=torch.float64)
    basis = principal_directions(x.T @ x)
    assert torch.allclose(basis.T @ basis, torch.eye(16, dtype=torch.float64), atol=1e-10)
    variances = ((x @ basis) ** 2).sum(0)
    assert bool((variances[:-1] >= variances[1:]).all())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_sliced_model_saves_loads_and_generates_without_blockfold(tmp_path, tied):
    model = _tied("llama") if tied else tiny_model("llama")
    original_width = model.config.hidden_size
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.SliceGPT(slicing=0.25),
                                calibration=random_calibration(16, 32))
    assert result.manifest["sliced"]["hidden_size"] == [original_width, sliced_width(original_width, 0.25)]
    assert result.manifest["parameters"] < result.manifest["original_parameters"]
    result.save(tmp_path / "out")
    ids = [[5, 6, 7, 8]]
    with torch.no_grad():
        in_memory = result.handle.model.generate(torch.tensor(ids), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert generate_without_blockfold(tmp_path / "out", ids, tmp_path) == in_memory.tolist()
