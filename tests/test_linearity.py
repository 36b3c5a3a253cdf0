"""Neural Block Linearization: moments, the LMMSE map and the linearity criteria, on synthetic data
with known answers and on tiny random-weight models."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from conftest import random_calibration, stream, tiny_model

from blockfold.adapters import get_adapter
from blockfold.errors import BlockfoldError
from blockfold.estimate import fit_lmmse
from blockfold.select import LINEARITY_CRITERIA, cca_bound, cosine_distance, nmse, rank_layers, score_layers
from blockfold.stats import LayerActivations, SublayerLinearity

D, ROWS = 16, 5000


def _gaussian(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Correlated Gaussian rows with a non-zero mean, and their population covariance."""
    mixing = torch.eye(D, dtype=torch.float64) + 0.3 * torch.randn(D, D, generator=generator, dtype=torch.float64)
    mean = torch.randn(D, generator=generator, dtype=torch.float64)
    samples = torch.randn(rows, D, generator=generator, dtype=torch.float64) @ mixing.T + mean
    return samples, mixing @ mixing.T


def _acts(x, y, residual=None, mlp=None, index=0) -> LayerActivations:
    """What the engine would hand over for a layer whose attention reads ``x`` and adds ``y``."""
    residual = x if residual is None else residual
    mlp = torch.zeros_like(y) if mlp is None else mlp
    return LayerActivations(index=index, block_in=residual, block_out=residual + y + mlp, mlp_contribution=mlp,
                            down_out=None, last_token=torch.tensor([x.shape[0] - 1]), attn_input=x,
                            attn_contribution=y)


def _observe(x, y, target="attention"):
    observer = SublayerLinearity(1, target)
    observer.on_layer(_acts(x, y))
    observer.end_batch()
    return observer.finalize()[0]


# -- synthetic data with known answers ----------------------------------------------------------

@pytest.mark.filterwarnings("error")  # a well-conditioned C_xx must not need the ridge fallback
@pytest.mark.parametrize("target", ["attention", "block"])
def test_exact_linear_map_is_recovered(target):
    generator = torch.Generator().manual_seed(0)
    x, _ = _gaussian(ROWS, generator)
    weight = torch.randn(D, D, generator=generator, dtype=torch.float64)
    bias = torch.randn(D, generator=generator, dtype=torch.float64)
    stats = _observe(x, x @ weight.T + bias, target)
    fitted_weight, fitted_bias, info = fit_lmmse(stats)
    np.testing.assert_allclose(fitted_weight.numpy(), weight.numpy(), rtol=0, atol=1e-8)
    np.testing.assert_allclose(fitted_bias.numpy(), bias.numpy(), rtol=0, atol=1e-8)
    assert info["ridge_alpha"] == 0.0 and info["tokens"] == ROWS
    assert abs(info["nmse"]) < 1e-12 and abs(nmse(stats)) < 1e-12
    assert abs(cca_bound(stats)) < 1e-8


def test_independent_noise_is_not_linear():
    generator = torch.Generator().manual_seed(1)
    x, _ = _gaussian(ROWS, generator)
    y = torch.randn(ROWS, D, generator=generator, dtype=torch.float64)
    stats = _observe(x, y)
    # sample canonical correlations of independent Gaussians: E[Σρ²] = d_x d_y / (n − 1), sd ≈ 0.0045
    assert cca_bound(stats) == pytest.approx(D - D * D / (ROWS - 1), abs=0.025)
    assert cca_bound(stats, per_dimension=True) == pytest.approx(cca_bound(stats) / D, rel=1e-12)
    # in-sample R² of each output is about d_x / (n − 1)
    assert nmse(stats) == pytest.approx(1 - D / (ROWS - 1), abs=0.002)


def test_known_signal_to_noise_gives_theoretical_nmse_and_cca():
    generator = torch.Generator().manual_seed(2)
    x, cov_x = _gaussian(ROWS, generator)
    weight = torch.linalg.qr(torch.randn(D, D, generator=generator, dtype=torch.float64))[0]
    signal = torch.linalg.eigvalsh(weight @ cov_x @ weight.T)  # variances of the signal's principal axes
    noise_var = float(signal.sum()) / (3 * D)  # signal : noise = 3 : 1 in total variance
    y = x @ weight.T + 0.5 + math.sqrt(noise_var) * torch.randn(ROWS, D, generator=generator, dtype=torch.float64)
    stats = _observe(x, y)
    assert nmse(stats) == pytest.approx(0.25, rel=0.02)
    # with white noise the canonical correlations are ρᵢ² = sᵢ / (sᵢ + σ²) along the signal's axes
    expected = float((noise_var / (signal + noise_var)).sum())
    assert cca_bound(stats) == pytest.approx(expected, rel=0.02)


def test_cosine_compares_the_residual_around_the_target_sublayer():
    generator = torch.Generator().manual_seed(3)
    a = torch.rand(100, 1, generator=generator, dtype=torch.float64) + 0.5
    zero = torch.zeros_like(a)
    residual, y, mlp = (torch.cat(parts + [zero] * (D - 3), dim=1)
                        for parts in ([a, zero, zero], [zero, a, zero], [zero, zero, a]))
    for target, expected in (("attention", 1 - 1 / math.sqrt(2)), ("block", 1 - 1 / math.sqrt(3))):
        observer = SublayerLinearity(1, target)
        observer.on_layer(_acts(torch.randn(100, D, generator=generator, dtype=torch.float64), y, residual, mlp))
        assert cosine_distance(observer.finalize()[0]) == pytest.approx(expected, rel=1e-12)


def test_stream_error_is_the_lmmse_error_relative_to_the_stream_after_the_sublayer_per_token():
    generator = torch.Generator().manual_seed(5)
    x, _ = _gaussian(ROWS, generator)
    residual = 3 * torch.randn(ROWS, D, generator=generator, dtype=torch.float64)
    y = x.tanh() @ torch.randn(D, D, generator=generator, dtype=torch.float64)
    observer = SublayerLinearity(1, "attention")
    observer.on_layer(_acts(x, y, residual))
    stats = observer.finalize()[0]
    design = torch.cat([x, torch.ones(ROWS, 1, dtype=torch.float64)], dim=1)
    error = y - design @ torch.linalg.lstsq(design, y).solution  # the LMMSE fit, by numpy-style lstsq
    expected = float((error.pow(2).sum(-1) / (residual + y).pow(2).sum(-1)).mean())
    assert LINEARITY_CRITERIA["stream"](stats) == pytest.approx(expected, rel=1e-9)


def test_merge_of_shards_equals_one_pass():
    generator = torch.Generator().manual_seed(4)
    layers = [(x, x.sin() @ torch.randn(D, D, generator=generator, dtype=torch.float64))
              for x in (_gaussian(ROWS, generator)[0] for _ in range(2))]
    whole, shards = SublayerLinearity(2, "attention"), [SublayerLinearity(2, "attention") for _ in range(2)]
    for part, shard in zip((slice(0, 2000), slice(2000, None)), shards):
        for index, (x, y) in enumerate(layers):
            shard.on_layer(_acts(x[part], y[part], index=index))
            whole.on_layer(_acts(x[part], y[part], index=index))
        shard.end_batch()
        whole.end_batch()
    merged = shards[0].merge(shards[1])
    assert merged is shards[0]
    for got, expected in zip(merged.finalize(), whole.finalize()):
        assert got.tokens == expected.tokens == ROWS
        assert got.mean_cosine == pytest.approx(expected.mean_cosine, rel=1e-12)
        for name, value in expected.stream_weighted.items():
            torch.testing.assert_close(got.stream_weighted[name], value, rtol=1e-12, atol=1e-14)
        for name in ("mean_x", "mean_y", "cov_xx", "cov_yy", "cov_yx"):
            torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-12, atol=1e-12)
    with pytest.raises(BlockfoldError, match="cannot merge"):
        whole.merge(SublayerLinearity(2, "block"))


def test_singular_input_covariance_falls_back_to_ridge():
    generator = torch.Generator().manual_seed(5)
    x, _ = _gaussian(ROWS, generator)
    x[:, 1] = x[:, 0]  # a repeated channel: C_xx is singular
    with pytest.warns(UserWarning, match="singular"):
        weight, bias, info = fit_lmmse(_observe(x, x.cos()))
    assert info["ridge_alpha"] > 0 and torch.isfinite(weight).all() and torch.isfinite(bias).all()


def test_bad_requests_name_the_valid_choices():
    with pytest.raises(BlockfoldError, match="attention, block"):
        SublayerLinearity(4, "mlp")
    generator = torch.Generator().manual_seed(6)
    x, _ = _gaussian(ROWS, generator)
    statistics = [_observe(x, x.sin())] * 3
    with pytest.raises(BlockfoldError, match="cca, nmse, cosine"):
        rank_layers(statistics, "angular", 1)
    for k in (0, 3):
        with pytest.raises(BlockfoldError, match=r"1\.\.2"):
            rank_layers(statistics, "cca", k, exclude={0})


# -- tiny models through the streaming engine ---------------------------------------------------

def _direct_activations(model, adapter, calibration) -> dict:
    """Residual streams from HF's hidden states and the attention's input and contribution from hooks,
    per layer, as float64 (tokens, d)."""
    rows = defaultdict(list)

    def keep(key):
        def hook(module, args, output):
            output = output[0] if isinstance(output, tuple) else output
            rows[key].append(output.reshape(-1, output.shape[-1]).double())

        return hook

    handles = []
    for index, layer in enumerate(adapter.layers(model)):
        handles.append(adapter.input_norm(layer).register_forward_hook(keep(("attn_in", index))))
        handles.append(adapter.attention_contribution_module(layer).register_forward_hook(keep(("attn", index))))
    with torch.no_grad():
        for batch in calibration:
            hidden = adapter.decoder(model)(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                            position_ids=batch.position_ids, output_hidden_states=True).hidden_states
            for index, state in enumerate(hidden):
                rows["hidden", index].append(state.reshape(-1, state.shape[-1]).double())
    for handle in handles:
        handle.remove()
    return {key: torch.cat(value) for key, value in rows.items()}


def test_streamed_statistics_match_direct_computation(arch):
    model = tiny_model(arch)
    adapter = get_adapter(model)
    calibration = random_calibration(num_sequences=8, length=24)
    observers = {target: SublayerLinearity(6, target) for target in ("attention", "block")}
    stream(model, calibration, list(observers.values()))
    attention, block = (observers[target].finalize() for target in ("attention", "block"))
    direct = _direct_activations(model, adapter, calibration)

    def close(got, expected):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))

    for index, stats in enumerate(attention):
        x, y, residual = direct["attn_in", index], direct["attn", index], direct["hidden", index]
        assert stats.tokens == x.shape[0] == 8 * 24
        close(stats.mean_x, x.mean(0))
        close(stats.mean_y, y.mean(0))
        close(stats.cov_yx, (y - y.mean(0)).T @ (x - x.mean(0)) / x.shape[0])
        cosine = torch.nn.functional.cosine_similarity(residual, residual + y, dim=-1).mean()
        assert stats.mean_cosine == pytest.approx(float(cosine), abs=1e-5)
    for index, stats in enumerate(block[:-1]):  # HF's last hidden state is after the final norm
        before, after = direct["hidden", index], direct["hidden", index + 1]
        close(stats.mean_x, before.mean(0))
        close(stats.mean_y, (after - before).mean(0))

    for criterion in LINEARITY_CRITERIA:
        scores = score_layers(attention, criterion)
        chosen = rank_layers(attention, criterion, 3, exclude={0})
        assert len(set(chosen)) == 3 and set(chosen) <= {1, 2, 3, 4, 5}
        assert max(scores[i] for i in chosen) <= min(scores[i] for i in {1, 2, 3, 4, 5} - set(chosen))


class _LinearAttention(torch.nn.Module):
    """An attention sublayer that is exactly affine in the hidden state it reads."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, hidden_states, **kwargs):
        return hidden_states @ self.weight.T + self.bias, None


def test_truly_linear_attention_is_found():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    generator = torch.Generator().manual_seed(7)
    weight = torch.eye(32) + torch.randn(32, 32, generator=generator) / math.sqrt(32)
    bias = 0.1 * torch.randn(32, generator=generator)
    adapter.layers(model)[2].self_attn = _LinearAttention(weight, bias)
    observer = SublayerLinearity(6, "attention")
    stream(model, random_calibration(num_sequences=16, length=32), [observer])
    statistics = observer.finalize()

    assert cca_bound(statistics[2]) < 1e-6
    assert nmse(statistics[2]) < 1e-8
    assert min(cca_bound(s) for i, s in enumerate(statistics) if i != 2) > 1e-2
    assert rank_layers(statistics, "cca", 1) == [2]
    fitted_weight, fitted_bias, _ = fit_lmmse(statistics[2])
    torch.testing.assert_close(fitted_weight, weight.double(), rtol=0, atol=1e-4)
    torch.testing.assert_close(fitted_bias, bias.double(), rtol=0, atol=1e-4)
