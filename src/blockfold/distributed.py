"""Several processes over one calibration set, with torch.distributed (launched by torchrun).

Every rank runs the same job. A pass hands each rank a contiguous shard of the calibration batches;
at the end of the pass the observers' sums are reduced onto rank 0 and broadcast back, and their
sampled rows gathered in rank order, so every rank holds bit-identical statistics and makes the same
selection, fit and surgery (a later pass of a multi-pass method needs the modified model on every
rank). Only rank 0 writes outputs and shows progress. gloo on CPUs, NCCL on GPUs (with a gloo group
for statistics that live in CPU memory).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from blockfold.errors import BlockfoldError, PeerFailure
from blockfold.stats.state import combine, load_observer_state, map_leaves, observer_state

log = logging.getLogger(__name__)

#: how long a collective waits for a rank before failing (a rank that died makes the others fail)
TIMEOUT = datetime.timedelta(minutes=int(os.environ.get("BLOCKFOLD_DIST_TIMEOUT_MINUTES", "30")))

_cpu_group = None


@dataclass(frozen=True)
class Ranks:
    """This process's place among the job's processes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def several(self) -> bool:
        return self.world_size > 1


def launched() -> bool:
    """True under torchrun (or any launcher that sets WORLD_SIZE above 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def current() -> Ranks:
    if not dist.is_available() or not dist.is_initialized():
        return Ranks()
    return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def init_from_environment(device: torch.device) -> Ranks:
    """Join the process group torchrun describes in the environment (once); a single process stays alone."""
    global _cpu_group
    if not launched() or dist.is_initialized():
        return current()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, timeout=TIMEOUT, device_id=device if device.type == "cuda" else None)
    except (RuntimeError, ValueError) as error:
        raise BlockfoldError(f"cannot join the torchrun process group ({str(error).splitlines()[0]}): launch with "
                             "torchrun --nproc-per-node N -m blockfold ..., with the same command on every node") from None
    _cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else None
    ranks = current()
    if not ranks.is_main:  # one voice: the other ranks log warnings and errors only
        logging.getLogger("blockfold").setLevel(logging.WARNING)
    log.info("rank %d of %d (%s, %s)", ranks.rank, ranks.world_size, backend, device)
    return ranks


def finish() -> None:
    """Leave the process group (every rank, after the job)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard(batches: list, ranks: Ranks) -> tuple[list, int]:
    """This rank's contiguous share of the calibration sequences (batches cut where a share ends) and
    the real tokens before it (for token samplers)."""
    if not ranks.several:
        return batches, 0
    total = sum(len(batch) for batch in batches)
    if total < ranks.world_size:
        raise BlockfoldError(f"{total} calibration sequence(s) cannot be shared by {ranks.world_size} processes: give "
                             "at least one sequence per process (--num-seqs) or fewer processes")
    bounds = np.linspace(0, total, ranks.world_size + 1).round().astype(int)
    first, last = int(bounds[ranks.rank]), int(bounds[ranks.rank + 1])
    mine, before, seen = [], 0, 0
    for batch in batches:
        rows = len(batch)
        low, high = max(first, seen) - seen, min(last, seen + rows) - seen
        if low < high:
            mine.append(batch if (low, high) == (0, rows) else batch.rows(low, high))
        before += int(batch.attention_mask[: max(0, min(rows, first - seen))].sum())
        seen += rows
    return mine, before


@contextlib.contextmanager
def _collective(what: str):
    """A collective of every rank: where it breaks (gloo and NCCL raise a plain RuntimeError when a peer
    dies or times out), the error says another process failed, so this rank does not report it as its own."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        raise PeerFailure(f"another process of this torchrun job failed or stopped answering while {what} "
                          f"({str(error).splitlines()[0][:200]}); nothing was saved: see that process's error, then "
                          "run the command again (finished calibration passes resume from their checkpoints)") from None


def all_agree(flag: bool) -> bool:
    """True when ``flag`` is true on every rank (a cached pass is used only if every rank has it)."""
    ranks = current()
    if not ranks.several:
        return flag
    flags = [None] * ranks.world_size
    with _collective("agreeing on a cached pass"):
        dist.all_gather_object(flags, bool(flag))
    return all(flags)


def reduce_observers(observers: list, ranks: Ranks) -> None:
    """Every observer's state replaced by that of all ranks: sums reduced onto rank 0 and broadcast
    (so every rank has rank 0's bits), sampled rows gathered in rank order."""
    if not ranks.several:
        return
    for observer in observers:
        state = observer_state(observer)
        sums = {name: state[name] for name in type(observer).SUMS}
        layouts = [None] * ranks.world_size
        with _collective("combining the statistics"):
            dist.all_gather_object(layouts, _layout(sums))
        if any(layout != layouts[0] for layout in layouts):
            raise BlockfoldError(f"the processes accumulated different {type(observer).__name__} statistics (a rank saw "
                                 "no tokens of some layer): give every process more calibration batches")
        reduced = _reduce_sums(sums)
        rows = {}
        for name in type(observer).ROWS:
            gathered = [None] * ranks.world_size
            with _collective("combining the statistics"):
                dist.all_gather_object(gathered, state[name])
            rows[name] = combine(gathered, rows=True)
        load_observer_state(observer, {**reduced, **rows})


def _layout(tree):
    """The structure of ``tree`` in iteration order (the order ranks reduce in must be the same)."""
    if isinstance(tree, dict):
        return [[key, _layout(value)] for key, value in tree.items()]
    if isinstance(tree, (list, tuple)):
        return [_layout(value) for value in tree]
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        return [type(tree).__name__, list(tree.shape), str(tree.dtype)]
    return type(tree).__name__


def _reduce_sums(sums: dict) -> dict:
    """Tensors and arrays reduced in place, numbers packed into one reduction; ``None`` (a sum no
    token has reached yet, the same on every rank: ``_layout`` checked) stays ``None``."""
    numbers: list[float] = []
    map_leaves(sums, lambda leaf: numbers.append(float(leaf)) if isinstance(leaf, (int, float)) else None)
    packed = torch.tensor(numbers, dtype=torch.float64)
    _reduce_in_place(packed)
    values = iter(packed.tolist())

    def reduce(leaf):
        if isinstance(leaf, torch.Tensor):
            _reduce_in_place(leaf)
            return leaf
        if isinstance(leaf, np.ndarray):
            tensor = torch.from_numpy(np.ascontiguousarray(leaf))
            _reduce_in_place(tensor)
            return tensor.numpy()
        if leaf is None:
            return None
        value = next(values)
        return int(round(value)) if isinstance(leaf, int) else value

    return map_leaves(sums, reduce)


def _reduce_in_place(tensor: torch.Tensor) -> None:
    group = _cpu_group if tensor.device.type == "cpu" else None
    with _collective("combining the statistics"):
        dist.reduce(tensor, dst=0, group=group)
        dist.broadcast(tensor, src=0, group=group)


__all__ = ["Ranks", "all_agree", "current", "finish", "init_from_environment", "launched", "reduce_observers", "shard"]
