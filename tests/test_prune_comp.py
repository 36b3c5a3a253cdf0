"""Prune&Comp: the compensation folded into later blocks is the paper's scalar on the stream before
the gap (exactly, up to the norms' epsilon, on every architecture), it selects and compensates as
it should on blocks known by construction, and its output is a plain checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    ARCHITECTURES, MOE_ARCHITECTURES, generate_without_blockfold, handle_of, random_calibration, tiny_folder_and_corpus,
    tiny_model, tiny_tokenizer,
)

import blockfold
from blockfold.adapters import get_adapter
from blockfold.cli import main
from blockfold.methods.prune_comp import magnitude_gap
from blockfold.surgery import scale_block_output


def _without_norm_epsilon(model):
    """Norms with a negligible epsilon: scale invariance, which the compensation relies on, is then exact."""
    for module in model.modules():
        for name in ("eps", "variance_epsilon"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 1e-30)
    return model


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("arch", ARCHITECTURES + MOE_ARCHITECTURES)
def test_scaling_the_later_blocks_equals_scaling_the_stream_before_them(arch):
    """The paper multiplies the stream before the gap by s; blockfold divides what every later block
    adds by s: through scale-invariant norms the two give the same logits."""
    model = _without_norm_epsilon(tiny_model(arch))
    adapter = get_adapter(model)
    gap, scale = 2, 1.7
    ids = torch.randint(4, 96, (2, 12))
    hook = adapter.layers(model)[gap - 1].register_forward_hook(
        lambda module, inputs, output: (_hidden(output) * scale, *output[1:]) if isinstance(output, tuple)
        else output * scale)
    with torch.no_grad():
        expected = model(ids).logits
    hook.remove()
    compensated = copy.deepcopy(model)
    handle = handle_of(compensated)
    for layer in adapter.layers(compensated)[gap:]:
        scale_block_output(handle, layer, 1.0 / scale)
    with torch.no_grad():
        got = compensated(ids).logits
        plain = model(ids).logits
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert (plain - expected).abs().max() > 1e-2 * expected.abs().max(), "the stream's scale matters to begin with"


def test_magnitude_gap_is_the_mean_per_channel_ratio():
    magnitudes = dict(enumerate(torch.tensor([[1.0, 2.0], [2.0, 2.0], [4.0, 8.0]], dtype=torch.float64)))
    assert magnitude_gap(magnitudes, 0) == pytest.approx((2.0 + 1.0) / 2)
    assert magnitude_gap(magnitudes, 1) == pytest.approx((2.0 + 4.0) / 2)


def _do_nothing(model, blocks):
    adapter = get_adapter(model)
    with torch.no_grad():
        for index in blocks:
            _, projections = adapter.residual_writers(adapter.layers(model)[index])
            for projection in projections:
                getattr(projection.module, projection.weight).zero_()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_blocks_that_add_nothing_go_first_and_need_no_compensation(arch):
    model = tiny_model(arch)
    if arch == "gemma3_text":  # a sandwich block adds nothing when its post-norms' gains are zero
        adapter = get_adapter(model)
        for index in (2, 4):
            for norm in adapter.residual_writers(adapter.layers(model)[index])[0]:
                adapter.set_norm_scale(norm, 0.0)
    else:
        _do_nothing(model, [2, 4])
    ids = torch.randint(4, 96, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.PruneComp(blocks=2), calibration=random_calibration())
    assert result.manifest["removed_blocks"] == [2, 4]
    assert result.manifest["compensation"]["scales"] == pytest.approx([1.0, 1.0], abs=1e-9)
    assert len(get_adapter(model).layers(model)) == 4
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() < 1e-4


def test_compensation_is_what_separates_prune_comp_from_iterative_removal():
    """Same calibration, same importance: the blocks removed are those of the first round at least,
    and only the compensated run changes the later blocks' writers."""
    calibration = random_calibration()
    runs = {}
    for compensate in (True, False):
        model = tiny_model("llama")
        runs[compensate] = (blockfold.compress(model, tiny_tokenizer(), blockfold.PruneComp(blocks=2, compensate=compensate),
                                               calibration=calibration), model)
    (with_comp, model_comp), (without, model_plain) = runs[True], runs[False]
    assert with_comp.manifest["selection"]["order"][0] == without.manifest["selection"]["order"][0]
    assert without.manifest["compensation"] is None
    scales = with_comp.manifest["compensation"]["scales"]
    assert all(s > 0 and s != pytest.approx(1.0) for s in scales)
    first = with_comp.manifest["selection"]["order"][0]
    later = get_adapter(model_comp).layers(model_comp)[first]  # the block after the gap, renumbered
    plain_later = get_adapter(model_plain).layers(model_plain)[first]
    if with_comp.manifest["selection"]["order"] == without.manifest["selection"]["order"]:
        ratio = (get_adapter(model_comp).down_proj(later).weight / get_adapter(model_plain).down_proj(plain_later).weight)
        assert torch.allclose(ratio, torch.full_like(ratio, ratio.flatten()[0].item()), rtol=1e-4)


def test_cli_prune_comp_by_perplexity_reloads_without_blockfold(tmp_path, capsys):
    folder, corpus = tiny_folder_and_corpus(tmp_path)
    out = tmp_path / "out"
    assert main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(out), "--num-seqs", "8",
                 "--seq-len", "32", "--method", "prune-comp", "--blocks", "2", "--importance", "perplexity"]) == 0
    readme = (out / "README.md").read_text()
    assert "Prune&Comp" in readme and "No parameters were added" in readme
    tokens = generate_without_blockfold(out, [[5, 6, 7, 8]], tmp_path)
    assert len(tokens[0]) > 4
    code = main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(tmp_path / "bad"),
                 "--method", "prune-comp", "--criterion", "fit_error"])
    err = capsys.readouterr().err
    assert code != 0 and "--criterion does not apply to method 'prune-comp'" in err and "--importance" in err
    assert not (tmp_path / "bad").exists()
