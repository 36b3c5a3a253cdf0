"""Greedy tokens, speed and perplexity of a GGUF file in llama.cpp (through llama-cpp-python).

Speed comes two ways: seconds timed here around each call (what a Python caller sees, per-token
overhead included), and llama.cpp's own performance counters (``engine``: the time its decode calls
took, prefill batches and single tokens apart), which say what the model's layers cost.

Runs inside the engine's own environment, which has no blockfold: standard library, numpy and
llama_cpp only. Reads a request (JSON) and writes the results (JSON):

    python llamacpp_runner.py request.json result.json
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp
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


def engine_counters(llm: Llama) -> dict:
    """llama.cpp's counters since their last reset: milliseconds and tokens of its multi-token decode
    calls (prefill) and of its single-token ones (decode), measured inside the library from each
    decode call to the synchronisation that reads its logits."""
    data = llama_cpp.llama_perf_context(llm._ctx.ctx)
    return {"prefill_ms": data.t_p_eval_ms, "prefill_tokens": data.n_p_eval,
            "decode_ms": data.t_eval_ms, "decode_tokens": data.n_eval}


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    windows = request.get("perplexity_windows") or []
    context = max([len(p) + request["new_tokens"] for p in request["prompts"]] + [len(w) for w in windows]) + 8
    llm = Llama(model_path=request["model"], n_ctx=context, n_threads=request.get("threads", 2),
                n_batch=context, logits_all=bool(windows), verbose=False)
    result = {"tokens": [], "prefill_seconds": 0.0, "decode_seconds": 0.0, "prefill_tokens": 0, "decode_tokens": 0}
    if request.get("warmup") and request["prompts"]:  # first touches of the mapped weights and buffers, untimed
        greedy(llm, request["prompts"][0], min(2, request["new_tokens"]))
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    for prompt in request["prompts"]:
        tokens, prefill, decode = greedy(llm, prompt, request["new_tokens"])
        result["tokens"].append(tokens)
        result["prefill_seconds"] += prefill
        result["decode_seconds"] += decode
        result["prefill_tokens"] += len(prompt)
        result["decode_tokens"] += len(tokens) - 1
    result["engine"] = engine_counters(llm)
    result["tokenized"] = [llm.tokenize(text.encode(), add_bos=True, special=False)
                           for text in request.get("texts", [])]
    if windows:
        result["nll"] = sum(negative_log_likelihood(llm, window) for window in windows)
        result["nll_tokens"] = sum(len(window) - 1 for window in windows)
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
