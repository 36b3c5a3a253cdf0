"""Where and in what precision a model runs: device, dtype, pipeline and offloading.

These settings say how a job runs, not what it does, so they live beside the recipe rather than in
it: the same recipe on a GPU in bfloat16 or on a CPU in float32 selects and fits from the same
statistics (always float64), and the manifest records which one ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from blockfold.errors import BlockfoldError
from blockfold.schema import Strict

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def saved_dtype(spec: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype a ``--save-dtype`` (name or dtype) asks for; None for ``auto`` or nothing: the source's."""
    if spec is None or spec == "auto":
        return None
    return DTYPES[spec] if isinstance(spec, str) else spec


class Execution(Strict):
    """How a job runs. ``auto`` values are resolved against the machine and the model."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N (or any torch device string)
    # precision of the weights while calibrating and evaluating; auto: float32 on a CPU, the
    # checkpoint's own floating dtype on an accelerator
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # precision of the saved checkpoint; auto: the source checkpoint's own
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # whole: the model resident on the device, batches run through it one after the other;
    # sequential: one decoder layer at a time, read from the checkpoint; auto: whole when it fits
    pipeline: Literal["auto", "whole", "sequential"] = "auto"
    # where activations wait between layers (the sequential pipeline, the refit, SLEB, LaCo, ...): auto
    # keeps them on the device while they take at most half of its free memory, then CPU memory, then disk
    offload: Literal["auto", "none", "cpu", "disk"] = "auto"
    offload_dir: str | None = None
    # sequences per chunk of the sequential pipeline (weights are read once per chunk), and the most
    # sequences in one forward of the whole pipeline; None: as many as a memory budget allows (a share
    # of a GPU's free memory, 512 MiB on a CPU; the whole pipeline: the batch, 96 MiB on a CPU)
    chunk_sequences: int | None = Field(None, ge=1)
    # bytes the statistics (float64 sums) may take; None: a quarter of the free memory where they live.
    # Beyond it, span candidates are screened with cheap statistics first (one more pass)
    stats_memory: int | None = Field(None, ge=1)
    # a folder where each pass's statistics are checkpointed as it advances, so the same job started
    # again resumes from there (the CLI uses .<out>.resume beside the output); None: no checkpoints
    resume_dir: str | None = None
    # seconds between checkpoints; None: at least 10 s and at most 5 % of the pass spent writing them
    checkpoint_seconds: float | None = Field(None, ge=0)
    # a folder of finished passes shared by jobs: a pass over the same weights, calibration tokens and
    # statistics is loaded from it instead of run
    stats_cache: str | None = None

    @model_validator(mode="after")
    def _offload_folder_needs_disk(self) -> "Execution":
        if self.offload_dir is not None and self.offload in ("none", "cpu"):
            raise ValueError(f"offload_dir (--offload-dir) is where activations spill to disk, and offload "
                             f"{self.offload} keeps them in memory: use --offload disk (or auto), or drop --offload-dir")
        return self


def resolve_device(spec: str) -> torch.device:
    """``auto`` → the first CUDA GPU when torch sees one, else the CPU; a device that is not there
    is one clear error naming what is."""
    # under torchrun each process takes the GPU of its local rank
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if spec == "auto":
        return torch.device("cuda", local_rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise BlockfoldError(f"--device {spec!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU build" if torch.version.cuda is None
                   else "torch sees no CUDA GPU (no driver, or CUDA_VISIBLE_DEVICES hides them)")
            raise BlockfoldError(f"--device {spec}: {why}; use --device cpu (or auto, which picks a GPU when there is one)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise BlockfoldError(f"--device {spec}: this machine has {count} CUDA GPU(s), cuda:0..cuda:{count - 1}")
        if device.index is None:
            device = torch.device("cuda", local_rank % count if "LOCAL_RANK" in os.environ else torch.cuda.current_device())
    elif device.type != "cpu" and device.index is None:
        device = torch.device(device.type, 0)  # tensors report an index: keep comparisons exact
    return device


# Element-wise functions that ATen hands to MKL's vector math library (VML) on CPU.
VECTOR_MATH_FUNCTIONS = ("cos", "sin", "tan", "acos", "asin", "atan", "exp", "expm1", "log", "log10", "log1p",
                         "sqrt", "rsqrt", "tanh", "erf", "erfc", "erfinv", "sigmoid", "reciprocal", "abs")


@functools.cache
def settle_vector_math() -> None:
    """Call each of MKL's vector math functions once, on one element and so on one thread, before any
    computation of a job can be the first call of one: MKL 2024.2, which torch's CPU wheels bundle,
    picks a function's kernel on its first call and, when that call runs on several threads, may run
    a low-accuracy kernel on one thread's chunk (pytorch/pytorch#188792; docs/scale-out.md).
    """
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in VECTOR_MATH_FUNCTIONS:
            getattr(one, name)()


def resolve_dtype(name: str, device: torch.device, source: torch.dtype | None = None) -> torch.dtype:
    """The weights' dtype for ``name``, checked by running a small matrix product in it on ``device``."""
    if name == "auto":
        dtype = torch.float32 if device.type == "cpu" or source is None or not source.is_floating_point else source
        dtype = dtype if dtype in DTYPE_NAMES else torch.float32
    else:
        dtype = DTYPES[name]
    check_dtype(dtype, device)
    return dtype


def check_dtype(dtype: torch.dtype, device: torch.device) -> None:
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise BlockfoldError(f"--dtype bfloat16: {torch.cuda.get_device_name(device)} has no bfloat16 support; "
                             "use --dtype float16 or float32")
    try:
        probe = torch.ones(4, 4, dtype=dtype, device=device)
        (probe @ probe).sum().item()
    except (RuntimeError, TypeError) as err:
        raise BlockfoldError(f"--dtype {DTYPE_NAMES.get(dtype, dtype)} does not run on {device} "
                             f"({str(err).splitlines()[0]}): use --dtype float32") from None


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now (available RAM for the CPU); None where torch cannot tell."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def resident_memory(field: str = "VmHWM") -> int | None:
    """This process's resident memory in bytes from Linux's ``/proc/self/status``: its peak (``VmHWM``, since
    start or since ``peak_memory`` reset it) or its current size (``VmRSS``); None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


@contextlib.contextmanager
def peak_memory(device: torch.device, record: dict, key: str):
    """Adds ``record[key]``: the most memory in use while the block runs, in bytes. On an accelerator the
    allocator's peak; on a CPU the process's peak resident set (Linux's VmHWM, reset as the block starts
    through ``/proc/self/clear_refs``), which counts everything the process holds, not the block alone.
    None where neither can be read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            device = None  # no way to start the count here
    try:
        yield
    finally:
        record[key] = None
        if device is not None and device.type == "cuda":
            record[key] = int(torch.cuda.max_memory_allocated(device))
        elif device is not None:
            record[key] = resident_memory()


def check_offload_dir(path: str | None, needed_bytes: int = 0) -> Path:
    """A folder to spill activations into: created inside ``path`` (or the system's temporary
    folder), after checking it exists, is writable and has room for ``needed_bytes``."""
    root = Path(path).expanduser() if path else Path(tempfile.gettempdir())
    if not root.is_dir():
        raise BlockfoldError(f"offload folder {root} does not exist: create it or pass another --offload-dir")
    if not os.access(root, os.W_OK | os.X_OK):
        raise BlockfoldError(f"offload folder {root} is not writable: pass a writable --offload-dir")
    free = shutil.disk_usage(root).free
    if needed_bytes and free < needed_bytes:
        raise BlockfoldError(f"offload folder {root} has {free / 2**20:,.0f} MiB free but the activations need "
                             f"{needed_bytes / 2**20:,.1f} MiB: free space, pass another --offload-dir, or use "
                             "--offload cpu or fewer calibration tokens")
    return root


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_free_memory() -> None:
    """Give the memory glibc holds free in its heaps back to the system (``malloc_trim``).

    A layer-by-layer run frees a block's weights and a chunk's activations after every layer. glibc
    raises its mmap threshold each time such a buffer is freed and then serves the next ones from its
    heaps, which it keeps: measured on a 6 GB model, the run's resident memory grew to 5.5 GB, 2.2 GB
    when the freed memory is trimmed after each layer. (Fixing the threshold instead made every large
    activation a fresh mapping and slowed the whole-model pass by 70 %.) No-op off glibc.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
