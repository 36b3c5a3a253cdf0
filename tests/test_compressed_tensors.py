"""Compressing a checkpoint stored as compressed-tensors (W4A16, as llm-compressor writes GPTQ, AWQ or
round-to-nearest models): read as the float model its packed layers compute, every untouched quantized
layer written back byte for byte, an edited one quantized again in the source's scheme, new layers named in
the config's ``ignore`` list, and the result loading in plain transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import checkpoint_tensors, generate_without_blockfold, quantize_w4a16, tiny_model, tiny_tokenizer

pytest.importorskip("compressed_tensors")
from transformers import AutoModelForCausalLM  # noqa: E402

import blockfold  # noqa: E402
from blockfold.cli import main  # noqa: E402
from blockfold.models import load_model  # noqa: E402
from blockfold.models.checkpoint import CheckpointReader  # noqa: E402
from blockfold.models.compressed_tensors import CompressedTensorsReader  # noqa: E402
from blockfold.runtime import Execution  # noqa: E402

CALIBRATION = {"num_sequences": 8, "sequence_length": 24, "batch_size": 4}


@pytest.fixture(scope="module", params=[True, False], ids=["symmetric", "asymmetric"])
def w4a16(tmp_path_factory, request) -> Path:
    """A tiny random Llama (tied head) quantized to W4A16, symmetric or with zero points, groups of 16."""
    root = tmp_path_factory.mktemp("w4a16")
    tiny_model("llama", tied=True).save_pretrained(root / "float")
    tiny_tokenizer().save_pretrained(root / "float")
    return quantize_w4a16(root / "float", root / "w4a16", symmetric=request.param)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    generator = torch.Generator().manual_seed(0)
    path.write_text(" ".join(f"w{int(w)}" for w in torch.randint(0, 90, (3000,), generator=generator)))
    return path


def _compress(source: Path, out: Path, corpus: Path, method: str, settings: dict, pipeline: str = "whole"):
    recipe = {"method": method, "settings": settings, "calibration": {"source": str(corpus), **CALIBRATION}}
    result = blockfold.compress(str(source), recipe=recipe, execution=Execution(pipeline=pipeline))
    result.save(out)
    return result


def _source_name(name: str, removed: list[int], blocks: int) -> str:
    """The source checkpoint's name of a saved tensor (blocks renumbered past the removed ones)."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        parts[2] = str([index for index in range(blocks) if index not in removed][int(parts[2])])
    return ".".join(parts)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _symmetric(folder: Path) -> bool:
    config = json.loads((folder / "config.json").read_text())
    return config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"]


def _dequantized_by_hand(folder: Path, layer: str, group_size: int = 16) -> torch.Tensor:
    """A packed layer's weight unpacked here: (4-bit value - zero point) x scale, per group."""
    tensors = checkpoint_tensors(folder)
    rows, columns = tensors[f"{layer}.weight_shape"].tolist()
    values = _unpacked(tensors[f"{layer}.weight_packed"]).reshape(rows, -1)[:, :columns] - 8
    zero = (_unpacked(tensors[f"{layer}.weight_zero_point"].T).reshape(-1, rows).T - 8
            if f"{layer}.weight_zero_point" in tensors else torch.zeros(rows, columns // group_size))
    scale = tensors[f"{layer}.weight_scale"].double()
    return ((values - zero.repeat_interleave(group_size, dim=1)) * scale.repeat_interleave(group_size, dim=1))


def test_the_reader_gives_what_the_quantized_model_computes(w4a16):
    """blockfold's float view of a packed layer is its 4-bit values times their scales (unpacked here, zero
    points included), in both pipelines, with the packed tensors hidden; for a symmetric scheme the model
    computes exactly what transformers loading the folder with compressed-tensors computes. (transformers
    5.25 with compressed-tensors 0.19 does not load an asymmetric scheme, whose packed zero points it expects
    unpacked: such a source is compared with the unpacking alone.)"""
    streamed = load_model(str(w4a16), pipeline="sequential")
    assert not streamed.resident
    reader = streamed.store.reader
    assert not [name for name in reader.names() if "weight_packed" in name or "weight_scale" in name]
    for layer in ("model.layers.1.mlp.down_proj", "model.layers.4.self_attn.k_proj"):
        assert reader.is_quantized(f"{layer}.weight")
        torch.testing.assert_close(reader.get(f"{layer}.weight").double(), _dequantized_by_hand(w4a16, layer),
                                   rtol=1e-6, atol=1e-7)
    assert reader.shape("model.layers.1.mlp.down_proj.weight") == (32, 64)
    resident = load_model(str(w4a16))
    assert resident.resident and isinstance(resident.store.reader, CompressedTensorsReader)
    if not _symmetric(w4a16):
        return
    ids = torch.randint(0, 90, (2, 20), generator=torch.Generator().manual_seed(1))
    quantized = AutoModelForCausalLM.from_pretrained(w4a16).eval()
    with torch.no_grad():
        assert torch.equal(resident.model(ids).logits, quantized(ids).logits)


@pytest.mark.parametrize("pipeline", ["whole", "sequential"])
def test_replaceme_keeps_untouched_layers_and_quantizes_edited_ones_again(w4a16, corpus, tmp_path, pipeline):
    """Every quantized layer compression left alone holds its source's bytes; the ones it edited (the fold,
    the refit after the cut) hold the edited float64 weight quantized again by round to nearest (within
    half a step of their own scale); the config is the source's; transformers generates from the folder."""
    out = tmp_path / "out"
    result = _compress(w4a16, out, corpus, "replaceme", {"blocks": 2, "span_start": 2}, pipeline)
    removed = result.manifest["removed_blocks"]
    saved, source = checkpoint_tensors(out), checkpoint_tensors(w4a16)
    config, source_config = (json.loads((folder / "config.json").read_text()) for folder in (out, w4a16))
    assert config["quantization_config"] == source_config["quantization_config"]  # ignore: still the head alone
    packed = [name.removesuffix(".weight_packed") for name in saved if name.endswith(".weight_packed")]
    assert len(packed) == 7 * 4 and not [name for name in saved if name.endswith(".weight") and "proj" in name]
    edited = {name: module for name, module in result.handle.model.named_modules()
              if result.handle.store.edits.get(module, {}).get("weight")}
    assert f"model.layers.{removed[0] - 1}.mlp.down_proj" in edited
    for layer in packed:
        parts = [f"{layer}.{suffix}" for suffix in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
                 if f"{layer}.{suffix}" in saved]
        if layer not in edited:
            for part in parts:
                assert torch.equal(_raw(saved[part]), _raw(source[_source_name(part, removed, 6)])), part
            continue
        weight = result.handle.saved_value(edited[layer], "weight")
        reread = CompressedTensorsReader(out, config["quantization_config"]).get(f"{layer}.weight").double()
        step = saved[f"{layer}.weight_scale"].double().repeat_interleave(16, dim=1)
        assert ((reread - weight).abs() <= step / 2 * (1 + 1e-6) + 1e-7).all(), layer
        assert not torch.equal(saved[f"{layer}.weight_packed"], source[_source_name(f"{layer}.weight_packed", removed, 6)])
    if _symmetric(w4a16):  # transformers does not load asymmetric zero points (above)
        ids = [[5, 9, 12, 40, 7]]
        assert len(generate_without_blockfold(out, ids, tmp_path)[0]) == len(ids[0]) + 10


def test_nbl_names_its_linear_maps_in_the_ignore_list(w4a16, corpus, tmp_path):
    """NBL's maps exist in no scheme: stored in float and named in ``ignore``, so transformers (with the
    shipped modeling code) loads them as they are; every other quantized layer is its source's bytes and the
    saved model computes what blockfold's compressed model computed."""
    out = tmp_path / "nbl"
    result = _compress(w4a16, out, corpus, "nbl", {"attention_layers": 2})
    replaced = result.manifest["replaced"]["layers"]
    config = json.loads((out / "config.json").read_text())
    maps = [f"model.layers.{index}.self_attn.linear" for index in sorted(replaced)]
    assert config["quantization_config"]["ignore"] == [*maps, "lm_head"]
    saved, source = checkpoint_tensors(out), checkpoint_tensors(w4a16)
    assert all(f"{name}.weight" in saved and saved[f"{name}.weight"].is_floating_point() for name in maps)
    for name, tensor in saved.items():
        if name in source and not name.startswith(tuple(maps)):
            assert torch.equal(_raw(tensor), _raw(source[name])), name
    if not _symmetric(w4a16):  # transformers does not load asymmetric zero points (above)
        return
    ids = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(2))
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, result.handle.model(ids).logits, rtol=1e-4, atol=1e-4)
    assert len(generate_without_blockfold(out, ids.tolist(), tmp_path)[0]) == 12 + 10


def test_whole_and_sequential_save_the_same_bytes(w4a16, corpus, tmp_path):
    """The layer-by-layer run reads each packed layer when its block runs, and saves what the resident run saves."""
    for pipeline in ("whole", "sequential"):
        _compress(w4a16, tmp_path / pipeline, corpus, "replaceme", {"blocks": 2}, pipeline)
    whole, sequential = checkpoint_tensors(tmp_path / "whole"), checkpoint_tensors(tmp_path / "sequential")
    assert whole.keys() == sequential.keys()
    for name, tensor in whole.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(sequential[name], tensor, rtol=1e-5, atol=1e-6)
        elif "weight_packed" not in name:
            assert torch.equal(sequential[name], tensor), name
        else:  # an edited weight re-rounded: ties at a half step may fall either way
            assert (_unpacked(sequential[name]) != _unpacked(tensor)).float().mean() < 1e-3, name


def _unpacked(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of a packed int32 tensor, eight per word."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF


def _edit_config(folder: Path, out: Path, change) -> Path:
    """A copy of ``folder`` whose config.json ``change`` edited (the weights linked, not copied)."""
    out.mkdir()
    for path in folder.iterdir():
        (out / path.name).symlink_to(path)
    (out / "config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    change(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("change, message", [
    (lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
     "quantizes activations too"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}), "is sparse"),
    (lambda q: q["config_groups"]["group_0"].update(format="naive-quantized"), "is stored as naive-quantized"),
    (lambda q: q.update(quant_method="gptq"), "AutoGPTQ/AutoAWQ layout"),
], ids=["activations", "sparse", "naive", "autogptq"])
def test_checkpoints_blockfold_cannot_compress_faithfully_are_refused(w4a16, corpus, tmp_path, capsys, change, message):
    """One line naming the problem and the way out, and no output folder."""
    source = _edit_config(w4a16, tmp_path / "edited", change)
    code = main(["compress", "--model", str(source), "--out", str(tmp_path / "out"), "--blocks", "1",
                 "--calib", str(corpus), "--num-seqs", "4", "--seq-len", "24"])
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("blockfold: error")]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in stderr, stderr
    assert not (tmp_path / "out").exists()


def test_activation_order_indices_of_older_versions_are_refused(w4a16, tmp_path):
    """A ``weight_g_idx`` tensor (older compressed-tensors) would be ignored by today's unpacker: refused."""
    from safetensors.torch import save_file

    tensors = checkpoint_tensors(w4a16)
    tensors["model.layers.0.mlp.down_proj.weight_g_idx"] = torch.arange(64, dtype=torch.int32) // 16
    folder = tmp_path / "gidx"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((w4a16 / "config.json").read_text())
    with pytest.raises(blockfold.BlockfoldError, match="weight_g_idx"):
        CompressedTensorsReader(folder, config["quantization_config"])


def test_requantized_layout_is_what_requantizing_writes(w4a16):
    """The shard plan (from a meta tensor) names the shapes and dtypes the real re-quantization writes."""
    config = json.loads((w4a16 / "config.json").read_text())
    reader = CompressedTensorsReader(w4a16, config["quantization_config"])
    name = "model.layers.3.mlp.down_proj.weight"
    weight = reader.get(name).double() * 1.1
    planned = reader.requantize(name, torch.empty(weight.shape, device="meta"))
    written = reader.requantize(name, weight)
    assert {key: (tuple(t.shape), t.dtype) for key, t in planned.items()} == \
           {key: (tuple(t.shape), t.dtype) for key, t in written.items()}
    assert set(written) == {part.rsplit(".", 1)[1] for part in reader.stored_tensors(name)}
    assert CheckpointReader(w4a16).dtype(name.replace("weight", "weight_scale")) == written["weight_scale"].dtype


def test_the_summary_and_manifest_say_how_the_quantized_layers_were_saved(w4a16, corpus, tmp_path, capsys):
    """``compress`` ends by saying how many quantized layers were kept as stored and how many quantized
    again, and the manifest and model card record it."""
    out = tmp_path / "out"
    code = main(["compress", "--model", str(w4a16), "--out", str(out), "--blocks", "2", "--set", "span_start=2",
                 "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "24", "--batch-size", "4"])
    assert code == 0
    saved = [line for line in capsys.readouterr().out.splitlines() if line.startswith("saved")]
    manifest = json.loads((out / "blockfold_manifest.json").read_text())["quantization"]
    assert manifest["as_stored"] + manifest["quantized_again"] == 7 * 4 and manifest["quantized_again"] >= 1
    assert manifest["in_float"] == ["lm_head"]
    assert f"{manifest['as_stored']} layers as stored, {manifest['quantized_again']} quantized again, 1 in float" in saved[0]
    assert "compressed-tensors" in (out / "README.md").read_text()


def test_a_packed_model_in_memory_is_refused_with_the_folder_as_the_way_out(w4a16):
    """transformers keeps a compressed-tensors model's layers packed (no ``weight``): compressing that object
    would fail deep inside a method, so it is refused at once, pointing at the folder. (An asymmetric scheme
    does not load at all: transformers 5.25 with compressed-tensors 0.19 expects its zero points unpacked,
    the upstream defect docs/quantized.md names; this fails once that is fixed, so the docs get updated.)"""
    if not _symmetric(w4a16):
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            AutoModelForCausalLM.from_pretrained(w4a16)
        return
    packed = AutoModelForCausalLM.from_pretrained(w4a16)
    with pytest.raises(blockfold.BlockfoldError, match="pass its folder"):
        blockfold.compress(packed, tiny_tokenizer(), {"method": "uidl", "settings": {"blocks": 1}})


def test_a_float_save_dtype_keeps_the_edited_layers_in_float(w4a16, corpus, tmp_path):
    """``--save-dtype float32`` (any explicit dtype): the layers compression edited are stored in that dtype and
    named in ``ignore``, equal to the edited weights; the untouched ones are still the source's bytes."""
    result = _compress(w4a16, tmp_path / "requantized", corpus, "replaceme", {"blocks": 2, "span_start": 2})
    out = result.save(tmp_path / "float-edits", save_dtype="float32")
    saved, source = checkpoint_tensors(out), checkpoint_tensors(w4a16)
    removed = result.manifest["removed_blocks"]
    edited = sorted(name for name, module in result.handle.model.named_modules()
                    if result.handle.store.edits.get(module, {}).get("weight"))
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted(config["ignore"]) == sorted([*edited, "lm_head"])
    modules = dict(result.handle.model.named_modules())
    for layer in edited:
        assert f"{layer}.weight_packed" not in saved
        torch.testing.assert_close(saved[f"{layer}.weight"].double(), result.handle.saved_value(modules[layer], "weight"),
                                   rtol=1e-6, atol=1e-7)
    for name in (name for name in saved if name.endswith("weight_packed")):
        assert torch.equal(_raw(saved[name]), _raw(source[_source_name(name, removed, 6)])), name
    if _symmetric(w4a16):  # transformers does not load asymmetric zero points (above)
        assert len(generate_without_blockfold(out, [[5, 9, 12, 40, 7]], tmp_path)[0]) == 15
