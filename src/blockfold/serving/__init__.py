"""Does a serving engine run a model as transformers does? Greedy tokens on the same prompts.

Each engine lives in its own virtual environment (their pins clash with blockfold's), set up by
``scripts/serve-check.sh``; blockfold talks to it through a small runner script that reads a JSON
request and writes a JSON result. The prompts are token ids, fed to both sides as they are, so a
mismatch is the model's arithmetic, not tokenization; the engine's own tokenization of the same
texts is compared and reported beside it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockfold.errors import BlockfoldError

log = logging.getLogger(__name__)

ENGINES_DIR = Path(os.environ.get("BLOCKFOLD_ENGINES", ".engines"))
RUNNERS = {"llamacpp": Path(__file__).with_name("llamacpp_runner.py"),
           "vllm": Path(__file__).with_name("vllm_runner.py")}


def engine_python(engine: str) -> Path:
    """The engine environment's interpreter; ``scripts/serve-check.sh`` creates it on first use."""
    python = ENGINES_DIR / engine / "bin" / "python"
    if not python.is_file():
        raise BlockfoldError(f"no {engine} environment at {python.parent.parent}: run scripts/serve-check.sh once "
                             f"with --engine {engine} (it installs the engine), or set BLOCKFOLD_ENGINES")
    return python


def read_prompts(path: Path, tokenizer, count: int, max_tokens: int) -> tuple[list[str], list[list[int]]]:
    """The first ``count`` texts of a .jsonl (``text`` field) or .txt file (one per non-empty line),
    cut to ``max_tokens`` tokens, as text and as the ids the tokenizer gives them."""
    if not path.is_file():
        raise BlockfoldError(f"prompt file {path} not found: pass --prompts FILE (.jsonl with 'text', or .txt) or set "
                             "BLOCKFOLD_DATA to the folder holding lambada_test.jsonl")
    texts: list[str] = []
    for line in path.read_text().splitlines():
        text = json.loads(line).get("text", "") if path.suffix == ".jsonl" and line.strip() else line.strip()
        if text.strip():
            texts.append(text)
        if len(texts) == count:
            break
    if len(texts) < count:
        raise BlockfoldError(f"{path} has {len(texts)} texts, fewer than the {count} prompts asked for")
    ids = [tokenizer(text)["input_ids"][:max_tokens] for text in texts]
    return [tokenizer.decode(one, skip_special_tokens=True) for one in ids], ids


@torch.no_grad()
def transformers_greedy(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Argmax continuations with transformers' KV cache (end-of-text does not stop them), and at each
    step the gap between the two highest logits: where an engine differs, a gap of a few thousandths
    says the two agree up to rounding and a near tie went the other way."""
    continuations, gaps = [], []
    for prompt in prompts:
        output = model(torch.tensor([prompt]), use_cache=True)
        tokens, margins = [], []
        for _ in range(new_tokens):
            top = output.logits[0, -1].float().topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            output = model(torch.tensor([[tokens[-1]]]), cache=output.cache, use_cache=True)
        continuations.append(tokens)
        gaps.append(margins)
    return continuations, gaps


def run_engine(engine: str, request: dict) -> dict:
    """Hand ``request`` to the engine's runner in its own environment; its JSON result."""
    with tempfile.TemporaryDirectory() as folder:
        asked, answered = Path(folder, "request.json"), Path(folder, "result.json")
        asked.write_text(json.dumps(request))
        done = subprocess.run([str(engine_python(engine)), str(RUNNERS[engine]), str(asked), str(answered)],
                              capture_output=True, text=True)
        if done.returncode != 0 or not answered.is_file():
            raise BlockfoldError(f"{engine} failed on {request['model']}:\n{done.stderr[-3000:]}")
        return json.loads(answered.read_text())


@dataclass
class Agreement:
    """Greedy tokens of an engine against transformers on the same prompt ids."""

    engine: str
    reference: list[list[int]]
    engine_tokens: list[list[int]]
    tokenization_agrees: int  # prompts the engine tokenizes as transformers does
    gaps: list[list[float]] = field(default_factory=list)  # transformers' top-2 logit gap at each step
    speed: dict = field(default_factory=dict)

    def first_difference(self, prompt: int) -> int | None:
        """The step where the engine first leaves transformers' tokens on ``prompt``."""
        pairs = zip(self.reference[prompt], self.engine_tokens[prompt])
        return next((step for step, (a, b) in enumerate(pairs) if a != b), None)

    @property
    def matching(self) -> int:
        return sum(a == b for a, b in zip(self.reference, self.engine_tokens))

    @property
    def identical(self) -> bool:
        return self.matching == len(self.reference)


__all__ = ["Agreement", "ENGINES_DIR", "engine_python", "read_prompts", "run_engine", "transformers_greedy"]
