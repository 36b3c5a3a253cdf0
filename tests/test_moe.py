"""Mixtures of experts (issue #15) on tiny random-weight models of Mixtral, OLMoE, Qwen2-MoE and
Qwen3-MoE: the fold into every expert is exact, removal keeps each layer's kind (sparse or dense) in
the config, checkpoints are written as save_pretrained writes them (one tensor per expert) and read
back layer by layer, and the outputs reload without blockfold and generate with a KV cache."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import (MOE_ARCHITECTURES, ExplicitTransform, generate_without_blockfold, handle_of, random_calibration,
                      tiny_model, tiny_tokenizer)
from safetensors import safe_open

import blockfold
from blockfold.adapters import get_adapter
from blockfold.models import load_model
from blockfold.stats import SpanStatistics
from blockfold.surgery import fold_into_mlp_output, remove_blocks

IDS = torch.randint(4, 96, (2, 20), generator=torch.Generator().manual_seed(7))


@pytest.fixture(params=MOE_ARCHITECTURES)
def moe_arch(request) -> str:
    return request.param


def _kinds(model) -> list[bool]:
    adapter = get_adapter(model)
    return [adapter.is_sparse(layer) for layer in adapter.layers(model)]


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("block", [1, 2])
def test_fold_into_every_expert_equals_the_explicit_map(moe_arch, block):
    model = tiny_model(moe_arch)
    adapter = get_adapter(model)
    torch.manual_seed(3)
    transform = torch.eye(32, dtype=torch.float64) + 0.2 * torch.randn(32, 32, dtype=torch.float64)
    span = [block + 1, block + 2]

    reference = copy.deepcopy(model)
    layer = adapter.layers(reference)[block]
    setattr(layer, adapter.mlp_attr, ExplicitTransform(adapter.mlp(layer), transform))
    remove_blocks(reference, adapter, span)

    fold_into_mlp_output(handle_of(model), adapter.layers(model)[block], transform)
    remove_blocks(model, adapter, span)

    difference = (_logits(model) - _logits(reference)).abs().max().item()
    assert difference <= 1e-4, f"{moe_arch}: folded vs explicit max abs diff {difference}"
    projections = adapter.mlp_output_projections(adapter.layers(model)[block])
    if adapter.is_sparse(adapter.layers(model)[block]):
        assert projections[0].module is adapter.mlp(adapter.layers(model)[block]).experts
        assert len(projections) == (2 if moe_arch == "qwen2_moe" else 1)  # the shared expert too


def test_the_tiny_models_mix_sparse_and_dense_layers_where_the_family_does():
    assert _kinds(tiny_model("mixtral")) == [True] * 6
    assert _kinds(tiny_model("qwen2_moe")) == [False, True, False, True, False, True]
    assert _kinds(tiny_model("qwen3_moe")) == [False, True, True, True, True, True]


def test_removal_keeps_every_kept_layers_kind_in_the_saved_config(tmp_path):
    model = tiny_model("qwen2_moe")  # dense 0, 2, 4 (by decoder_sparse_step 2 and mlp_only_layers)
    before = _kinds(model)
    remove_blocks(model, get_adapter(model), [1, 2])
    assert _kinds(model) == [before[i] for i in (0, 3, 4, 5)]
    model.save_pretrained(tmp_path / "out")
    reloaded = type(model).from_pretrained(tmp_path / "out").eval()
    assert _kinds(reloaded) == _kinds(model)
    assert reloaded.config.mlp_only_layers == [0, 2] and reloaded.config.decoder_sparse_step == 1
    assert torch.equal(_logits(reloaded), _logits(model))


def _source_folder(arch: str, tmp_path):
    folder = tmp_path / f"tiny-{arch}"
    tiny_model(arch).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _tensor_names(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


def test_layer_by_layer_reads_the_experts_as_save_pretrained_stored_them(moe_arch, tmp_path):
    folder = _source_folder(moe_arch, tmp_path)
    assert not any(name.endswith("experts.down_proj") for name in _tensor_names(folder)), "one tensor per expert"
    sums = {}
    for pipeline in ("whole", "sequential"):
        handle = load_model(str(folder), pipeline=pipeline)
        statistics = SpanStatistics(6, 2, 2)
        from blockfold.pipelines import Runner
        from blockfold.runtime import Execution

        Runner(handle, Execution(pipeline=pipeline)).run(random_calibration(), [statistics])
        sums[pipeline] = statistics.finalize().normal_equations
    for start, equations in sums["whole"].items():
        other = sums["sequential"][start]
        assert torch.allclose(equations.xtx, other.xtx, rtol=1e-10, atol=1e-10)
        assert torch.allclose(equations.xty, other.xty, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_cli_compresses_a_mixture_of_experts_end_to_end(capsys, arch, tmp_path):
    from blockfold.cli import main

    folder = _source_folder(arch, tmp_path)
    corpus = tmp_path / "corpus.txt"
    words = torch.randint(0, 90, (3000,), generator=torch.Generator().manual_seed(0))
    corpus.write_text(" ".join(f"w{int(w)}" for w in words))
    out = tmp_path / "out"
    code = main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(out), "--num-seqs", "8",
                 "--seq-len", "32", "--blocks", "2"])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((out / "blockfold_manifest.json").read_text())
    assert len(manifest["removed_blocks"]) == 2
    names = _tensor_names(out)
    assert names <= _tensor_names(folder), "written under the names save_pretrained uses"
    assert not any(name.endswith("experts.down_proj") for name in names)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 4

    # the same compression streamed layer by layer writes the same tensors
    streamed = tmp_path / "streamed"
    code = main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(streamed),
                 "--num-seqs", "8", "--seq-len", "32", "--blocks", "2", "--pipeline", "sequential"])
    assert code == 0, capsys.readouterr().err
    with safe_open(str(out / "model.safetensors"), "pt") as a, safe_open(str(streamed / "model.safetensors"), "pt") as b:
        for name in names:
            assert torch.allclose(a.get_tensor(name), b.get_tensor(name), rtol=1e-5, atol=1e-6), name

    ids = [[5, 17, 33, 8, 61, 20]]
    model = type(tiny_model(arch)).from_pretrained(out).eval()
    expected = model.generate(torch.tensor(ids), max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    assert generate_without_blockfold(out, ids, tmp_path) == expected.tolist()


def test_nbl_linearizes_a_mixtures_attention_and_reloads_without_blockfold(moe_arch, tmp_path):
    model = tiny_model(moe_arch)
    result = blockfold.compress(model, tiny_tokenizer(), {"method": "nbl", "attention_layers": 2}, calibration=random_calibration())
    out = result.save(tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == f"blockfold_{moe_arch}" and len(config["blockfold_linearized"]) == 2
    ids = [[5, 17, 33, 8, 61, 20]]
    expected = model.generate(torch.tensor(ids), max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    assert generate_without_blockfold(out, ids, tmp_path) == expected.tolist()


def test_the_dry_run_plan_counts_the_experts_a_token_runs(tmp_path):
    """The plan's forward work multiplies the parameters a token uses: 2 of Mixtral's 4 experts."""
    from blockfold.cli import main
    from blockfold.plan import _active_parameters

    model = tiny_model("mixtral")
    adapter = get_adapter(model)
    layers = adapter.layers(model)
    experts = sum(p.numel() for layer in layers for p in adapter.mlp(layer).experts.parameters())
    blocks = sum(p.numel() for layer in layers for p in layer.parameters())
    assert _active_parameters(adapter, layers, model.config) == blocks - experts / 2
    model.config.save_pretrained(tmp_path / "config")
    code = main(["compress", "--model", str(tmp_path / "config" / "config.json"), "--blocks", "2", "--calib",
                 "self", "--out", str(tmp_path / "out"), "--dry-run", "80GiB"])
    assert code == 0 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("pipeline", ["whole", "sequential"])
def test_a_checkpoint_missing_one_experts_tensor_is_one_clear_error(capsys, pipeline, tmp_path):
    from safetensors.torch import load_file, save_file

    from blockfold.cli import main

    folder = _source_folder("mixtral", tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.pop("model.layers.2.block_sparse_moe.experts.1.w2.weight")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{i % 90}" for i in range(2000)))
    code = main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(tmp_path / "out"),
                 "--num-seqs", "4", "--seq-len", "16", "--blocks", "2", "--pipeline", pipeline])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("blockfold: error:")]
    assert code != 0 and len(errors) == 1 and "incomplete" in errors[0], errors
    if pipeline == "sequential":
        assert "block_sparse_moe.experts.1.w2.weight" in errors[0]
    assert not (tmp_path / "out").exists()
