"""Greedy tokens, speed and perplexity of a GGUF file in llama.cpp (through llama-cpp-python).

Runs inside the engine's own environment, which has no blockfold: standard library, numpy and
llama_cpp only. Reads a request (JSON) and writes the results (JSON):

    python llamacpp_runner.py request.json result.json
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def greedy(llm: Llama, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """``new_tokens`` argmax tokens after ``prompt`` (end-of-text does not stop it, so both engines
    produce the same count); the prefill and the decode seconds."""
    llm.reset()
    started = time.perf_counter()
    llm.eval(prompt)
    prefilled = time.perf_counter()
    tokens = []
    for _ in range(new_tokens):
        token = int(np.argmax(_last_logits(llm)))
        tokens.append(token)
        if len(tokens) < new_tokens:
            llm.eval([token])
    return tokens, prefilled - started, time.perf_counter() - prefilled


def _last_logits(llm: Llama) -> np.ndarray:
    """The logits of the last token evaluated (without ``logits_all``, the only row llama.cpp computed)."""
    if llm._logits_all:
        return llm.scores[llm.n_tokens - 1]
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def negative_log_likelihood(llm: Llama, window: list[int]) -> float:
    """Summed NLL of tokens 1.. of ``window`` given the ones before (the perplexity numerator)."""
    llm.reset()
    llm.eval(window)
    logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(window) - 1), window[1:]].sum())


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    windows = request.get("perplexity_windows") or []
    context = max([len(p) + request["new_tokens"] for p in request["prompts"]] + [len(w) for w in windows]) + 8
    llm = Llama(model_path=request["model"], n_ctx=context, n_threads=request.get("threads", 2),
                n_batch=context, logits_all=bool(windows), verbose=False)
    result = {"tokens": [], "prefill_seconds": 0.0, "decode_seconds": 0.0, "prefill_tokens": 0, "decode_tokens": 0}
    for prompt in request["prompts"]:
        tokens, prefill, decode = greedy(llm, prompt, request["new_tokens"])
        result["tokens"].append(tokens)
        result["prefill_seconds"] += prefill
        result["decode_seconds"] += decode
        result["prefill_tokens"] += len(prompt)
        result["decode_tokens"] += len(tokens) - 1
    result["tokenized"] = [llm.tokenize(text.encode(), add_bos=True, special=False)
                           for text in request.get("texts", [])]
    if windows:
        result["nll"] = sum(negative_log_likelihood(llm, window) for window in windows)
        result["nll_tokens"] = sum(len(window) - 1 for window in windows)
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
