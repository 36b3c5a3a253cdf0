"""The sequential pipeline: one decoder layer at a time (the pattern of llm-compressor's sequential
pipeline and of SparseGPT/Wanda), so the whole model is never resident.

The calibration sequences are run in chunks. For a chunk, the decoder is called once per batch with
every block replaced by a recorder, which keeps what the decoder hands each block (the hidden state,
the attention masks, the rotary tables) and stops; only the modules outside the blocks are loaded
for that. Then, layer by layer, the layer's weights are read from the checkpoint onto the device,
every batch of the chunk runs through it, its activations go to the observers as one group, its
outputs become the next layer's inputs (kept on the device, in CPU memory or on disk), and the
layer is released. Weights are read once per chunk; activations and the observers' windows are
bounded by the chunk.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from blockfold.data import Batch
from blockfold.models.handle import ModelHandle
from blockfold.pipelines.buffers import ActivationStore
from blockfold.pipelines.capture import (
    SublayerCapture,
    check_finite,
    first,
    flatten,
    join_inputs,
    last_token_rows,
    needs_attention,
    needs_projection_inputs,
    split_rows,
    take_inputs,
)
from blockfold.progress import bar
from blockfold.runtime import check_offload_dir, release_free_memory
from blockfold.stats.activations import LayerActivations, Observer


class _Recorded(Exception):
    """Raised by the recorder of the deepest layer needed: the decoder has computed every input."""


class _Recorder(nn.Module):
    """Stands in for a block while the decoder prepares its inputs: records what the block is called
    with and returns the hidden state unchanged. Attributes the decoder reads off its blocks
    (``attention_type`` and the like) come from the real block."""

    def __init__(self, index: int, block: nn.Module, sink: dict, last: bool):
        super().__init__()
        self.index, self.sink, self.last = index, sink, last
        object.__setattr__(self, "_block", block)  # not a submodule: its placeholders stay untouched

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_block"), name)

    def forward(self, hidden_states, *args, **kwargs):
        self.sink[self.index] = (hidden_states, args, kwargs)
        if self.last:
            raise _Recorded
        return hidden_states


class LayerProgram:
    """The decoder of ``handle`` over ``batches``, run layer by layer: ``hidden(b)`` is batch ``b``'s
    current hidden state, ``layer(i)`` loads block ``i`` and yields a function running it on a batch."""

    def __init__(self, handle: ModelHandle, batches: list[Batch], store: ActivationStore, last_layer: int):
        self.handle, self.batches, self.store = handle, batches, store
        self.masks = [batch.attention_mask.to(handle.device).bool() for batch in batches]
        self._inputs: list[dict[int, tuple[tuple, dict]]] = []
        adapter, model = handle.adapter, handle.model
        decoder, blocks = adapter.decoder(model), adapter.layers(model)
        sink: dict = {}
        setattr(decoder, adapter.layers_attr,
                nn.ModuleList(_Recorder(i, block, sink, i == last_layer) for i, block in enumerate(blocks)))
        try:
            with handle.materialized(*handle.top_modules()), torch.no_grad():
                for number, batch in enumerate(batches):
                    sink.clear()
                    device = handle.device
                    try:
                        adapter.run_to_blocks(model, batch, device)
                    except _Recorded:
                        pass
                    store.put(f"h{number}", sink[0][0])
                    self._inputs.append({index: (args, kwargs) for index, (_, args, kwargs) in sink.items()})
        finally:
            setattr(decoder, adapter.layers_attr, blocks)

    def hidden(self, number: int) -> torch.Tensor:
        return self.store.get(f"h{number}")

    def set_hidden(self, number: int, hidden: torch.Tensor) -> None:
        self.store.put(f"h{number}", hidden)

    def run_in_place_of(self, index: int, module: nn.Module, hidden: torch.Tensor, number: int,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
        """``module`` (a loaded block) run where block ``index`` runs: with its masks, positions and rotary
        tables (cast to ``dtype`` where they are floating point and one is given: a float32 copy in training)."""
        args, kwargs = self._inputs[number][index]
        if dtype is not None:
            args, kwargs = _cast(args, dtype), _cast(kwargs, dtype)
        return first(module(hidden, *args, **kwargs))

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator:
        """Block ``index`` loaded; yields ``(block, run)`` with ``run(hidden, batch_number) -> output``."""
        block = self.handle.layers()[index]

        def run(hidden: torch.Tensor, number: int) -> torch.Tensor:
            return self.run_in_place_of(index, block, hidden, number)

        with self.handle.materialized(block), torch.no_grad():
            yield block, run
        release_free_memory()  # the block's weights, freed just now


def _cast(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor in it (in tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _cast(item, dtype) for key, item in value.items()}
    return value


def chunks_of(batches: list[Batch], sequences_per_chunk: int | None) -> list[list[Batch]]:
    """Batches regrouped into chunks of about ``sequences_per_chunk`` sequences (whole batches; a
    batch larger than a chunk is split by rows). None: one batch per chunk."""
    if sequences_per_chunk is None:
        return [[batch] for batch in batches]
    rows = split_rows(batches, sequences_per_chunk)
    grouped: list[list[Batch]] = [[]]
    for part in rows:
        if grouped[-1] and sum(len(b) for b in grouped[-1]) + len(part) > sequences_per_chunk:
            grouped.append([])
        grouped[-1].append(part)
    return grouped


def run_sequential(handle: ModelHandle, chunks: list[list[Batch]], observers: list[Observer], store_kind: str,
                   offload_dir: str | None = None, description: str = "calibration pass", first_chunk: int = 0,
                   after_chunk: Callable[[int], None] | None = None, show: bool = True) -> None:
    """Chunks ``first_chunk``.. of ``chunks`` through layers 0..(deepest observed), layer by layer per
    chunk; ``after_chunk(n)`` once ``n`` chunks are done."""
    last_layer = max(obs.last_layer for obs in observers)
    attention = needs_attention(observers)
    chunks = chunks[first_chunk:]
    d = handle.adapter.hidden_size(handle.model)
    needed = [sum(batch.attention_mask.numel() for batch in chunk) * d * handle.dtype.itemsize for chunk in chunks]
    if store_kind == "disk":  # a folder without room fails before the pass, not in its middle
        check_offload_dir(offload_dir, max(needed, default=0))
    with bar(total=len(chunks) * (last_layer + 1), desc=description, unit="layer", show=show) as progress:
        for number, (chunk, chunk_bytes) in enumerate(zip(chunks, needed), start=first_chunk + 1):
            _run_chunk(handle, chunk, observers, last_layer, attention, progress,
                       ActivationStore(store_kind, handle.device, offload_dir, chunk_bytes))
            if after_chunk is not None:
                after_chunk(number)


def _run_chunk(handle: ModelHandle, chunk: list[Batch], observers: list[Observer], last_layer: int, attention: bool,
               progress, store: ActivationStore) -> None:
    """One chunk through layers 0..``last_layer``, its activations handed to the observers as one group."""
    inputs = needs_projection_inputs(observers)
    with store:
        program = LayerProgram(handle, chunk, store, last_layer)
        counts = [int(mask.sum()) for mask in program.masks]
        offsets = [sum(counts[:number]) for number in range(len(chunk))]
        last_token = torch.cat([last_token_rows(mask) + offset for mask, offset in zip(program.masks, offsets)])
        block_in = torch.cat([flatten(program.hidden(n), mask) for n, mask in enumerate(program.masks)])
        for index in range(last_layer + 1):
            parts: dict[str, list[torch.Tensor]] = {}
            read: list[dict[str, torch.Tensor]] = []
            with program.layer(index) as (block, run):
                captured: dict = {}
                capture = SublayerCapture(block, handle.adapter, attention, captured, inputs)
                try:
                    for number, mask in enumerate(program.masks):
                        captured["mask"] = mask
                        output = run(program.hidden(number), number)
                        if index < last_layer:
                            program.set_hidden(number, output)
                        parts.setdefault("out", []).append(flatten(output, mask))
                        for key in ("mlp", "down", "attn_in", "attn"):
                            if key in captured:
                                parts.setdefault(key, []).append(captured.pop(key))
                        if inputs:
                            read.append(take_inputs(captured))
                finally:
                    capture.remove()
            joined = {key: torch.cat(values) for key, values in parts.items()}
            check_finite(index, joined["out"])
            acts = LayerActivations(index=index, block_in=block_in, block_out=joined["out"],
                                    mlp_contribution=joined["mlp"], down_out=joined.get("down"),
                                    last_token=last_token, attn_input=joined.get("attn_in"),
                                    attn_contribution=joined.get("attn"),
                                    projection_inputs=join_inputs(read) if read else None)
            for obs in observers:
                if index <= obs.last_layer:
                    obs.on_layer(acts)
            block_in = joined["out"]
            del acts, joined, parts, read
            release_free_memory()  # the observers' float64 working copies
            progress.update(1)
        for obs in observers:
            obs.end_batch()




def sequences_for_budget(budget_bytes: int, bytes_per_token: int, sequence_length: int, total_sequences: int) -> int:
    """The most whole sequences whose per-token working memory fits ``budget_bytes`` (at least one)."""
    per_sequence = max(1, bytes_per_token * sequence_length)
    return max(1, min(total_sequences, math.floor(budget_bytes / per_sequence)))
