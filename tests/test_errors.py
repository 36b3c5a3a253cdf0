"""Failures users hit on real hardware end in one line naming the fix, not a traceback."""

from __future__ import annotations

import pytest
import torch
from conftest import random_calibration, tiny_folder_and_corpus, tiny_model, tiny_tokenizer

import blockfold
from blockfold import methods
from blockfold.cli import main
from blockfold.errors import BlockfoldError, out_of_memory


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't "
                                                "allocate memory: you tried to allocate 85899345920 bytes")])
def test_out_of_memory_is_one_line_naming_the_flags_that_lower_memory(tmp_path, capsys, monkeypatch, error):
    def exhausted(job):
        raise error

    monkeypatch.setitem(methods.METHODS, "replaceme", exhausted)
    folder, corpus = tiny_folder_and_corpus(tmp_path)
    code = main(["compress", "--model", str(folder), "--calib", str(corpus), "--blocks", "2", "--num-seqs", "4",
                 "--seq-len", "16", "--out", str(tmp_path / "out")])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.startswith("blockfold: error")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr
    for flag in ("--pipeline sequential", "--chunk-sequences", "--stats-memory", "--offload"):
        assert flag in lines[0]
    with pytest.raises(BlockfoldError, match="out of memory"):
        blockfold.compress(tiny_model("llama"), tiny_tokenizer(), {"blocks": 2}, random_calibration())
    assert not (tmp_path / "out").exists()


def test_other_runtime_errors_are_not_taken_for_out_of_memory():
    assert out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert out_of_memory(ValueError("can't allocate memory")) is None
