"""The language model inside a multimodal checkpoint (issue #15, item 4): Gemma-3, LLaVA, Mistral-3,
SmolVLM and Idefics3 wrappers with tiny random weights, compressed in place through their text decoder. The checkpoint
loads with the multimodal class in a process without blockfold and gives the compressed model's
logits, its vision encoder and projector are the source's byte for byte, and the processor files
travel with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import COMMON, VOCAB, checkpoint_tensors, random_calibration, tiny_tokenizer
from transformers import AutoConfig, AutoModelForImageTextToText

import blockfold
from blockfold.adapters import get_adapter
from blockfold.cli import main
from blockfold.errors import BlockfoldError
from blockfold.recipe import Recipe

VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=14)
KINDS = ["gemma3", "llava", "mistral3", "smolvlm", "idefics3"]
PREPROCESSOR = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 28, "width": 28}}


def tiny_multimodal(kind: str, seed: int = 0):
    """A random-weight multimodal model whose text decoder has COMMON's shape (6 blocks) and norms with
    non-trivial scales."""
    torch.manual_seed(seed)
    if kind == "gemma3":
        config = AutoConfig.for_model("gemma3", text_config=dict(COMMON, model_type="gemma3_text", head_dim=8,
                                                                 sliding_window=16),
                                      vision_config=VISION, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                                      boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    elif kind == "llava":
        config = AutoConfig.for_model("llava", text_config=dict(COMMON, model_type="llama"),
                                      vision_config=dict(VISION, model_type="clip_vision_model", projection_dim=16),
                                      image_token_index=VOCAB - 1)
    elif kind == "mistral3":
        config = AutoConfig.for_model("mistral3", text_config=dict(COMMON, model_type="mistral"),
                                      vision_config=dict(VISION, model_type="pixtral", head_dim=8),
                                      image_token_index=VOCAB - 1)
    else:  # smolvlm, idefics3: the same layout
        config = AutoConfig.for_model(kind, text_config=dict(COMMON, model_type="llama"), vision_config=VISION,
                                      image_token_id=VOCAB - 1, scale_factor=1)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


def source_folder(kind: str, tmp_path):
    folder = tmp_path / f"source-{kind}"
    tiny_multimodal(kind).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return folder


def corpus_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    words = torch.randint(0, 90, (3000,), generator=torch.Generator().manual_seed(0))
    corpus.write_text(" ".join(f"w{int(w)}" for w in words))
    return corpus


def is_text(name: str) -> bool:
    return any(part in name for part in ("language_model", "text_model", "lm_head"))


RELOAD_SCRIPT = r"""
import json, sys, torch
sys.modules["blockfold"] = None  # blockfold must not be importable here
from transformers import AutoModelForImageTextToText
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    logits = model(input_ids=ids).logits
cached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
uncached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
assert torch.equal(cached, uncached), "the KV cache changed the greedy tokens"
print(json.dumps({"class": type(model).__name__, "layers": model.config.text_config.num_hidden_layers,
                  "logits": logits.tolist(), "tokens": cached.tolist()}))
"""


def reload_without_blockfold(folder, ids, tmp_path) -> dict:
    workdir = tmp_path / "elsewhere"
    workdir.mkdir(exist_ok=True)
    completed = subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, str(folder), json.dumps(ids)], cwd=workdir,
                               env=dict(os.environ), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_the_language_model_is_compressed_in_place_and_the_multimodal_class_reloads_it(kind, tmp_path):
    folder = source_folder(kind, tmp_path)
    result = blockfold.compress(str(folder), recipe=Recipe.parse({"method": "replaceme", "blocks": 2}),
                                calibration=random_calibration())
    out = result.save(tmp_path / "out")
    ids = [[5, 17, 33, 8, 61, 20, 9]]
    with torch.no_grad():
        expected = result.handle.model(input_ids=torch.tensor(ids)).logits

    assert result.manifest["architecture"]["multimodal"]["model_type"] == kind
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == kind and config["text_config"]["num_hidden_layers"] == 4
    reloaded = reload_without_blockfold(out, ids, tmp_path)
    assert reloaded["class"] == type(tiny_multimodal(kind)).__name__ and reloaded["layers"] == 4
    assert (torch.tensor(reloaded["logits"]) - expected).abs().max() <= 1e-4

    source, written = checkpoint_tensors(folder), checkpoint_tensors(out)
    vision = {name for name in source if not is_text(name)}
    assert vision and vision == {name for name in written if not is_text(name)}
    for name in vision:
        assert torch.equal(source[name], written[name]), f"{name} changed"
    assert json.loads((out / "preprocessor_config.json").read_text()) == PREPROCESSOR
    card = (out / "README.md").read_text()
    assert "AutoModelForImageTextToText.from_pretrained" in card and "vision encoder and projector" in card


def test_a_wrapper_built_in_memory_is_compressed_through_its_language_model():
    model = tiny_multimodal("llava")
    ids = torch.tensor([[5, 17, 33, 8, 61, 20, 9]])
    result = blockfold.compress(model, tiny_tokenizer(), Recipe.parse({"method": "replaceme", "blocks": 2}),
                                calibration=random_calibration())
    assert model.config.text_config.num_hidden_layers == 4 and len(model.model.language_model.layers) == 4
    assert result.handle.container is model
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, result.handle.model(input_ids=ids).logits)


def test_cli_streams_a_multimodal_checkpoint_layer_by_layer_to_the_same_tensors(capsys, tmp_path):
    folder, corpus = source_folder("gemma3", tmp_path), corpus_file(tmp_path)
    written = {}
    for pipeline in ("whole", "sequential"):
        out = tmp_path / pipeline
        code = main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(out), "--num-seqs", "8",
                     "--seq-len", "32", "--blocks", "2", "--pipeline", pipeline])
        assert code == 0, capsys.readouterr().err
        written[pipeline] = checkpoint_tensors(out)
    source = checkpoint_tensors(folder).keys()
    assert written["whole"].keys() == written["sequential"].keys() == source - {
        name for name in source if ".layers.4." in name or ".layers.5." in name}
    for name, tensor in written["whole"].items():
        assert torch.allclose(tensor, written["sequential"][name], rtol=1e-5, atol=1e-6), name


def test_cli_plans_a_multimodal_checkpoint_and_refuses_what_it_cannot_write(capsys, tmp_path):
    folder, corpus = source_folder("llava", tmp_path), corpus_file(tmp_path)
    assert main(["compress", "--model", str(folder), "--blocks", "2", "--calib", str(corpus), "--out",
                 str(tmp_path / "planned"), "--dry-run", "1GiB"]) == 0
    assert "llava" in capsys.readouterr().out

    out = tmp_path / "nbl"
    code = main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(out), "--num-seqs", "8",
                 "--seq-len", "32", "--method", "nbl", "--attn", "2"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("blockfold: error:")]
    assert code != 0 and len(errors) == 1 and "LlavaForConditionalGeneration" in errors[0], errors
    assert not out.exists()

    compressed = tmp_path / "out"
    assert main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(compressed), "--num-seqs",
                 "8", "--seq-len", "32", "--blocks", "2"]) == 0
    capsys.readouterr()
    code = main(["export", "--model", str(compressed), "--out", str(tmp_path / "out.gguf"), "--quant", "f16"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("blockfold: error:")]
    assert code != 0 and len(errors) == 1 and "mmproj" in errors[0], errors


def test_a_multimodal_model_whose_language_model_has_no_adapter_is_refused_by_name():
    config = AutoConfig.for_model("paligemma", text_config=dict(COMMON, model_type="gemma", head_dim=8),
                                  vision_config=dict(VISION, projection_dim=32))
    with pytest.raises(BlockfoldError, match="'gemma' \\(the language model of the multimodal 'paligemma'\\)"):
        get_adapter(config)
