"""Greedy tokens and speed of a Hugging Face folder in vLLM.

Runs inside vLLM's own environment, which has no blockfold. vLLM starts worker processes, hence
the ``__main__`` guard. Reads a request (JSON) and writes the results (JSON):

    python vllm_runner.py request.json result.json
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(open(sys.argv[1]).read())
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    longest = max(len(ids) for ids in request["prompts"]) + request["new_tokens"] + 8
    llm = LLM(model=request["model"], dtype=request.get("dtype", "float32"), max_model_len=max(longest, 256),
              trust_remote_code=request.get("trust_remote_code", False), seed=0,
              enforce_eager=request.get("eager", True),  # compiling takes minutes on a CPU and serves no check
              # on the CPU backend this is the share of the machine's memory vLLM reserves (0.92 by default,
              # which fails to start beside any other process); a small model's KV cache needs little
              gpu_memory_utilization=request.get("memory_fraction", 0.25))
    greedy = SamplingParams(temperature=0.0, max_tokens=request["new_tokens"], ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:1], first, use_tqdm=False)  # warm-up: compilation and allocation are not serving
    started = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    whole = time.perf_counter() - started
    tokenizer = llm.get_tokenizer()
    cache = llm.llm_engine.vllm_config.cache_config
    result = {
        # tokens the KV cache holds in the memory vLLM reserved: more where layers keep no KV cache
        "kv_cache_tokens": (cache.num_gpu_blocks or 0) * cache.block_size or None,
        "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        "prefill_seconds": prefill, "prefill_tokens": sum(len(ids) for ids in request["prompts"]),
        "decode_seconds": max(whole - prefill, 1e-9), "decode_tokens": (request["new_tokens"] - 1) * len(prompts),
        "tokenized": [tokenizer(text)["input_ids"] for text in request.get("texts", [])],
    }
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
