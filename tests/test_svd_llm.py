"""SVD-LLM: the whitened factorization keeps what the projection's output on data needs, is exact at full
rank on every dense family, and saves a checkpoint that loads and generates without blockfold."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import generate_without_blockfold, random_calibration, tiny_model, tiny_tokenizer

import blockfold
from blockfold.errors import BlockfoldError
from blockfold.methods import svd_llm
from blockfold.runtime import Execution

DENSE_FAMILIES = ("llama", "gemma3_text", "qwen2", "phi3", "gpt_neox", "cohere")


def _inputs(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Rows of one distribution (``seed`` draws the rows) whose directions differ in scale by 30x, as
    activations do: where whitening matters."""
    mixing = torch.linalg.qr(torch.randn(width, width, generator=torch.Generator().manual_seed(0),
                                         dtype=torch.float64))[0]
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, width, generator=generator, dtype=torch.float64)
            * torch.logspace(-1.5, 0, width, dtype=torch.float64)) @ mixing


def test_full_rank_reproduces_the_weight_and_the_loss_is_the_lost_energy():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=generator, dtype=torch.float64)
    x = _inputs(400, 64)
    first, second, lost = svd_llm.factor(weight, 48, x.T @ x)
    assert float((second @ first - weight).abs().max()) < 1e-10 and lost == 0.0
    first, second, lost = svd_llm.factor(weight, 16, x.T @ x)
    measured = float(((x @ (second @ first - weight).T) ** 2).sum() / ((x @ weight.T) ** 2).sum())
    assert first.shape == (16, 64) and second.shape == (48, 16)
    assert measured == pytest.approx(lost, rel=1e-3)  # the damping (1e-6 of the mean diagonal) aside


def test_whitening_loses_less_of_the_output_than_plain_svd_at_the_same_rank():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 64, generator=generator, dtype=torch.float64)
    fitted, held_out = _inputs(400, 64, seed=3), _inputs(400, 64, seed=4)

    def output_error(gram):
        first, second, _ = svd_llm.factor(weight, 16, gram)
        return float(((held_out @ (second @ first - weight).T) ** 2).sum() / ((held_out @ weight.T) ** 2).sum())

    assert output_error(fitted.T @ fitted) < 0.5 * output_error(None)


def test_the_rank_holds_the_share_of_parameters_asked_for():
    assert svd_llm.rank_for(576, 1536, 0.2) == 335  # 0.8 * 576 * 1536 / 2112 = 335.1
    assert svd_llm.rank_for(8, 8, 0.99) == 1


@pytest.mark.parametrize("arch", DENSE_FAMILIES)
def test_full_rank_factors_reproduce_the_model(arch, monkeypatch):
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    monkeypatch.setattr(svd_llm, "rank_for", lambda out_features, in_features, sparsity: min(out_features, in_features))
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.SvdLlm(), calibration=random_calibration(16, 32))
    ids = torch.randint(4, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = reference(ids).logits, result.handle.model(ids).logits
    assert float((got - expected).abs().max()) <= 1e-4 * float(expected.abs().max())
    assert result.manifest["low_rank"]["ranks"]


def test_a_compressed_model_saves_loads_and_generates_without_blockfold(tmp_path):
    model = tiny_model("llama")
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.SvdLlm(sparsity=0.4),
                                calibration=random_calibration(16, 32))
    low_rank = result.manifest["low_rank"]
    assert low_rank["sparsity_of_projections"] >= 0.4
    assert result.manifest["parameters"] < result.manifest["original_parameters"]
    result.save(tmp_path / "out")
    assert (tmp_path / "out" / "modeling_blockfold.py").is_file()
    ids = [[5, 6, 7, 8]]
    with torch.no_grad():
        in_memory = result.handle.model.generate(torch.tensor(ids), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert generate_without_blockfold(tmp_path / "out", ids, tmp_path) == in_memory.tolist()


def test_plain_svd_runs_no_pass_and_whitening_one():
    calibration = random_calibration(8, 24)
    plain = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), blockfold.SvdLlm(whitening=False),
                               calibration=calibration)
    whitened = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), blockfold.SvdLlm(), calibration=calibration)
    assert plain.manifest["execution"]["passes"] == 0 and whitened.manifest["execution"]["passes"] == 1


def test_moments_beyond_the_statistics_budget_take_one_pass_per_group_and_give_the_same_model():
    calibration = random_calibration(8, 24)
    whole = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), blockfold.SvdLlm(), calibration=calibration)
    grouped = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), blockfold.SvdLlm(), calibration=calibration,
                                 execution=Execution(pipeline="sequential", stats_memory=100_000))
    layers = whole.manifest["num_layers"]
    assert grouped.manifest["execution"]["passes"] > 1
    assert grouped.manifest["selection"]["statistics"]["layers_per_pass"] < layers
    for (name, expected), got in zip(whole.handle.model.state_dict().items(), grouped.handle.model.state_dict().values()):
        assert torch.allclose(got, expected, atol=1e-5 * float(expected.abs().max() or 1)), name


def test_a_mixture_of_experts_is_refused_in_one_line():
    with pytest.raises(BlockfoldError, match="mixture-of-experts") as error:
        blockfold.compress(tiny_model("qwen2_moe"), tiny_tokenizer(), blockfold.SvdLlm(),
                           calibration=random_calibration(8, 24))
    assert "\n" not in str(error.value)
