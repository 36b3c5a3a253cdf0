"""Speed, memory and size of a model next to another: prefill and decode throughput, peak prefill
memory (on CUDA), KV-cache bytes, parameter count and sparsity.

Timings on shared machines are noisy, so models are measured in one run, interleaved (A, B, A, B, ...)
after a warm-up, and the median of several repetitions is kept; compare models by the ratios.
"""

from __future__ import annotations

import inspect
import statistics
import time

import torch
from transformers import DynamicCache, PreTrainedModel


def parameter_counts(model: PreTrainedModel) -> dict[str, int]:
    """All parameters, and those outside the token embeddings and LM head (each tensor counted once)."""
    outside = {id(p) for module in (model.get_input_embeddings(), model.get_output_embeddings()) if module is not None
               for p in module.parameters()}
    unique = {id(p): p for p in model.parameters()}
    return {"parameters": sum(p.numel() for p in unique.values()),
            "non_embedding_parameters": sum(p.numel() for key, p in unique.items() if key not in outside)}


def _tokens(model: PreTrainedModel, length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)
    return ids.to(next(model.parameters()).device)


def _passing(model: PreTrainedModel, cache: DynamicCache) -> dict:
    """``cache`` under the keyword ``model.forward`` takes: ``cache`` since transformers 5.22 (where
    ``past_key_values`` still works but warns), ``past_key_values`` before."""
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {keyword: cache}


def _synchronize(model: PreTrainedModel) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


@torch.no_grad()
def kv_cache_bytes_per_layer(model: PreTrainedModel, length: int, batch: int = 1) -> list[int]:
    """Bytes each layer's slot of the default (dynamic) KV cache holds after ``length`` prompt tokens
    (sliding-window layers hold at most their window)."""
    cache = DynamicCache(config=model.config)
    model(_tokens(model, length, batch), **_passing(model, cache), use_cache=True, logits_to_keep=1)
    return [sum(tensor.numel() * tensor.element_size()
                for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if isinstance(tensor, torch.Tensor))
            for layer in cache.layers]


def kv_cache_bytes(model: PreTrainedModel, length: int, batch: int = 1) -> int:
    return sum(kv_cache_bytes_per_layer(model, length, batch))


@torch.no_grad()
def prefill_seconds(model: PreTrainedModel, length: int) -> float:
    ids = _tokens(model, length)
    _synchronize(model)
    started = time.perf_counter()
    model(ids, use_cache=True, logits_to_keep=1)
    _synchronize(model)
    return time.perf_counter() - started


@torch.no_grad()
def decode_seconds(model: PreTrainedModel, prompt_length: int, new_tokens: int) -> float:
    """Seconds for ``new_tokens`` greedy one-token steps after a prompt, prefill excluded."""
    cache = DynamicCache(config=model.config)
    logits = model(_tokens(model, prompt_length), **_passing(model, cache), use_cache=True, logits_to_keep=1).logits
    _synchronize(model)
    started = time.perf_counter()
    for _ in range(new_tokens):
        token = logits[:, -1:].argmax(-1)
        logits = model(token, **_passing(model, cache), use_cache=True).logits
    _synchronize(model)
    return time.perf_counter() - started


def peak_prefill_memory_mib(model: PreTrainedModel, length: int) -> float | None:
    """Memory a prefill of ``length`` tokens allocates above what was allocated before it, on CUDA
    (the caching allocator's counters); None on a CPU, where no counter tells: the growth of the
    resident set read 0.0 whenever glibc served the prefill from memory an earlier call had freed."""
    if not next(model.parameters()).is_cuda:
        return None
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    prefill_seconds(model, length)
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def benchmark(models: dict[str, PreTrainedModel], lengths: tuple[int, ...] = (256, 1024, 2048),
              decode_prompt: int = 128, decode_tokens: int = 64, repeats: int = 3) -> dict[str, dict]:
    """Measure every model, interleaved, after one warm-up each; medians of ``repeats``."""
    results = {name: {**parameter_counts(model), "prefill_tokens_per_s": {}, "kv_cache_bytes": {}}
               for name, model in models.items()}
    for model in models.values():  # warm-up: allocator, kernels, caches
        prefill_seconds(model, min(lengths))
        decode_seconds(model, 8, 4)
    for length in lengths:
        times = {name: [] for name in models}
        for _ in range(repeats):
            for name, model in models.items():
                times[name].append(prefill_seconds(model, length))
        for name, model in models.items():
            results[name]["prefill_tokens_per_s"][length] = length / statistics.median(times[name])
            results[name]["kv_cache_bytes"][length] = kv_cache_bytes(model, length)
    decode = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            decode[name].append(decode_seconds(model, decode_prompt, decode_tokens))
    for name, model in models.items():
        results[name]["decode_tokens_per_s"] = decode_tokens / statistics.median(decode[name])
        results[name]["peak_prefill_memory_mib"] = peak_prefill_memory_mib(model, max(lengths))
    return results
