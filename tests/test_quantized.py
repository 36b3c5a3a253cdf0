"""Compressing a checkpoint that is already quantized by bitsandbytes (4-bit NF4), as users run it:
statistics from the 4-bit model, the fold on the dequantized weight, every untouched 4-bit weight and
its quantization state written back byte for byte, and the result loading in plain transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import COMMON, generate_without_blockfold, random_calibration, tiny_model, tiny_tokenizer
from safetensors import safe_open
from torch import nn

pytest.importorskip("bitsandbytes")
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig  # noqa: E402

import blockfold  # noqa: E402
from blockfold.adapters import Projection  # noqa: E402
from blockfold.cli import main  # noqa: E402
from blockfold.errors import BlockfoldError  # noqa: E402
from blockfold.export import export_gguf  # noqa: E402
from blockfold.models import load_model  # noqa: E402
from blockfold.models.quantized import check_quantized_source, dequantized_weight, is_quantized_linear  # noqa: E402
from blockfold.surgery.fold import fold_into_projection  # noqa: E402


@pytest.fixture(scope="module", params=[("nf4", False), ("fp4", True)], ids=["nf4", "fp4-double-quant"])
def nf4_folder(tmp_path_factory, request) -> Path:
    """A tiny random llama quantized to 4 bits by transformers on load and saved with save_pretrained: NF4, and
    FP4 with double quantization (its absmax quantized too, so more state tensors travel with each weight)."""
    kind, double = request.param
    root = tmp_path_factory.mktemp(kind)
    _wide_tiny_llama().save_pretrained(root / "float")
    quantized = AutoModelForCausalLM.from_pretrained(
        root / "float", device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind,
                                               bnb_4bit_use_double_quant=double,
                                               bnb_4bit_compute_dtype=torch.float32))
    quantized.save_pretrained(root / "nf4")
    tiny_tokenizer().save_pretrained(root / "nf4")
    return root / "nf4"


def _wide_tiny_llama():
    """The tiny llama with every layer's input at least 64 wide, bitsandbytes' quantization block: on a
    CPU with AVX512-BF16 bitsandbytes repacks each 4-bit weight at its first forward without gradients
    (generation), and its repacking fails on a narrower input."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "hidden_size": 64, "intermediate_size": 128},
                                                         tie_word_embeddings=False), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def test_fold_into_a_4bit_projection_is_the_map_after_it(nf4_folder):
    """The folded layer computes exactly what the 4-bit layer followed by the map computed."""
    handle = load_model(str(nf4_folder))
    down = handle.adapter.down_proj(handle.layers()[2])
    assert is_quantized_linear(down)
    inputs = torch.randn(5, down.in_features)
    before = down(inputs).double()
    weight = dequantized_weight(down).double()
    transform = torch.eye(down.out_features, dtype=torch.float64) + 0.1 * torch.randn(down.out_features,
                                                                                      down.out_features,
                                                                                      dtype=torch.float64)
    fold_into_projection(handle, Projection(down), transform)
    assert type(down) is nn.Linear and handle.adapter.down_proj(handle.layers()[2]) is down
    torch.testing.assert_close(down.weight.double(), transform.T @ weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(down(inputs).double(), before @ transform, rtol=1e-4, atol=1e-4)
    assert is_quantized_linear(handle.adapter.down_proj(handle.layers()[1]))  # the others stay 4-bit


def test_a_4bit_model_already_repacked_for_bitsandbytes_cpu_kernel_is_refused(nf4_folder):
    """What bitsandbytes does at the first forward on a CPU with AVX512-BF16, done here on any CPU."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    model = AutoModelForCausalLM.from_pretrained(nf4_folder, device_map="cpu")
    down = model.model.layers[2].mlp.down_proj
    down.weight.data, down.weight.quant_state = _convert_weight_packed_for_cpu(down.weight.data, down.weight.quant_state)
    with pytest.raises(BlockfoldError, match="repacks its weights"):
        blockfold.compress(model, tiny_tokenizer(), {"method": "replaceme", "blocks": 2}, calibration=random_calibration())


def test_compressed_4bit_checkpoint_keeps_untouched_weights_and_reloads(nf4_folder, tmp_path):
    result = blockfold.compress(str(nf4_folder), None, {"method": "replaceme", "blocks": 2},
                                calibration=random_calibration())
    removed = result.manifest["removed_blocks"]
    folded = result.manifest["spans"][0]["folded_into_block"]
    ids = [[5, 9, 14, 3, 22, 41]]
    expected = result.model(torch.tensor(ids)).logits
    out = result.save(tmp_path / "rm2")
    # saving reads the 4-bit weights without moving them (bitsandbytes moves a weight's state with it, in place)
    torch.testing.assert_close(result.model(torch.tensor(ids)).logits, expected, rtol=0, atol=0)

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "bitsandbytes" and config["load_in_4bit"]
    assert config["llm_int8_skip_modules"] == ["lm_head", f"model.layers.{folded}.mlp.down_proj"]
    source, saved = _tensors(nf4_folder), _tensors(out)
    kept = [index for index in range(6) if index not in removed]
    for name, tensor in saved.items():
        if not name.startswith("model.layers."):
            assert torch.equal(tensor, source[name]), name
            continue
        index, rest = name.split(".", 3)[2:]
        original = f"model.layers.{kept[int(index)]}.{rest}"
        if name.startswith(f"model.layers.{folded}.mlp.down_proj."):
            assert name.endswith(".weight") and tensor.dtype == torch.float32  # the fold, unquantized
            assert original + ".absmax" in source
        else:  # packed weights, their absmax, quant map and state: byte for byte
            assert torch.equal(tensor, source[original]), name

    reloaded = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    layers = reloaded.model.layers
    assert type(layers[folded].mlp.down_proj) is nn.Linear
    assert all(is_quantized_linear(layer.mlp.down_proj) for i, layer in enumerate(layers) if i != folded)
    torch.testing.assert_close(reloaded(torch.tensor(ids)).logits, expected, rtol=1e-5, atol=1e-5)
    greedy = reloaded.generate(torch.tensor(ids), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert generate_without_blockfold(out, ids, tmp_path) == greedy.tolist()
    assert f"bitsandbytes {config['bnb_4bit_quant_type']}" in (out / "README.md").read_text()  # the card says so
    with pytest.raises(BlockfoldError, match="quantized transformers checkpoint"):
        export_gguf(out, tmp_path / "rm2.gguf")


def test_quantized_checkpoints_blockfold_cannot_compress_are_refused(nf4_folder, tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["compress", "--model", str(nf4_folder), "--blocks", "1", "--pipeline", "sequential",
                 "--calib", "self", "--num-seqs", "2", "--seq-len", "8", "--out", str(out)]) == 2
    assert "--pipeline whole" in capsys.readouterr().err and not out.exists()
    config = json.loads((nf4_folder / "config.json").read_text())
    for quantization, named in (({"quant_method": "gptq", "bits": 4}, "gptq"),
                                ({**config["quantization_config"], "load_in_8bit": True, "load_in_4bit": False},
                                 "(8-bit)")):
        with pytest.raises(BlockfoldError, match=named):
            check_quantized_source(type("Config", (), {"quantization_config": quantization})(), "whole")


def test_an_owned_weight_edited_in_place_is_saved_with_the_edit_once():
    """The resident copy of an owned weight is not its master: an edit applied to the copy at once and to the
    master on saving would otherwise reach the master twice (float32 on the CPU, where ``to`` would not copy)."""
    from conftest import handle_of

    handle = handle_of(tiny_model("llama"))
    down = handle.adapter.down_proj(handle.layers()[0])
    value = torch.randn_like(down.weight)
    handle.own(down, "weight", value)
    handle.transform(down, "weight", lambda weight: 2 * weight)
    torch.testing.assert_close(handle.saved_value(down, "weight").float(), 2 * value)
    torch.testing.assert_close(down.weight, 2 * value)
