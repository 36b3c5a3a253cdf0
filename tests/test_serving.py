"""The parts of the engine checks that run without an engine (the engines run in bench/serving.py
and scripts/serve-check.sh, each in its own environment, too slow to build in CI)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer

from blockfold.errors import BlockfoldError
from blockfold.serving import RUNNERS, Agreement, engine_python, read_prompts, transformers_greedy

PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "vllm" / "blockfold_vllm"


def test_greedy_reference_is_transformers_generate_without_stopping():
    model = tiny_model("llama")
    prompts = [[5, 9, 11, 3], [7, 7, 8]]
    tokens, gaps = transformers_greedy(model, prompts, new_tokens=6)
    for prompt, continuation, margins in zip(prompts, tokens, gaps):
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                   pad_token_id=0, min_new_tokens=6)
        assert generated[0, len(prompt):].tolist() == continuation
        assert len(margins) == 6 and all(margin >= 0 for margin in margins)


def test_agreement_names_where_an_engine_parts():
    found = Agreement("llamacpp", [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]], 2, [[0.5] * 3, [0.2, 0.001, 0.3]])
    assert found.matching == 1 and not found.identical
    assert found.first_difference(0) is None and found.first_difference(1) == 1


def test_prompts_and_missing_engines_are_clear_errors(tmp_path, monkeypatch):
    texts = tmp_path / "prompts.txt"
    texts.write_text("w1 w2 w3 w4 w5\n\nw6 w7\n")
    decoded, ids = read_prompts(texts, tiny_tokenizer(), count=2, max_tokens=3)
    assert [len(one) for one in ids] == [3, 2]
    with pytest.raises(BlockfoldError, match="fewer than the 3 prompts"):
        read_prompts(texts, tiny_tokenizer(), count=3, max_tokens=3)
    with pytest.raises(BlockfoldError, match="--prompts FILE"):
        read_prompts(tmp_path / "absent.jsonl", tiny_tokenizer(), count=1, max_tokens=3)
    monkeypatch.setattr("blockfold.serving.ENGINES_DIR", tmp_path / "engines")
    with pytest.raises(BlockfoldError, match="serve-check.sh once"):
        engine_python("vllm")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_engine_runners_import_nothing_of_blockfold(runner):
    """They run in the engine's environment, which has no blockfold (nor its pins)."""
    allowed = set(sys.stdlib_module_names) | {"numpy", "llama_cpp", "vllm", "__future__"}
    assert _imports(RUNNERS[runner]) <= allowed


def test_vllm_plugin_needs_only_vllm_and_torch():
    allowed = set(sys.stdlib_module_names) | {"torch", "vllm", "blockfold_vllm", "__future__"}
    for path in PLUGIN.glob("*.py"):
        assert _imports(path) <= allowed, path.name
