"""How the layers run: the whole model resident (batch after batch), or one layer at a time.

Methods hand a ``Runner`` their observers and never ask which pipeline runs them; pipelines never
know which method they serve (llm-compressor's separation of modifiers from pipelines). The runner
picks the pipeline from the handle (a streamed model can only run layer by layer) and the execution
settings, and sizes the chunks of the sequential pipeline from a memory budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from blockfold import distributed
from blockfold.data import Batch
from blockfold.pipelines.capture import split_rows
from blockfold.pipelines.persist import Checkpoints, StatsCache, calibration_digest, pass_key
from blockfold.pipelines.recording import StreamRecorder
from blockfold.models.handle import ModelHandle
from blockfold.pipelines.sequential import LayerProgram, chunks_of, run_sequential, sequences_for_budget
from blockfold.pipelines.whole import run_whole
from blockfold.runtime import Execution, free_memory, settle_vector_math
from blockfold.stats.activations import Observer

log = logging.getLogger(__name__)

#: share of a GPU's free memory (after the statistics) that a chunk's activations and windows may take
ACTIVATION_SHARE = {"cuda": 0.7}
#: on a CPU the weights are cheap to re-read next to the compute, so chunks stay small
CPU_ACTIVATION_BYTES = 512 << 20
#: on a CPU the whole-model pass runs forwards of at most this much working memory (the resident
#: weights already take their share; a smaller forward costs about as much per token there)
CPU_WHOLE_GROUP_BYTES = 96 << 20
#: share of the free memory where the statistics live that their float64 sums may take by default
STATS_SHARE = 0.25
#: --offload auto: share of a place's free memory that activations kept between layers may take there
OFFLOAD_SHARE = 0.5


class Runner:
    """Runs observer passes over ``handle`` with the pipeline its weights and ``execution`` call for."""

    def __init__(self, handle: ModelHandle, execution: Execution | None = None):
        settle_vector_math()
        self.handle = handle
        self.execution = execution or Execution()
        self.ranks = distributed.current()
        self.passes = 0
        #: passes a method ran through its own layer program (a stream per candidate, recorded
        #: activations): counted among ``passes``, never checkpointed or cached
        self.sweeps = 0
        self.pass_seconds = 0.0  # time spent in passes, so the rest of a job (selection, fits) can be told apart
        self.cached_passes = 0
        self.resumed_passes = 0
        #: where activations waited between layers (``--offload auto`` decides per store)
        self.offloaded: set[str] = set()
        self.checkpoints = (Checkpoints(Path(self.execution.resume_dir), self.ranks.rank, self.execution.checkpoint_seconds)
                            if self.execution.resume_dir else None)
        self.cache = StatsCache(self.execution.stats_cache) if self.execution.stats_cache else None

    def sweep(self) -> None:
        """Count one pass a method ran through its own ``LayerProgram``."""
        self.passes += 1
        self.sweeps += 1

    @property
    def pipeline(self) -> str:
        if not self.handle.resident or self.execution.pipeline == "sequential":
            return "sequential"
        return "whole"

    def run(self, batches: Iterable[Batch], observers: list[Observer], description: str = "calibration pass",
            recorders: list[StreamRecorder] = ()) -> None:
        """One pass: this process's shard of ``batches`` through the pipeline (from a checkpoint when
        there is one), then the shards' statistics combined; or the pass loaded from the cache.
        ``recorders`` keep this process's stream beside the statistics (a loaded pass leaves them empty)."""
        batches = list(batches)
        self.passes += 1
        started = time.perf_counter()
        key = fingerprint = None
        if self.checkpoints is not None or self.cache is not None:
            fingerprint = self.handle.fingerprint()
            key = pass_key(fingerprint, self.handle.dtype, calibration_digest(batches), observers)
        # every rank must have the entry before any loads it: a rank that ran the pass would add to it
        if self.cache is not None and distributed.all_agree(self.cache.has(key)):
            self.cache.load(key, fingerprint, observers, self.handle.device)
            self.cached_passes += 1
            log.info("%s: loaded from the statistics cache %s", description, self.cache.folder)
        else:
            self._run_shard(batches, observers, description, key, list(recorders))
            distributed.reduce_observers(observers, self.ranks)
            if self.cache is not None and self.ranks.is_main:
                self.cache.save(key, fingerprint, observers, description)
        self.pass_seconds += time.perf_counter() - started

    def _run_shard(self, batches: list[Batch], observers: list[Observer], description: str, key: str | None,
                   recorders: list[StreamRecorder]) -> None:
        shard, offset = distributed.shard(batches, self.ranks)
        sequential = self.pipeline == "sequential"
        size = self.sequences_per_chunk(shard, observers) if sequential else self.sequences_per_group(shard, observers)
        done = 0
        if self.checkpoints is not None:
            restored = self.checkpoints.restore(self.passes, key, observers, self.handle.device)
            if restored is not None:
                done, size = restored
                self.resumed_passes += 1
        groups = chunks_of(shard, size) if sequential else split_rows(shard, size)
        skipped = offset + sum(_tokens(group) for group in groups[:done])
        for observer in observers:
            if skipped and hasattr(observer, "skip"):
                observer.skip(skipped)
        after = self.checkpoints.writer(self.passes, key, len(groups), size, observers) if self.checkpoints else None
        if done == len(groups):
            return
        riders = observers + (recorders if done == 0 else [])  # a resumed pass cannot record the groups it skips
        if sequential:
            largest = max(groups[done:], key=lambda chunk: sum(batch.attention_mask.numel() for batch in chunk))
            run_sequential(self.handle, groups, riders, self.store_kind(largest), self.execution.offload_dir, description,
                           done, after, show=self.ranks.is_main)
        else:
            run_whole(self.handle, groups, riders, description, done, after, show=self.ranks.is_main)

    def store_kind(self, batches: Iterable[Batch] = (), copies: int = 1) -> str:
        """Where activations wait between layers: as ``--offload`` says; ``auto`` keeps ``copies`` of the
        hidden states of ``batches`` on the device while they take at most ``OFFLOAD_SHARE`` of its free
        memory, else in CPU memory under the same share (an accelerator's host), else on disk."""
        kind = ({"none": "device", "cpu": "cpu", "disk": "disk"}[self.execution.offload]
                if self.execution.offload != "auto" else self._auto_store_kind(batches, copies))
        self.offloaded.add(kind)
        return kind

    def _auto_store_kind(self, batches: Iterable[Batch], copies: int) -> str:
        device = self.handle.device
        d = self.handle.adapter.hidden_size(self.handle.model)
        needed = copies * sum(batch.attention_mask.numel() for batch in batches) * d * self.handle.dtype.itemsize
        places = [("device", device)] + ([("cpu", torch.device("cpu"))] if device.type != "cpu" else [])
        for kind, place in places:
            free = free_memory(place)
            if free is None or needed <= OFFLOAD_SHARE * free:
                break
        else:
            kind = "disk"
        if kind != "device":
            log.info("activations of %.1f GiB wait %s (--offload auto; free memory too small to keep them on %s)",
                     needed / 2**30, "in CPU memory" if kind == "cpu" else "on disk", device)
        return kind

    def activation_bytes_per_token(self, observers: list[Observer]) -> int:
        """Working memory per calibration token of one chunk: the hidden state kept between layers,
        the captured sublayer outputs (float32, per batch and joined) and the observers' windows."""
        d, element = self.handle.adapter.hidden_size(self.handle.model), self.handle.dtype.itemsize
        captured = 3 + 2 * any(getattr(o, "needs_attention", False) for o in observers) \
            + (not self.handle.adapter.folds_exactly)
        windows = sum(obs.window_bytes_per_token(d, element) for obs in observers if hasattr(obs, "window_bytes_per_token"))
        return d * element * (1 + 2 * captured) + windows

    def sequences_per_chunk(self, batches: list[Batch], observers: list[Observer]) -> int:
        if self.execution.chunk_sequences is not None:
            return self.execution.chunk_sequences
        device = self.handle.device
        free = free_memory(device)
        if device.type in ACTIVATION_SHARE and free:
            d = self.handle.adapter.hidden_size(self.handle.model)
            sums = sum(obs.sums_bytes(d) for obs in observers if hasattr(obs, "sums_bytes"))
            budget = int((free - sums - self.handle.weight_bytes()["per_layer"]) * ACTIVATION_SHARE[device.type])
        else:
            budget = CPU_ACTIVATION_BYTES
        return self._sequences_within(budget, batches, observers)

    def sequences_per_group(self, batches: list[Batch], observers: list[Observer]) -> int | None:
        """The whole pipeline's largest forward: batches as given on an accelerator, split on a CPU so
        the observers' per-token working memory stays within ``CPU_WHOLE_GROUP_BYTES``."""
        if self.execution.chunk_sequences is not None:
            return self.execution.chunk_sequences
        if self.handle.device.type != "cpu":
            return None
        return self._sequences_within(CPU_WHOLE_GROUP_BYTES, batches, observers)

    def _sequences_within(self, budget: int, batches: list[Batch], observers: list[Observer]) -> int:
        """The most whole sequences of ``batches`` whose working memory fits ``budget`` bytes."""
        length = max(batch.attention_mask.shape[1] for batch in batches)
        total = sum(len(batch) for batch in batches)
        return sequences_for_budget(budget, self.activation_bytes_per_token(observers), length, total)

    def stats_budget(self) -> int:
        """Bytes the float64 sums may take: ``--stats-memory``, else a share of the free memory of the device."""
        if self.execution.stats_memory is not None:
            return self.execution.stats_memory
        free = free_memory(self.handle.device) or free_memory(torch.device("cpu")) or (8 << 30)
        return int(free * STATS_SHARE)


def _tokens(group: Batch | list[Batch]) -> int:
    return sum(batch.num_tokens for batch in group) if isinstance(group, list) else group.num_tokens


def run_observers(model, calibration: Iterable[Batch], observers: list[Observer], execution: Execution | None = None,
                  description: str = "calibration pass") -> Runner:
    """One pass of ``calibration`` feeding ``observers``, for a ``ModelHandle`` or a model in memory,
    through whichever pipeline fits (benchmarks and studies that need raw statistics use this)."""
    from blockfold.api import as_handle

    runner = Runner(as_handle(model, None, execution), execution)
    runner.run(calibration, observers, description)
    return runner


__all__ = ["LayerProgram", "Runner", "StreamRecorder", "chunks_of", "run_observers", "run_sequential", "run_whole"]
