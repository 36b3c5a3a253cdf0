"""Vision encoders (issue #15, item 3): ViT, CLIP's and SigLIP's vision towers with tiny random
weights, calibrated on a folder of synthetic images. The fold into ``fc2`` is exact, the checkpoint
is a standard one that plain transformers reloads, whole-model and layer-by-layer runs agree, and
the methods that need a language model are refused."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModel, ViTImageProcessorPil

import blockfold
from blockfold.adapters import get_adapter
from blockfold.cli import main
from blockfold.errors import BlockfoldError
from blockfold.recipe import CalibrationConfig, Recipe
from blockfold.surgery import remove_blocks
from blockfold.surgery.fold import fold_into_down_proj
from conftest import ExplicitTransform, checkpoint_tensors, handle_of

ENCODERS = ["vit", "clip_vision_model", "siglip_vision_model", "dinov2"]
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, image_size=28, patch_size=7)


def tiny_encoder(model_type: str, seed: int = 0):
    """A random-weight encoder (6 blocks, 16 patches of 7x7 per 28x28 image) whose LayerNorms (and
    DINOv2's layer scales) have non-trivial values, so folding errors would show."""
    torch.manual_seed(seed)
    model = AutoModel.from_config(AutoConfig.for_model(model_type, **SHAPE)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "lambda1" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def processor():
    return ViTImageProcessorPil(size={"height": 28, "width": 28})


def image_folder(path, count: int = 24, classes: int = 2):
    """``count`` synthetic images of different sizes in ``classes`` class subfolders."""
    rng = np.random.default_rng(0)
    for index in range(count):
        folder = path / f"class{index % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (30 + index % 7, 40 + index % 5, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{index}.png")
    return path


def source_folder(model_type: str, tmp_path):
    folder = tmp_path / model_type
    tiny_encoder(model_type).save_pretrained(folder)
    processor().save_pretrained(folder)
    return folder


def pixels(count: int = 4, seed: int = 5) -> torch.Tensor:
    return torch.randn(count, 3, 28, 28, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", ENCODERS)
def test_folded_encoder_matches_explicit_transform(model_type):
    model = tiny_encoder(model_type)
    adapter = get_adapter(model)
    torch.manual_seed(3)
    transform = torch.eye(32, dtype=torch.float64) + 0.2 * torch.randn(32, 32, dtype=torch.float64)
    start, span = 2, [2, 3]

    with torch.no_grad():
        original = model(pixel_values=pixels()).last_hidden_state
    adapter.prepare(handle_of(model))  # DINOv2: layer scales into the projections, exactly
    with torch.no_grad():
        assert (model(pixel_values=pixels()).last_hidden_state - original).abs().max() <= 1e-5
    reference = copy.deepcopy(model)
    mlp = adapter.mlp(adapter.layers(reference)[start - 1])
    mlp.fc2 = ExplicitTransform(mlp.fc2, transform)
    remove_blocks(reference, adapter, span)
    fold_into_down_proj(handle_of(model), adapter.down_proj(adapter.layers(model)[start - 1]), transform)
    remove_blocks(model, adapter, span)

    with torch.no_grad():
        diff = (model(pixel_values=pixels()).last_hidden_state
                - reference(pixel_values=pixels()).last_hidden_state).abs().max().item()
    assert diff <= 1e-4, f"{model_type}: folded vs explicit max abs diff {diff}"
    assert model.config.num_hidden_layers == 4 and len(adapter.layers(model)) == 4


RELOAD_SCRIPT = r"""
import json, sys, torch
sys.modules["blockfold"] = None  # blockfold must not be importable here
from transformers import AutoModel
model = AutoModel.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
pixels = torch.randn(4, 3, 28, 28, generator=torch.Generator().manual_seed(5))
with torch.no_grad():
    output = model(pixel_values=pixels).last_hidden_state
print(json.dumps({"class": type(model).__name__, "layers": model.config.num_hidden_layers, "output": output.tolist()}))
"""


@pytest.mark.parametrize("model_type", ENCODERS)
def test_compressed_encoder_is_a_standard_checkpoint_that_reloads_without_blockfold(model_type, tmp_path):
    folder, images = source_folder(model_type, tmp_path), image_folder(tmp_path / "images")
    recipe = Recipe.parse({"method": "replaceme", "blocks": 2,
                           "calibration": {"source": str(images), "num_sequences": 16, "batch_size": 8}})
    result = blockfold.compress(str(folder), recipe=recipe)
    out = result.save(tmp_path / "out")
    with torch.no_grad():
        expected = result.handle.model(pixel_values=pixels()).last_hidden_state
    assert result.manifest["calibration"]["images"] == 16

    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    completed = subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, str(out)], cwd=workdir, env=dict(os.environ),
                               stdin=subprocess.DEVNULL, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    reloaded = json.loads(completed.stdout.strip().splitlines()[-1])
    assert reloaded["class"] == type(tiny_encoder(model_type)).__name__ and reloaded["layers"] == 4
    assert (torch.tensor(reloaded["output"]) - expected).abs().max() <= 1e-4
    assert (out / "preprocessor_config.json").is_file()
    assert "AutoModel.from_pretrained" in (out / "README.md").read_text()


@pytest.mark.parametrize("model_type", ["vit", "dinov2"])
def test_cli_compresses_an_encoder_layer_by_layer_to_the_same_tensors(capsys, model_type, tmp_path):
    folder, images = source_folder(model_type, tmp_path), image_folder(tmp_path / "images")
    written = {}
    for pipeline in ("whole", "sequential"):
        out = tmp_path / pipeline
        code = main(["compress", "--model", str(folder), "--calib", str(images), "--out", str(out), "--num-seqs", "16",
                     "--blocks", "2", "--pipeline", pipeline])
        assert code == 0, capsys.readouterr().err
        written[pipeline] = checkpoint_tensors(out)
    assert written["whole"].keys() == written["sequential"].keys()
    assert len(written["whole"]) < len(checkpoint_tensors(folder))
    for name, tensor in written["whole"].items():
        assert torch.allclose(tensor, written["sequential"][name], rtol=1e-5, atol=1e-6), name


def test_methods_that_need_a_language_model_are_refused_on_an_encoder(capsys, tmp_path):
    folder, images = source_folder("clip_vision_model", tmp_path), image_folder(tmp_path / "images")
    for method in ("sleb", "nbl"):
        code = main(["compress", "--model", str(folder), "--calib", str(images), "--out", str(tmp_path / method),
                     "--method", method, "--blocks" if method == "sleb" else "--attn", "2"])
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("blockfold: error:")]
        assert code != 0 and len(errors) == 1 and "takes replaceme, uidl, drop-block" in errors[0], errors
        assert not (tmp_path / method).exists()


def test_image_calibration_names_a_folder_without_images(tmp_path):
    from blockfold.data.images import build_image_calibration

    (tmp_path / "notes.txt").write_text("no images here")
    model = tiny_encoder("vit")
    with pytest.raises(BlockfoldError, match="holds no image file"):
        build_image_calibration(CalibrationConfig(source=str(tmp_path)), processor(), get_adapter(model), model.config)


def test_eval_gives_embedding_agreement_and_knn_accuracy_of_an_encoder_and_its_source(capsys, tmp_path):
    folder, images = source_folder("vit", tmp_path), image_folder(tmp_path / "images")
    out = tmp_path / "out"
    assert main(["compress", "--model", str(folder), "--calib", str(images), "--out", str(out), "--num-seqs", "16",
                 "--blocks", "2"]) == 0
    capsys.readouterr()
    report = tmp_path / "eval.json"
    assert main(["eval", "--model", str(out), "--images", str(images), "--json", str(report)]) == 0
    assert "embedding cosine (model vs original)" in capsys.readouterr().out
    results = json.loads(report.read_text())
    agreement = results["embedding_agreement"]
    assert agreement["images"] == 24 and 0 < agreement["cosine_min"] <= agreement["cosine_mean"] < 1
    assert 0 <= results["model"]["images"]["knn_accuracy"] <= 1 and "knn_accuracy" in results["original"]["images"]

    assert main(["eval", "--model", str(folder), "--images", str(images), "--baseline", str(folder), "--json",
                 str(report)]) == 0
    assert json.loads(report.read_text())["embedding_agreement"]["cosine_min"] == pytest.approx(1.0, abs=1e-6)

    code = main(["eval", "--model", str(out), "--ppl", str(report)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("blockfold: error:")]
    assert code != 0 and len(errors) == 1 and "--images" in errors[0], errors


def test_knn_accuracy_counts_the_majority_of_the_nearest_others():
    from blockfold.eval.vision import knn_accuracy

    embeddings = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.95, 0.05], [0.0, 1.0], [0.1, 0.9], [0.05, 0.95]])
    assert knn_accuracy(embeddings, ["a", "a", "a", "b", "b", "b"], neighbours=2) == 1.0
    assert knn_accuracy(embeddings, ["a", "b", "c", "a", "b", "c"], neighbours=1) == 0.0  # mates differ
