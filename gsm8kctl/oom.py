"""Out of memory: an expected event on a shared GPU, not an internal error.

A GPU is often shared (several seeds at once, other programs), so an allocation can fail at any
phase. Where work can be split smaller without changing what is computed, the phase retries smaller
a bounded number of times: the trainer halves its micro-batch token budget (the same samples feed
the same optimizer step; only the split into micro-batches differs), scoring halves its chunk, the
sampler halves its slots (the KV pool is made again) or its batch, and runs the attempts not yet
finished again (each attempt's tokens come from its own seed). A halved size holds for the rest of
its phase; the next phase tries twice it, up to the configured size, since a neighbour's peak
passes. Each retry is one warning line, and an entry in the iteration's `warnings` in the loop's
metrics.jsonl. When the smallest size fails too, `OutOfMemory` ends the command with exit 1 and one
line: what this process holds, what others hold, and that the same command resumes.
"""

from __future__ import annotations

import gc

from gsm8kctl.errors import Stopped
from gsm8kctl.progress import warn


class OutOfMemory(Stopped):
    """The smallest size still did not fit: exit 1 with `describe()`'s line."""


# What CUDA libraries say when they cannot allocate: their own handles and workspaces lie outside
# torch's allocator, so on a full GPU they fail with a RuntimeError, not an OutOfMemoryError.
ALLOC_FAILED = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
                "cusolver_status_alloc_failed", "cufft_alloc_failed", "cudaerrormemoryallocation")


def is_oom(exc: BaseException) -> bool:
    """A failed allocation: torch's OutOfMemoryError (CUDA), a MemoryError, or a RuntimeError of
    CUDA or one of its libraries (cuBLAS, cuDNN, ...) that says it could not allocate."""
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in message for marker in ALLOC_FAILED)


# Outside torch's allocator: the CUDA context and the libraries' handles and workspaces.
OUTSIDE_ALLOCATOR = 2**30


def allocator_fraction(share: float, total: int) -> float | None:
    """The cap on torch's allocator for a process with `share` of a GPU of `total` bytes: its
    share less what lies outside the allocator; None (no cap) for the whole GPU."""
    if share >= 1:
        return None
    return max(0.01, (share * total - OUTSIDE_ALLOCATOR) / total)


def keep_to_share(share: float) -> None:
    """Under gpu_memory_share < 1, cap torch's allocator at this process's share of the GPU. A peak
    above it then fails in this process, as an out-of-memory that is retried smaller, instead of
    taking the memory of the loops beside it (whose own peaks would then fail)."""
    import torch

    if share >= 1 or not torch.cuda.is_available():
        return
    fraction = allocator_fraction(share, torch.cuda.mem_get_info()[1])
    torch.cuda.set_per_process_memory_fraction(fraction)


def retried(message: str) -> None:
    """A retry at a smaller size: one warning line now, and an entry in the iteration's
    `warnings` when the loop runs this phase."""
    warn(message, record=True)


def release() -> None:
    """Give back what the failed attempt left allocated, before a smaller one."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe(where: str) -> str:
    """One line for the user: where it failed, who holds the GPU's memory, what to do."""
    held = ""
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            ours = torch.cuda.memory_reserved()
            others = max(0, total - free - ours)
            held = (f"; this process holds {ours / 2**30:.1f} GiB, other processes {others / 2**30:.1f} GiB "
                    f"of the GPU's {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)")
    except Exception:  # noqa: BLE001 - the message must come out even if the driver will not answer
        pass
    return (f"out of memory in {where}{held}. Free memory (other programs on the GPU) or lower "
            "finetune.token_budget, filter.score_token_budget, sampling.kv_memory_fraction or gpu_memory_share, then run "
            "the same command again: it resumes where it stopped")
