"""Exactness of the pieces on tiny random-weight models of every supported architecture."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import ExplicitTransform, handle_of, random_calibration, stream, tiny_model

import blockfold
from blockfold.adapters import get_adapter
from blockfold.data import CalibrationSet
from blockfold.errors import BlockfoldError
from blockfold.estimate import fit_lstsq
from blockfold.stats import SpanStatistics
from blockfold.surgery import fold_into_down_proj, remove_blocks


def test_folded_model_matches_explicit_transform(arch):
    model = tiny_model(arch)
    adapter = get_adapter(model)
    torch.manual_seed(3)
    transform = torch.eye(32, dtype=torch.float64) + 0.2 * torch.randn(32, 32, dtype=torch.float64)
    start, span = 2, [2, 3]

    reference = copy.deepcopy(model)
    mlp = adapter.mlp(adapter.layers(reference)[start - 1])
    setattr(mlp, adapter.down_proj_attr, ExplicitTransform(adapter.down_proj(adapter.layers(reference)[start - 1]), transform))
    remove_blocks(reference, adapter, span)

    fold_into_down_proj(handle_of(model), adapter.down_proj(adapter.layers(model)[start - 1]), transform)
    remove_blocks(model, adapter, span)

    ids = torch.randint(4, 96, (2, 20))
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"{arch}: folded vs explicit max abs diff {diff}"
    assert model.config.num_hidden_layers == 4
    assert [adapter.attention(layer).layer_idx for layer in adapter.layers(model)] == [0, 1, 2, 3]


def _span_rows(model, adapter, batch, start, length):
    """X (MLP contribution of block start-1) and Y (target minus attention residual), computed directly."""
    captured = {}
    layers = adapter.layers(model)
    hook = adapter.mlp_contribution_module(layers[start - 1]).register_forward_hook(
        lambda m, a, out: captured.__setitem__("x", out))
    with torch.no_grad():
        hidden = adapter.decoder(model)(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             position_ids=batch.position_ids, output_hidden_states=True).hidden_states
    hook.remove()
    x = captured["x"].reshape(-1, 32).double()
    block_out = hidden[start].reshape(-1, 32).double()
    # HF's last hidden state is after the final norm; spans used here end before the last block.
    target = hidden[start + length].reshape(-1, 32).double()
    return x, target - (block_out - x)


def test_lstsq_equals_numpy_lstsq(arch):
    model = tiny_model(arch)
    adapter = get_adapter(model)
    calibration = random_calibration(num_sequences=8, length=24)
    stats = SpanStatistics(6, max_length=2, fit_length=2)
    stream(model, calibration, [stats])
    table = stats.finalize()
    ids = torch.cat([b.input_ids for b in calibration])
    for start in (1, 2, 3):
        # the same batches as the pass, so both see bit-identical activations
        rows = [_span_rows(model, adapter, b, start, 2) for b in calibration]
        x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        expected = np.linalg.lstsq(x.numpy(), y.numpy(), rcond=None)[0]
        transform, info = fit_lstsq(table.normal_equations[start])
        np.testing.assert_allclose(transform.numpy(), expected, rtol=1e-7, atol=1e-9)
        direct_error = float(((x @ transform - y) ** 2).sum() / (y**2).sum())
        assert info["relative_fit_error"] == pytest.approx(direct_error, rel=1e-6, abs=1e-9)
        assert table.normal_equations[start].tokens == ids.numel()


def _ragged_calibration(lengths, side, batch_size, seed=5):
    from blockfold.data import batch_sequences

    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(4, 96, (n,), generator=generator) for n in lengths]
    batches = batch_sequences(sequences, batch_size, pad_id=0, side=side)
    return CalibrationSet(batches, {})


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_does_not_change_statistics(arch, side, pipeline):
    model = tiny_model(arch)
    lengths = [24, 9, 17, 5, 24, 12]
    tables = []
    for batch_size in (1, 3):  # batch_size 1: no padding at all
        stats = SpanStatistics(6, max_length=3, fit_length=2)
        stream(model, _ragged_calibration(lengths, side, batch_size), [stats], pipeline)
        tables.append(stats.finalize())
    unpadded, padded = tables
    assert padded.tokens == unpadded.tokens == sum(lengths)
    for name in ("angular_all", "angular_last", "cosine_all"):
        np.testing.assert_allclose(getattr(padded, name), getattr(unpadded, name), rtol=1e-4, atol=1e-6)
    for start, eq in unpadded.normal_equations.items():
        other = padded.normal_equations[start]
        np.testing.assert_allclose(other.xtx.numpy(), eq.xtx.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(other.xty.numpy(), eq.xty.numpy(), rtol=1e-4, atol=1e-4)


def test_statistics_merge_equals_single_pass():
    model = tiny_model("llama")
    calibration = random_calibration(num_sequences=8)
    whole = SpanStatistics(6, 2, 2)
    stream(model, calibration, [whole])
    shards = [SpanStatistics(6, 2, 2), SpanStatistics(6, 2, 2)]
    for shard, batch in zip(shards, calibration.batches):
        stream(model, [batch], [shard])
    merged = shards[0].merge(shards[1]).finalize()
    whole = whole.finalize()
    np.testing.assert_allclose(merged.angular_all, whole.angular_all, rtol=1e-12)
    torch.testing.assert_close(merged.normal_equations[2].xty, whole.normal_equations[2].xty)


def test_compress_removes_selected_span_and_keeps_generation_working(arch, tokenizer):
    model = tiny_model(arch)
    result = blockfold.compress(model, tokenizer, {"blocks": 2}, calibration=random_calibration())
    manifest = result.manifest
    assert manifest["num_layers"] == 4 and len(manifest["removed_blocks"]) == 2
    assert manifest["removed_blocks"][0] >= 1, "the first block is never removed"
    assert manifest["selection"]["start"] == min(manifest["selection"]["candidates"], key=manifest["selection"]["candidates"].get)
    assert manifest["transform"]["relative_fit_error"] <= manifest["transform"]["relative_error_plain_removal"] + 1e-9
    ids = torch.randint(4, 96, (1, 6))
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 18)


def test_singular_normal_equations_fall_back_to_ridge():
    x = torch.randn(50, 4, dtype=torch.float64)
    x = torch.cat([x, x[:, :1]], dim=1)  # a repeated column: XᵀX is singular
    y = torch.randn(50, 5, dtype=torch.float64)
    from blockfold.stats import NormalEquations

    eq = NormalEquations(x.T @ x, x.T @ y, float((y * y).sum()), 0.0, 50)
    with pytest.warns(UserWarning, match="singular"):
        transform, info = fit_lstsq(eq)
    assert info["ridge_alpha"] > 0 and torch.isfinite(transform).all()
    best = np.linalg.lstsq(x.numpy(), y.numpy(), rcond=None)[0]
    assert info["relative_fit_error"] == pytest.approx(eq.relative_residual(torch.from_numpy(best)), rel=1e-4)


def test_normal_equations_a_held_out_part_leaves_indefinite_still_solve():
    """Sums less the sums of some of their rows recomputed in another batch (the shortlist's fit without
    its held-out sequences), fewer rows left than inputs: the recomputed rows differ in their last bits,
    so the difference has eigenvalues below zero by more than the first fallback ridge (SmolLM2 on 4 x 128
    tokens: -1.6e-3 against a ridge of 1.5e-3); the ridge grows until the solve holds, and says which."""
    from blockfold.stats import NormalEquations

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(60, 40, dtype=torch.float64, generator=generator)
    y = torch.randn(60, 3, dtype=torch.float64, generator=generator)
    held = x[30:] * (1 + 1e-5 * torch.randn(30, 40, dtype=torch.float64, generator=generator))
    full = NormalEquations(x.T @ x, x.T @ y, float((y * y).sum()), 0.0, 60)
    part = NormalEquations(held.T @ held, held.T @ y[30:], float((y[30:] ** 2).sum()), 0.0, 30)
    left = full.less(part)
    first_ridge = 1e-6 * float(left.xtx.diagonal().mean())
    assert float(torch.linalg.eigvalsh(left.xtx)[0]) < -first_ridge
    with pytest.warns(UserWarning, match="singular"):
        transform, info = fit_lstsq(left)
    assert torch.isfinite(transform).all() and info["ridge_alpha"] > first_ridge
    kept = x[:30] @ transform - y[:30]  # 30 rows, 40 inputs: the kept rows are fitted
    assert float((kept ** 2).sum()) < 1e-3 * float((y[:30] ** 2).sum())
    broken = left.xtx.clone()
    broken[0, 0] = float("nan")  # no ridge helps: one clear error, not a linear-algebra traceback
    with pytest.raises(BlockfoldError, match="no ridge makes them solvable"):
        fit_lstsq(NormalEquations(broken, left.xty, left.yty_trace, 0.0, 30), warn=False)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_linearized_norm_fold_matches_explicit_linear_map(arch):
    """Sandwich blocks: with the post-MLP norm driven into its linear regime, the block adds exactly
    ``down_proj(a) @ T`` (the reference replaces the norm by the identity and applies T explicitly)."""
    from blockfold.surgery import fold_through_linearized_norm

    model = tiny_model(arch)
    adapter = get_adapter(model)
    torch.manual_seed(4)
    transform = 0.5 * torch.randn(32, 32, dtype=torch.float64)
    block, ids = 1, torch.randint(4, 96, (2, 20))

    reference = copy.deepcopy(model)
    layer = adapter.layers(reference)[block]
    mlp = adapter.mlp(layer)
    setattr(mlp, adapter.down_proj_attr, ExplicitTransform(adapter.down_proj(layer), transform))
    setattr(layer, adapter.post_mlp_norm, torch.nn.Identity())

    captured = []
    hook = adapter.down_proj(adapter.layers(model)[block]).register_forward_hook(lambda m, a, out: captured.append(out))
    with torch.no_grad():
        model(ids)
    hook.remove()
    max_rms = float((captured[0].double() @ transform).pow(2).mean(-1).sqrt().max())
    norm = adapter.mlp_norm(adapter.layers(model)[block])
    fold_through_linearized_norm(handle_of(model), adapter.down_proj(adapter.layers(model)[block]), norm, transform,
                                 max_rms)
    with torch.no_grad():
        expected, got = reference(ids).logits, model(ids).logits
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-4 * max(1.0, expected.abs().max().item()), f"{arch}: max abs diff {diff}"


@pytest.mark.parametrize("estimator", ["lstsq", "cosine"])
def test_compare_chooses_the_sandwich_fold_on_tokens_the_fits_did_not_sample(estimator, tokenizer):
    """compare (version 3's auto) judges the folds on held-out tokens: on the fit sample the
    through-norm refit, which had seen it, was judged on its own training data."""
    model = tiny_model("gemma3_text")
    recipe = {"blocks": 2, "estimator": estimator, "sandwich_fold": "compare", "cosine": {"steps": 10, "max_tokens": 64}}
    fit = blockfold.compress(model, tokenizer, recipe, calibration=random_calibration()).manifest["transform"]
    losses = fit["held_out_loss_per_regime"]
    assert fit["compared_on"].endswith(" held-out calibration tokens")
    assert fit["regime"] == min(losses, key=losses.get)
    assert losses != fit["sample_loss_per_regime"] and set(losses) == {"linearized-norm", "through-norm"}
    assert fit["through_norm"]["loss_end"] <= fit["through_norm"]["loss_start"] + 1e-6


def test_compare_on_the_fit_sample_says_so(tokenizer, caplog):
    """A calibration set no larger than the fit sample leaves nothing to hold out: say it, and warn."""
    model = tiny_model("gemma3_text")
    with caplog.at_level("WARNING", logger="blockfold.methods.replaceme"):
        fit = blockfold.compress(model, tokenizer, {"blocks": 2, "sandwich_fold": "compare"},
                                 calibration=random_calibration()).manifest["transform"]
    assert fit["compared_on"].startswith("the fit sample") and "held_out_loss_per_regime" not in fit
    assert "compared on tokens the through-norm fit has seen" in caplog.text


def test_auto_folds_linearized_norm_without_fitting_through_norm(tokenizer, monkeypatch):
    """auto folds linearized-norm, the fold that reached the lower perplexity at every Gemma-3-270m
    start (BENCHMARKS.md): the through-norm numerical fit, which it would not use, is not run."""
    import blockfold.methods.replaceme as replaceme

    numerical_fits = []
    real_fit = replaceme.fit_numerically
    monkeypatch.setattr(replaceme, "fit_numerically", lambda *a, **k: numerical_fits.append(a) or real_fit(*a, **k))
    fit = blockfold.compress(tiny_model("gemma3_text"), tokenizer, {"blocks": 2},
                             calibration=random_calibration()).manifest["transform"]
    assert fit["regime"] == "linearized-norm" and "through_norm" not in fit and not numerical_fits


def test_attention_capture_decomposes_each_block(arch):
    """With attention captured, block_in + attention + MLP contributions == block_out, token by token."""
    model = tiny_model(arch)
    seen = []

    class _Check:
        last_layer, needs_attention = 5, True

        def on_layer(self, acts):
            rebuilt = acts.block_in + acts.attn_contribution + acts.mlp_contribution
            seen.append(float((rebuilt - acts.block_out).abs().max() / acts.block_out.abs().max()))
            assert acts.attn_input.shape == acts.block_in.shape

        def end_batch(self):
            pass

    stream(model, random_calibration(num_sequences=4), [_Check()])
    assert len(seen) == 6 and max(seen) < 1e-5


def test_a_through_norm_fit_that_is_not_finite_is_skipped_by_compare_and_refused_when_forced(tokenizer, monkeypatch):
    """Gemma-3-270m at some starts: the through-norm start point divides by a norm scale of 0, its loss is
    NaN, and a NaN compared with min() could have chosen it. compare folds the finite form; forcing the
    broken one is one clear line."""
    import blockfold.methods.replaceme as replaceme

    real_fit = replaceme.fit_numerically

    def broken_through_norm(rows, init, config, objective, contribution=None):
        if contribution is None:
            return real_fit(rows, init, config, objective)
        return init * float("nan"), {"objective": objective, "loss_start": float("nan"), "loss_end": float("nan")}

    monkeypatch.setattr(replaceme, "fit_numerically", broken_through_norm)
    manifest = blockfold.compress(tiny_model("gemma3_text"), tokenizer, {"blocks": 2, "sandwich_fold": "compare"},
                                  calibration=random_calibration()).manifest
    assert manifest["transform"]["regime"] == "linearized-norm"
    with pytest.raises(BlockfoldError, match="through-norm fit of span .* is not finite.*--sandwich-fold linearized-norm"):
        blockfold.compress(tiny_model("gemma3_text"), tokenizer, {"blocks": 2, "sandwich_fold": "through-norm"},
                           calibration=random_calibration())


def test_auto_falls_back_to_through_norm_where_the_linearized_fit_is_not_finite(tokenizer, monkeypatch, caplog):
    import blockfold.methods.replaceme as replaceme

    real_map = replaceme.closed_form_map

    def broken_linearized(settings, equations, warn=True):  # the span scorer passes warn=False: left intact
        transform, info = real_map(settings, equations, warn=warn)
        return (transform * float("nan") if warn else transform), info

    monkeypatch.setattr(replaceme, "closed_form_map", broken_linearized)
    with caplog.at_level("WARNING", logger="blockfold.methods.replaceme"):
        fit = blockfold.compress(tiny_model("gemma3_text"), tokenizer, {"blocks": 2, "cosine": {"steps": 3}},
                                 calibration=random_calibration()).manifest["transform"]
    assert fit["regime"] == "through-norm" and "linearized-norm fit is not finite" in caplog.text
    with pytest.raises(BlockfoldError, match="linearized-norm fit of span .* is not finite.*--sandwich-fold through-norm"):
        blockfold.compress(tiny_model("gemma3_text"), tokenizer, {"blocks": 2, "sandwich_fold": "linearized-norm"},
                           calibration=random_calibration())
