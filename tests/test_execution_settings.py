"""Execution settings that used to be silently ignored: each one now acts or is refused in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import checkpoint_tensors, random_calibration, tiny_folder_and_corpus, tiny_model, tiny_tokenizer

import blockfold
from blockfold import pipelines
from blockfold.cli import main
from blockfold.errors import BlockfoldError
from blockfold.runtime import Execution


def _compress(execution: Execution, recipe=None):
    return blockfold.compress(tiny_model("llama"), tiny_tokenizer(), recipe or {"blocks": 2, "span_start": 2},
                              random_calibration(), execution=execution)


@pytest.mark.parametrize("free, expected", [(None, ["device"]), (1 << 40, ["device"]), (1 << 10, ["disk"])])
def test_offload_auto_decides_by_the_free_memory(monkeypatch, tmp_path, free, expected):
    """--offload auto keeps the refit's activations where they fit (the device, else disk on a CPU)
    and the result does not depend on where they waited."""
    monkeypatch.setattr(pipelines, "free_memory", lambda device: free)
    plain = _compress(Execution(offload="none"))
    auto = _compress(Execution(offload="auto", offload_dir=str(tmp_path)))
    assert auto.manifest["execution"]["activations_kept"] == expected
    for name, value in plain.model.state_dict().items():
        assert torch.equal(value, auto.model.state_dict()[name]), name
    assert not list(tmp_path.iterdir())  # spilled activations are removed


def test_offload_auto_on_an_accelerator_tries_cpu_memory_before_disk(monkeypatch):
    from conftest import handle_of

    handle = handle_of(tiny_model("llama"))
    handle.device = torch.device("cuda", 0)  # only read for the decision: nothing runs
    runner = pipelines.Runner(handle, Execution())
    batches = list(random_calibration())
    monkeypatch.setattr(pipelines, "free_memory", lambda device: 1 << 40 if device.type == "cpu" else 1 << 10)
    assert runner.store_kind(batches) == "cpu"
    monkeypatch.setattr(pipelines, "free_memory", lambda device: 1 << 10)
    assert runner.store_kind(batches) == "disk"
    assert runner.store_kind([]) == "device"


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_an_offload_folder_without_disk_offload_is_refused(tmp_path, capsys, offload):
    folder, corpus = tiny_folder_and_corpus(tmp_path)
    code = main(["compress", "--model", str(folder), "--calib", str(corpus), "--blocks", "2", "--out",
                 str(tmp_path / "out"), "--offload", offload, "--offload-dir", str(tmp_path)])
    error = capsys.readouterr().err
    assert code == 2 and "--offload-dir" in error and "--offload disk" in error and "Traceback" not in error
    assert not (tmp_path / "out").exists()


def test_the_api_saves_in_the_executions_save_dtype(tmp_path):
    result = _compress(Execution(save_dtype="bfloat16"))
    out = result.save(tmp_path / "out")
    assert {tensor.dtype for tensor in checkpoint_tensors(out).values()} == {torch.bfloat16}
    assert result.manifest["execution"]["dtype"] == "float32"
    assert {t.dtype for t in checkpoint_tensors(result.save(tmp_path / "f32", save_dtype="float32")).values()} \
        == {torch.float32}


def test_evaluate_refuses_an_unknown_task_data_source_and_defaults_as_the_cli():
    import inspect

    from blockfold.cli import build_parser

    with pytest.raises(BlockfoldError, match="task_data 'bundled'"):
        blockfold.evaluate("nowhere", tasks=["piqa"], task_data="bundled")
    parser = build_parser()
    cli_default = parser.parse_args(["eval", "--model", "m"]).task_data
    assert inspect.signature(blockfold.evaluate).parameters["task_data"].default == cli_default
