"""Perplexity with the standard recipe: the whole text tokenised once, non-overlapping windows, each
beginning as a text does (BOS for Gemma and Llama, as lm-eval's rolling windows do)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.data.calibration import text_start
from blockfold.errors import BlockfoldError
from blockfold.progress import bar

WIKITEXT_HINT = (
    "WikiText-2 test text: ../shared/data/wikitext2_test.txt in this project, or "
    '"\\n\\n".join(load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]) saved to a file'
)


#: ``PATH[FIRST:LAST]``: a part of a perplexity text (windows of a text file, documents of a JSON-lines file)
_PART = re.compile(r"^(?P<path>.+)\[(?P<first>\d*):(?P<last>\d*)\]$")


class EvalText(str):
    """A perplexity text as read, with the windows to keep (``windows``, a slice; None: all) where its
    name asked for a part of a text file, and the name it was given (``name``), for tables."""

    name: str
    windows: slice | None


def read_eval_text(spec: str | Path) -> EvalText:
    """The text ``spec`` names: ``PATH``, or ``PATH[FIRST:LAST]`` for windows FIRST to LAST of a text file or
    documents FIRST to LAST of a JSON-lines file (their ``text``), so text held out from the calibration or
    from what chose a default can be named (``wikitext2_test.txt[40:60]``, ``c4_demo.jsonl[200:]``)."""
    spec = str(spec)
    part = _PART.match(spec)
    path = Path(part["path"] if part else spec).expanduser()
    if not path.is_file():
        raise BlockfoldError(f"perplexity text {path} not found: pass --ppl PATH to a text file, e.g. the {WIKITEXT_HINT}")
    chosen = slice(int(part["first"]) if part and part["first"] else None,
                   int(part["last"]) if part and part["last"] else None) if part else None
    if path.suffix == ".jsonl":
        documents = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise BlockfoldError(f"{path}, line {number + 1}: a JSON-lines perplexity text needs a \"text\" "
                                         "string in every record")
                documents.append(record["text"])
        text, windows = EvalText("\n\n".join(documents[chosen] if chosen else documents)), None
    else:
        text, windows = EvalText(path.read_text(encoding="utf-8")), chosen
    text.name, text.windows = spec, windows
    return text


def tokenize_windows(text: str, tokenizer: PreTrainedTokenizerBase, seq_len: int, max_windows: int | None) -> torch.Tensor:
    """Windows of ``seq_len`` tokens, each the tokenizer's text start (BOS where it adds one) and the
    next ``seq_len - len(start)`` tokens of the text (of those ``text.windows`` keeps, for a part of a
    text); at most ``max_windows``. A model trained to always see BOS, Gemma above all, loses its
    attention sink without it: Gemma-3-270m scored 72.2 on WikiText-2 windows 40-59 cut from one
    stream, 24.0 with BOS before each (blockfold cut them from one stream until 2026-12-03)."""
    start = text_start(tokenizer)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    body = seq_len - len(start)
    available = len(ids) // body if body > 0 else 0
    kept = range(available)[getattr(text, "windows", None) or slice(None)]
    count = len(kept) if max_windows is None else min(max_windows, len(kept))
    if available == 0:
        raise BlockfoldError(f"perplexity text has {len(ids)} tokens, fewer than one window of {seq_len}: use a longer text")
    if count == 0:
        raise BlockfoldError(f"perplexity text {getattr(text, 'name', '')} has {available} windows of {seq_len} tokens, "
                             "none of them in the part asked for: name windows below that count")
    first = kept.start
    windows = ids[first * body : (first + count) * body].view(count, body)
    return torch.cat([torch.tensor(start, dtype=windows.dtype).expand(count, len(start)), windows], dim=1)


#: rows of logits computed at once: a full-vocabulary float32 row is vocab × 4 bytes (1 MiB for 262k tokens)
LOGIT_ROWS = 1024


def _summed_nll(model: PreTrainedModel, normed: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed cross-entropy of ``targets`` given final-normed hidden rows: the LM head (and the logit
    soft-cap where the model has one) ``LOGIT_ROWS`` rows at a time, so the full-vocabulary logits of
    a batch never exist at once."""
    cap = getattr(model.config, "final_logit_softcapping", None)
    total = 0.0
    for first in range(0, len(normed), LOGIT_ROWS):
        logits = model.get_output_embeddings()(normed[first : first + LOGIT_ROWS])
        logits = (cap * torch.tanh(logits / cap) if cap else logits).float()
        total += float(torch.nn.functional.cross_entropy(logits, targets[first : first + LOGIT_ROWS], reduction="sum"))
    return total


def next_token_nll(model: PreTrainedModel, adapter, hidden: torch.Tensor, ids: torch.Tensor,
                   mask: torch.Tensor | None = None, normed: bool = False) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of ``ids`` over real tokens, from the last block's
    hidden states (``normed``: already through the final norm), and the number of tokens scored."""
    # a prediction counts when both the position making it and the token predicted are real: with
    # left padding the first real token would otherwise be predicted from a pad position
    keep = (mask[:, 1:].bool() & mask[:, :-1].bool() if mask is not None else torch.ones_like(ids[:, 1:]).bool())
    keep = keep.to(hidden.device)
    rows = hidden[:, :-1][keep]
    if not normed:
        rows = getattr(adapter.decoder(model), adapter.final_norm_attr)(rows)
    return _summed_nll(model, rows, ids[:, 1:].to(hidden.device)[keep]), int(keep.sum())


@torch.no_grad()
def stream_nll(handle, batches: list, streams: dict) -> dict:
    """Key → (summed next-token NLL, tokens scored) of each stream of last-block hidden states (one per
    batch, as a layer program carries one stream per candidate), through ``handle``'s head."""
    totals = {}
    with handle.materialized(*handle.head_modules()):
        for key, hidden in streams.items():
            scored = [next_token_nll(handle.model, handle.adapter, h, batch.input_ids, batch.attention_mask)
                      for batch, h in zip(batches, hidden)]
            totals[key] = (sum(nll for nll, _ in scored), sum(count for _, count in scored))
    return totals


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 4, description: str = "perplexity") -> dict:
    """exp of the mean next-token loss over all windows (each window scores seq_len - 1 tokens).

    ``model`` is a model or a ``ModelHandle``; a streamed handle runs layer by layer, ``batch_size``
    windows per batch and 16 batches per chunk, so the whole model is never resident.
    """
    from blockfold.data import Batch

    batches = [Batch(windows[i : i + batch_size], torch.ones_like(windows[i : i + batch_size]))
               for i in range(0, len(windows), batch_size)]
    total, count = summed_nll(model, batches, description)
    mean_nll = total / count
    return {"perplexity": math.exp(mean_nll), "mean_nll": mean_nll, "windows": len(windows),
            "window_length": windows.shape[1], "scored_tokens": count}


@torch.no_grad()
def summed_nll(model, batches: list, description: str = "next-token loss") -> tuple[float, int]:
    """Summed next-token negative log-likelihood over the real tokens of ``batches`` (calibration
    batches, padded or packed), and the number of tokens scored. ``model`` is a model or a
    ``ModelHandle``; a streamed handle runs layer by layer, 16 batches per chunk."""
    from blockfold.adapters import get_adapter
    from blockfold.models.handle import ModelHandle

    handle = model if isinstance(model, ModelHandle) else None
    model = handle.model if handle is not None else model
    if handle is not None and not handle.resident:
        return _streamed_nll(handle, batches, description)
    adapter = get_adapter(model)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in bar(batches, desc=description, unit="batch"):
        ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        padded = not bool(mask.all())  # a full window takes the plain causal path, as it always has
        normed = adapter.decoder(model)(input_ids=ids, use_cache=False,
                                        **({"attention_mask": mask, "position_ids": batch.position_ids.to(device)}
                                           if padded else {})).last_hidden_state
        nll, scored = next_token_nll(model, adapter, normed, ids, mask if padded else None, normed=True)
        total += nll
        count += scored
    return total, count


def _streamed_nll(handle, batches: list, description: str) -> tuple[float, int]:
    from blockfold.pipelines import LayerProgram
    from blockfold.pipelines.buffers import ActivationStore

    total, count = 0.0, 0
    last = handle.num_layers() - 1
    for first in bar(range(0, len(batches), 16), desc=description, unit="chunk"):
        chunk = batches[first : first + 16]
        with ActivationStore("device", handle.device) as store:
            program = LayerProgram(handle, chunk, store, last)
            for index in range(last + 1):
                with program.layer(index) as (_, run):
                    for number in range(len(chunk)):
                        program.set_hidden(number, run(program.hidden(number), number))
            with handle.materialized(*handle.head_modules()):
                for number, batch in enumerate(chunk):
                    nll, scored = next_token_nll(handle.model, handle.adapter, program.hidden(number), batch.input_ids,
                                                 batch.attention_mask)
                    total += nll
                    count += scored
    return total, count
