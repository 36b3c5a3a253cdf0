"""Half precision where a fold needs range: Gemma's linearized-norm fold stores weights near 1e-10
and a norm scale near 1e6, which bfloat16 holds and float16 does not."""

from __future__ import annotations

import pytest
import torch
from conftest import random_calibration, tiny_model, tiny_tokenizer
from simulated_device import DEVICE, simulated_accelerator
from transformers import AutoModelForCausalLM

import blockfold
from blockfold.errors import BlockfoldError
from blockfold.runtime import Execution

LINEARIZED = {"blocks": 2, "span_start": 2, "sandwich_fold": "linearized-norm", "refit": "none"}
IDS = torch.randint(4, 96, (2, 12), generator=torch.Generator().manual_seed(3))


def _large_activations():
    """The tiny Gemma with a residual stream 1e3 times as large, as real models' are: the embeddings and
    every gain that writes to the stream scaled (each block reads the stream through a norm, so this is
    the same function). Its linearized fold then scales the weights by about 4e-10, as on Gemma-3-270m,
    instead of the tiny model's 4e-7."""
    model = tiny_model("gemma3_text")
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1e3)
        for layer in model.model.layers:
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight.copy_((norm.weight + 1) * 1e3 - 1)  # Gemma's gain is 1 + weight
    return model


@pytest.fixture(scope="module")
def linearized():
    result = blockfold.compress(_large_activations(), tiny_tokenizer(), LINEARIZED, random_calibration())
    assert result.manifest["transform"]["regime"] == "linearized-norm"
    return result


def _logits(folder, dtype):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(IDS).logits.float()


def test_a_linearized_fold_saved_in_float16_is_refused_with_the_fix(linearized, tmp_path):
    with pytest.raises(BlockfoldError, match=r"cannot be saved in float16.*--save-dtype.*through-norm"):
        linearized.save(tmp_path / "out", save_dtype="float16")
    assert not list(tmp_path.iterdir())  # nothing half written


def _rounding_error(folder, dtype) -> float:
    return float((_logits(folder, dtype) - _logits(folder, torch.float32)).abs().max())


def test_a_linearized_fold_saved_in_bfloat16_loads_and_matches_float32(linearized, tmp_path):
    """Within twice the error bfloat16 makes on the uncompressed model: the fold costs no precision."""
    assert linearized.manifest["transform"]["linearized_norm"]["down_proj_scale"] < 1e-9
    folded = linearized.save(tmp_path / "folded", save_dtype="float32")
    assert torch.isfinite(_logits(folded, torch.bfloat16)).all()
    original = tmp_path / "original"
    _large_activations().save_pretrained(original)
    assert _rounding_error(folded, torch.bfloat16) <= 2 * _rounding_error(original, torch.bfloat16)


def test_float16_on_an_accelerator_folds_through_the_norm_or_refuses_the_linearized_fold():
    with simulated_accelerator():
        model = tiny_model("gemma3_text").to(torch.float16).to(DEVICE)
        auto = blockfold.compress(model, tiny_tokenizer(), {"blocks": 2, "span_start": 2, "cosine": {"steps": 3}},
                                  random_calibration(), execution=Execution())
        assert auto.manifest["transform"]["regime"] == "through-norm"
        with torch.no_grad():
            assert torch.isfinite(auto.model(IDS.to(DEVICE)).logits.cpu()).all()
        for refused in ({"sandwich_fold": "linearized-norm"}, {"estimator": "diagonal"}):
            model = tiny_model("gemma3_text").to(torch.float16).to(DEVICE)
            with pytest.raises(BlockfoldError, match="float16 cannot hold"):
                blockfold.compress(model, tiny_tokenizer(), {"blocks": 2, "span_start": 2, **refused},
                                   random_calibration())
