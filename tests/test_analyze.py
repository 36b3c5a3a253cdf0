"""blockfold analyze: one pass, JSON and figures whose numbers agree with the tables."""

from __future__ import annotations

import json

import numpy as np
import torch
from conftest import silence_blocks, tiny_model, tiny_tokenizer

from blockfold.cli import main
from blockfold.stats.similarity import pairwise_linear_cka


def test_pairwise_cka_is_one_on_the_diagonal_and_invariant_to_rotation_and_scale():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, 16, generator=generator)
    rotation, _ = torch.linalg.qr(torch.randn(16, 16, generator=generator))
    cka = pairwise_linear_cka([x, 3 * x @ rotation, torch.randn(200, 16, generator=generator)])
    assert torch.allclose(cka.diagonal(), torch.ones(3, dtype=torch.float64))
    assert cka[0, 1] > 0.999 and cka[0, 2] < 0.2


def test_analyze_cli_writes_json_and_figures(tmp_path, capsys):
    folder = tmp_path / "tiny"
    model = tiny_model("llama")
    silence_blocks(model, [3])
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{(i * 7) % 90}" for i in range(3000)))
    out = tmp_path / "analysis"
    assert main(["analyze", "--model", str(folder), "--calib", str(corpus), "--out", str(out),
                 "--num-seqs", "8", "--seq-len", "32", "--cka-tokens", "100"]) == 0
    result = json.loads((out / "analysis.json").read_text())
    for name in result["figures"].values():
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cosine, cka = np.array(result["similarity"]["cosine"]), np.array(result["similarity"]["linear_cka"])
    assert cosine.shape == cka.shape == (7, 7) and np.allclose(np.diag(cka), 1.0)
    # block 3 does nothing: the streams around it are identical, and it is the best one-block span
    assert cosine[3, 4] > 0.9999 and cka[3, 4] > 0.9999
    assert result["best_span_per_length"]["1"]["start"] == 3
    assert len(result["linearity"]["attention"]["cca"]) == 6
    assert "blockfold analyze" in capsys.readouterr().out
    assert main(["analyze", "--model", str(folder), "--calib", str(corpus), "--out", str(out)]) == 2, "refuses to overwrite"
    assert not list(tmp_path.glob(".analysis.partial-*"))
