"""Perplexity with the standard recipe: the whole text tokenised once, non-overlapping windows."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.errors import BlockfoldError

WIKITEXT_HINT = (
    "WikiText-2 test text: ../shared/data/wikitext2_test.txt in this project, or "
    '"\\n\\n".join(load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]) saved to a file'
)


def read_eval_text(path: str | Path) -> str:
    path = Path(path).expanduser()
    if not path.is_file():
        raise BlockfoldError(f"perplexity text {path} not found: pass --ppl PATH to a text file, e.g. the {WIKITEXT_HINT}")
    return path.read_text(encoding="utf-8")


def tokenize_windows(text: str, tokenizer: PreTrainedTokenizerBase, seq_len: int, max_windows: int | None) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    count = len(ids) // seq_len if max_windows is None else min(max_windows, len(ids) // seq_len)
    if count == 0:
        raise BlockfoldError(f"perplexity text has {len(ids)} tokens, fewer than one window of {seq_len}: use a longer text")
    return ids[: count * seq_len].view(count, seq_len)


@torch.no_grad()
def perplexity(
    model: PreTrainedModel, windows: torch.Tensor, batch_size: int = 4, description: str = "perplexity"
) -> dict:
    """exp of the mean next-token loss over all windows (each window scores seq_len - 1 tokens)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for first in tqdm(range(0, len(windows), batch_size), desc=description, unit="batch"):
        ids = windows[first : first + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits.float()
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(losses)
        count += ids[:, 1:].numel()
    mean_nll = total / count
    return {"perplexity": math.exp(mean_nll), "mean_nll": mean_nll, "windows": len(windows),
            "window_length": windows.shape[1], "scored_tokens": count}
