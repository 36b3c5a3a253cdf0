"""The same command gives the same output in every process: MKL's first-call kernel race is settled
before any model runs (pytorch/pytorch#188792, docs/scale-out.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import blockfold.api
import blockfold.models.sources
import blockfold.pipelines
import blockfold.runtime
from conftest import random_calibration, tiny_model

# A fresh process's first cosine of a rotary embedding's angles, checked against its second.
FIRST_COSINE = """
import torch
{settle}
angles = torch.arange(512).float()[:, None] * (1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
angles = torch.cat((angles, angles), -1)
print(int(torch.equal(angles.cos(), angles.cos())))
"""


def test_every_entry_that_runs_a_model_settles_vector_math_first(monkeypatch, tmp_path):
    calls = []
    for module in (blockfold.runtime, blockfold.pipelines):
        monkeypatch.setattr(module, "settle_vector_math", lambda: calls.append("settled"))
    model = tiny_model("llama")
    handle = blockfold.api.as_handle(model, None, None)
    assert calls == ["settled"], "a model given in memory"
    blockfold.pipelines.Runner(handle)
    assert len(calls) == 2, "a pass"
    model.save_pretrained(tmp_path / "m")
    blockfold.models.sources.load_model(str(tmp_path / "m"), with_tokenizer=False)
    assert len(calls) == 3, "a model loaded from a folder"


def test_settling_leaves_results_unchanged():
    model = tiny_model("llama")
    batch = next(iter(random_calibration()))
    with torch.no_grad():
        before = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        blockfold.runtime.settle_vector_math()
        after = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.equal(before, after)


@pytest.mark.slow  # sixteen fresh interpreters one after another, about a minute on 2 cores
def test_a_fresh_process_first_cosine_equals_its_second_after_settling():
    """Without settling, about one process in five on this 2-core Xeon computed half of its first
    cosines with a low-accuracy kernel (errors up to 1.5e-4); the race needs a fresh process, one at
    a time, on at least two threads."""
    settle = "from blockfold.runtime import settle_vector_math; settle_vector_math()"
    results = [subprocess.run([sys.executable, "-c", FIRST_COSINE.format(settle=settle)], capture_output=True,
                              text=True, check=True).stdout.strip() for _ in range(16)]
    assert results == ["1"] * 16, f"{results.count('0')} of 16 processes computed their first cosines differently"
