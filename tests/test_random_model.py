"""bench/random_model.py: random-weight stand-ins load with plain transformers and are reproducible."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from blockfold.models.checkpoint import CheckpointReader
from conftest import REPO, tiny_tokenizer

_spec = importlib.util.spec_from_file_location("random_model", REPO / "bench" / "random_model.py")
random_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(random_model)


def test_random_smollm2_width_model(tmp_path: Path):
    tokenizer_folder = tmp_path / "tokenizer"
    tiny_tokenizer().save_pretrained(tokenizer_folder)
    config, _ = random_model.preset_config("smollm2-width", layers=2)
    first, second = (random_model.build_random_model(tmp_path / name, config, torch.bfloat16, seed=3,
                                                     tokenizer_from=tokenizer_folder) for name in ("a", "b"))

    model = AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 576
    assert (model.config.bos_token_id, model.config.eos_token_id) == (1, 2)  # the tokenizer's, not the preset's
    assert (first / "tokenizer.json").is_file()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 40]])).logits
    assert torch.isfinite(logits).all()

    one, two = CheckpointReader(first), CheckpointReader(second)
    assert one.names() == two.names() and "lm_head.weight" not in one.names()  # tied to the embedding
    assert all(torch.equal(one.get(name), two.get(name)) for name in one.names())
    norm = one.get("model.layers.1.input_layernorm.weight").float()
    assert not torch.allclose(norm, torch.ones_like(norm)) and abs(norm.mean().item() - 1) < 0.01
    assert not torch.equal(norm, one.get("model.layers.0.input_layernorm.weight").float())
