"""Image-text dual encoders (issue #45 item 1): the vision tower of a whole ``CLIPModel`` / ``SiglipModel``
compressed in place, the checkpoint the same class loads (text tower untouched, text tokenizer beside it),
and zero-shot classification as an evaluation. Tiny random weights and synthetic images test the
mechanics; ``bench/vision.py --model FOLDER`` runs a real CLIP where one is available."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import checkpoint_tensors, tiny_tokenizer
from test_vision import image_folder, processor
from transformers import AutoModel, CLIPConfig, CLIPModel, SiglipConfig, SiglipModel

from blockfold.cli import main
from blockfold.surgery.save import RECIPE_NAME

TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4)
DUAL_ENCODERS = {
    "clip": lambda: CLIPModel(CLIPConfig(text_config=dict(**TOWER, vocab_size=96, max_position_embeddings=16,
                                                          bos_token_id=1, eos_token_id=2, pad_token_id=0),
                                         vision_config=dict(**TOWER, image_size=28, patch_size=7), projection_dim=16)),
    "siglip": lambda: SiglipModel(SiglipConfig(text_config=dict(**TOWER, vocab_size=96, max_position_embeddings=16,
                                                                pad_token_id=0, eos_token_id=2),
                                               vision_config=dict(**TOWER, image_size=28, patch_size=7))),
}


def dual_encoder_folder(kind: str, tmp_path):
    """A random-weight dual encoder saved with its image processor and a word-level text tokenizer."""
    torch.manual_seed(0)
    model = DUAL_ENCODERS[kind]().eval()
    folder = tmp_path / kind
    model.save_pretrained(folder)
    processor().save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.model_max_length = 16
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", sorted(DUAL_ENCODERS))
def test_vision_tower_compresses_in_place_and_the_class_reloads_without_blockfold(kind, tmp_path):
    """Whole, layer by layer, and replayed from the saved recipe file: the same tensors."""
    folder = dual_encoder_folder(kind, tmp_path)
    images = image_folder(tmp_path / "images")
    outs = {mode: tmp_path / f"out-{mode}" for mode in ("whole", "sequential", "recipe")}
    for pipeline in ("whole", "sequential"):
        assert main(["compress", "--model", str(folder), "--calib", str(images), "--blocks", "2", "--pipeline",
                     pipeline, "--out", str(outs[pipeline])]) == 0
    assert main(["compress", "--model", str(folder), "--recipe", str(outs["whole"] / RECIPE_NAME),
                 "--out", str(outs["recipe"])]) == 0
    whole = checkpoint_tensors(outs["whole"])
    for mode in ("sequential", "recipe"):
        other = checkpoint_tensors(outs[mode])
        assert whole.keys() == other.keys()
        assert all(torch.allclose(whole[name], other[name], atol=1e-5) for name in whole), mode
    source = checkpoint_tensors(folder)
    text = [name for name in source if name.startswith("text_model.") or name.startswith("text_projection")]
    assert text and all(torch.equal(whole[name], source[name]) for name in text)  # the text tower as it was
    assert not [name for name in whole if name.startswith("vision_model.encoder.layers.4.")]
    script = ("import sys; from transformers import AutoModel, AutoTokenizer, AutoImageProcessor; "
              "m = AutoModel.from_pretrained(sys.argv[1]); AutoTokenizer.from_pretrained(sys.argv[1]); "
              "AutoImageProcessor.from_pretrained(sys.argv[1]); "
              "print(type(m).__name__, m.config.vision_config.num_hidden_layers, m.config.text_config.num_hidden_layers, "
              "'blockfold' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", script, str(outs["whole"])], capture_output=True, text=True, check=True)
    assert shown.stdout.split() == [type(DUAL_ENCODERS[kind]()).__name__, "4", "6", "False"]


@pytest.mark.parametrize("kind", sorted(DUAL_ENCODERS))
def test_eval_gives_zero_shot_accuracy_of_the_model_and_its_source(capsys, kind, tmp_path):
    folder = dual_encoder_folder(kind, tmp_path)
    images = image_folder(tmp_path / "images", count=24, classes=3)
    for index, label in enumerate(sorted(p.name for p in images.iterdir())):  # class names the tokenizer knows
        (images / label).rename(images / f"w{10 + index}")
    (images / "class_names.json").write_text(json.dumps({"w10": "w20 w21", "w11": "w22", "w12": "w23"}))
    out = tmp_path / "out"
    assert main(["compress", "--model", str(folder), "--calib", str(images), "--blocks", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    report = tmp_path / "eval.json"
    assert main(["eval", "--model", str(out), "--zero-shot", str(images), "--images", str(images),
                 "--json", str(report)]) == 0
    shown = capsys.readouterr().out
    assert "original: zero-shot" in shown and "model: zero-shot" in shown
    results = json.loads(report.read_text())
    for role in ("original", "model"):
        found = results[role]["zero_shot"]
        assert found["images"] == 24 and found["classes"] == 3 and 0 <= found["top1"] <= found["top5"] == 1.0
    assert 0 < results["embedding_agreement"]["cosine_mean"] <= 1


def test_zero_shot_on_an_encoder_without_a_text_tower_says_what_to_use(capsys, tmp_path):
    from test_vision import source_folder

    folder = source_folder("vit", tmp_path)
    images = image_folder(tmp_path / "images")
    assert main(["eval", "--model", str(folder), "--zero-shot", str(images), "--baseline", "none"]) == 2
    assert "--zero-shot is for image-text dual encoders" in capsys.readouterr().err


@pytest.mark.parametrize("kind", sorted(DUAL_ENCODERS))
def test_the_dual_encoders_pooled_tower_output_is_what_get_image_features_projects(kind):
    """The view blockfold compresses is the wrapper's own tower, and zero-shot derives the image embedding
    from its pooled output (projected by CLIP, SigLIP's head as it is): get_image_features' own value."""
    from blockfold.models.multimodal import compressed_view

    model = DUAL_ENCODERS[kind]().eval()
    view = compressed_view(model)
    projection = getattr(model, "visual_projection", torch.nn.Identity())
    pixels = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        assert torch.allclose(projection(view(pixel_values=pixels).pooler_output),
                              model.get_image_features(pixel_values=pixels).pooler_output)
    assert view.config is model.config.vision_config and isinstance(model, type(AutoModel.from_config(model.config)))


def test_sweep_of_a_dual_encoder_measures_images_and_reports_them(capsys, tmp_path):
    """An encoder's sweep: embedding agreement, k-NN and zero-shot accuracy per run, in sweep.json and the report."""
    folder = dual_encoder_folder("clip", tmp_path)
    images = image_folder(tmp_path / "images", count=24, classes=3)
    for index, label in enumerate(sorted(p.name for p in images.iterdir())):
        (images / label).rename(images / f"w{10 + index}")
    out = tmp_path / "sweep"
    assert main(["sweep", "--model", str(folder), "--out", str(out), "--methods", "replaceme,uidl", "--budgets", "2",
                 "--calib", str(images), "--num-seqs", "24", "--images", str(images)]) == 0
    shown = capsys.readouterr().out
    assert "embedding cosine" in shown and "export" not in shown
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["kind"] == "encoder" and len(sweep["runs"]) == 2 and "analysis" not in sweep
    assert sweep["original"]["zero_shot"]["classes"] == 3 and "knn_accuracy" in sweep["original"]["images"]
    for run in sweep["runs"]:
        assert 0 < run["embedding_agreement"]["cosine_mean"] <= 1 and "top1" in run["zero_shot"]
        assert run["speed"]["images"] == 8 and "decode_speed" not in run
    report = (out / "report.md").read_text()
    assert "zero-shot top-1 / top-5" in report and "embedding cosine to the original" in report
    assert (out / "report.html").is_file()
    assert main(["sweep", "--model", str(folder), "--out", str(tmp_path / "bad"), "--budgets", "1",
                 "--calib", str(images), "--tasks", "piqa", "--images", str(images)]) == 2
    assert "its sweep is measured on images" in capsys.readouterr().err


def test_gguf_export_of_an_image_encoder_says_how_to_serve_it(capsys, tmp_path):
    folder = dual_encoder_folder("clip", tmp_path)
    assert main(["export", "--model", str(folder), "--out", str(tmp_path / "clip.gguf")]) == 2
    assert "is an image encoder ('clip')" in capsys.readouterr().err and not (tmp_path / "clip.gguf").exists()
