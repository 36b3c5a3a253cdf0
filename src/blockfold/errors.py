"""The one exception type users see: a single line naming the problem and the fix."""

from __future__ import annotations

#: what lowers the memory a compression needs, named by every out-of-memory error
MEMORY_FLAGS = ("--pipeline sequential (one layer at a time), --chunk-sequences N (fewer sequences per forward), "
                "--stats-memory SIZE (a smaller budget for the float64 sums), --offload cpu or disk (activations off "
                "the device), or fewer calibration tokens (--num-seqs, --seq-len)")


class BlockfoldError(Exception):
    """Bad input or an impossible request; the CLI prints it as one line and exits non-zero."""


class PeerFailure(BlockfoldError):
    """Another process of a torchrun job failed or stopped answering: a collective this one waited in broke."""


def out_of_memory(error: BaseException) -> BlockfoldError | None:
    """The one-line error for an allocation that failed (an accelerator's out-of-memory, or the CPU
    allocator's), naming the flags that lower memory; None for any other error."""
    import torch

    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, torch.OutOfMemoryError):
        where = "the accelerator"
    elif isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and "can't allocate memory" in text):
        where = "CPU memory"
    else:
        return None
    return BlockfoldError(f"out of memory in {where} ({text[:200]}): lower what this run needs with {MEMORY_FLAGS}")
