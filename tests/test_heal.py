"""Healing: only the intended weights move, the training loss falls, the result is a plain checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import handle_of, random_calibration, tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM

import blockfold
from blockfold.adapters import get_adapter
from blockfold.cli import main
from blockfold.errors import BlockfoldError
from blockfold.healing import folded_blocks, heal
from blockfold.recipe import HealConfig


def _compressed(recipe):
    model = tiny_model("llama")
    result = blockfold.compress(model, tiny_tokenizer(), recipe, calibration=random_calibration())
    return model, result.manifest


def test_folded_blocks_are_renumbered_after_removal():
    manifest = {"method": "replaceme", "removed_blocks": [1, 3, 4],
                "spans": [{"blocks": [1], "folded_into_block": 0, "transform": {"estimator": "lstsq"}},
                          {"blocks": [3, 4], "folded_into_block": 2, "transform": {"estimator": "lstsq"}}]}
    assert folded_blocks(manifest) == [0, 1]
    with pytest.raises(BlockfoldError, match="--mode lora"):
        folded_blocks({"method": "nbl", "replaced": {}})
    with pytest.raises(BlockfoldError, match="--mode lora"):
        folded_blocks(None)


def test_lt_healing_trains_only_the_folded_down_projection():
    model, manifest = _compressed({"blocks": 2, "span_start": 3})
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = HealConfig(mode="lt", steps=30, learning_rate=3e-3)
    healed = heal(model, random_calibration(num_sequences=4, seed=5), config, manifest)
    changed = {name for name, p in healed.named_parameters() if not torch.equal(p, before[name])}
    assert changed == {"model.layers.2.mlp.down_proj.weight"}
    record = manifest["healing"]
    assert record["blocks"] == [2] and record["trained_parameters"] == 32 * 64
    assert record["loss_last_steps"] < record["loss_first_steps"]


def test_lora_healing_merges_into_a_plain_model():
    model, manifest = _compressed({"blocks": 2})
    count = sum(p.numel() for p in model.parameters())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    healed = heal(model, random_calibration(num_sequences=4, seed=5), HealConfig(mode="lora", steps=20, learning_rate=3e-3),
                  manifest)
    assert type(healed).__name__ == "LlamaForCausalLM"
    assert not any("lora" in name for name, _ in healed.named_parameters())
    assert sum(p.numel() for p in healed.parameters()) == count
    assert not torch.equal(dict(healed.named_parameters())["model.layers.0.self_attn.q_proj.weight"],
                           before["model.layers.0.self_attn.q_proj.weight"])
    assert manifest["healing"]["loss_last_steps"] < manifest["healing"]["loss_first_steps"]
    assert set(manifest["healing"]["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_heal_cli_saves_a_checkpoint_plain_transformers_loads(tmp_path):
    model, manifest = _compressed({"blocks": 2})
    from blockfold.surgery import save_compressed

    source = save_compressed(handle_of(model, tiny_tokenizer()), tmp_path / "rm2", manifest, "method: replaceme\n")
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"text": " ".join(f"w{(i * k) % 90}" for i in range(80))}) for k in range(1, 12)))
    out = tmp_path / "healed"
    code = main(["heal", "--model", str(source), "--calib", str(data), "--out", str(out), "--steps", "3",
                 "--num-seqs", "4", "--seq-len", "32", "--batch-size", "2"])
    assert code == 0
    saved = json.loads((out / "blockfold_manifest.json").read_text())
    assert saved["healing"]["mode"] == "lt" and saved["removed_blocks"] == manifest["removed_blocks"]
    assert blockfold.Recipe.from_yaml(out / "blockfold_recipe.yaml").method == "replaceme"
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert get_adapter(reloaded).num_layers(reloaded) == 4
    assert main(["heal", "--model", str(source), "--calib", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("mode", ["lt", "lora"])
def test_healing_keeps_a_linearized_norm_fold(mode):
    """Gemma's linearized-norm fold keeps its map in a down-projection scaled by about 1e-6: healing
    moves it in that scale (lt) or leaves it out (lora), so the norm stays linear, and the loss falls."""
    model = tiny_model("gemma3_text")
    result = blockfold.compress(model, tiny_tokenizer(), {"blocks": 2, "span_start": 2, "sandwich_fold": "linearized-norm"},
                                calibration=random_calibration())
    manifest = result.manifest
    assert manifest["transform"]["regime"] == "linearized-norm"
    scale = manifest["transform"]["linearized_norm"]["down_proj_scale"]
    down_proj = get_adapter(model).down_proj(get_adapter(model).layers(model)[1]).weight
    before = down_proj.detach().clone()
    healed = heal(model, random_calibration(num_sequences=4, seed=5), HealConfig(mode=mode, steps=30, learning_rate=3e-3),
                  manifest)
    after = get_adapter(healed).down_proj(get_adapter(healed).layers(healed)[1]).weight
    assert float((after - before).abs().max()) <= 0.1 * float(before.abs().max()) + 1e-12, \
        "the folded map moved by a small fraction of its own size, not by the learning rate"
    assert float(before.abs().max()) < 1e3 * scale and float(after.abs().max()) < 1e3 * scale
    record = manifest["healing"]
    assert record["linearized_down_proj_blocks"]["blocks"] == [1]
    assert record["loss_last_steps"] < record["loss_first_steps"]


def _loss_fall(dtype: torch.dtype) -> tuple[float, dict]:
    """How much 20 lt steps at lr 1e-4 lower the training loss of one compressed model in ``dtype``
    (on the simulated accelerator, where it is a half precision)."""
    from simulated_device import DEVICE, simulated_accelerator

    model, manifest = _compressed({"blocks": 2, "span_start": 3})
    config = HealConfig(mode="lt", steps=20, learning_rate=1e-4)
    with simulated_accelerator():
        model = model.to(dtype).to(DEVICE) if dtype != torch.float32 else model
        heal(model, random_calibration(num_sequences=4, seed=5), config, manifest)
    record = manifest["healing"]
    return record["loss_first_steps"] - record["loss_last_steps"], record


@pytest.fixture(scope="module")
def float32_fall() -> float:
    return _loss_fall(torch.float32)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_healing_on_an_accelerator_lowers_the_loss_as_float32_does(dtype, float32_fall):
    """Float32 master weights (and, in float16, a dynamic loss scale): at lr 1e-4 the bfloat16 model's
    loss fell 5x less than float32's when AdamW stepped its weights directly, and float16 turned to
    NaN at the second step. Same steps and data: the fall within 20 % of float32's."""
    half, record = _loss_fall(dtype)
    assert float32_fall > 0 and 0.8 * float32_fall <= half <= 1.2 * float32_fall, (half, float32_fall)
    assert record["master_weights"] == "float32" and record["skipped_steps"] == 0
    assert (record["loss_scale"] is not None) == (dtype == torch.float16)


def test_healing_is_a_stage_of_compress_after_any_method(tmp_path, capsys):
    """compress --heal: the method, then the training, in one command; lt is refused where nothing was
    folded, and a run layer by layer refuses the stage before any pass, each in one line."""
    from conftest import tiny_folder_and_corpus

    folder, corpus = tiny_folder_and_corpus(tmp_path)
    common = ["compress", "--model", str(folder), "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "24",
              "--blocks", "2", "--set", "heal.data.num_sequences=4", "--set", "heal.data.sequence_length=24"]
    out = tmp_path / "healed"
    assert main([*common, "--method", "drop-block", "--heal", "lora", "--heal-steps", "2", "--out", str(out)]) == 0
    manifest = json.loads((out / "blockfold_manifest.json").read_text())
    assert manifest["method"] == "drop-block" and manifest["healing"]["mode"] == "lora"
    assert manifest["healing"]["steps"] == 2 and manifest["recipe"]["heal"]["data"]["source"] == str(corpus)
    assert "healed" in capsys.readouterr().out
    for flags, message in ((["--method", "sleb", "--heal", "lt"], "sleb folds none: use --heal lora"),
                           (["--heal", "lora", "--pipeline", "sequential"], "trains the whole model in memory")):
        assert main([*common, *flags, "--out", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("blockfold: error") == 1 and not (tmp_path / "refused").exists()
