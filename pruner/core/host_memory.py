"""Giving freed host memory back to the system between blocks.

A layer-by-layer pass frees and allocates the same large buffers once per block (a block's weights, its
activations, a layer's sums), of slightly different sizes. glibc's allocator serves buffers below its
mmap threshold -- which it raises as large buffers are freed -- from its heap, and a freed buffer there
stays mapped until the heap's top is free: with every block the process's anonymous memory crept upward
(+27% from 4 to 32 blocks of the Llama-3-8B width, eval/bench/prune_layerwise.py) though what it held
did not grow. `release_freed` asks the allocator to return the free pages (`malloc_trim(0)`, which since
glibc 2.8 also releases whole free pages inside the heap) where a block is offloaded, before a finished
layer's curves and its refit, and between the ridge's folds: a few milliseconds against a block's seconds.

Trimming gives back whole free pages, not the heap's address space: over many blocks the heap kept
growing around small long-lived allocations (+40 MB of heap a block at the 8B width, the finished layer's peak
+12 MB a block). `map_large_buffers` serves buffers of 4 MiB and more by mmap, so they leave the process when
freed and never fragment the heap (glibc raises its threshold up to 32 MiB as large buffers are freed); every
buffer over 1 MiB that way cost 50% of a lean run's wall time, over 4 MiB only the few large ones pay the page
faults (docs/scaling.md). A layer-by-layer run from disk sets it (`pruner.checkpoints.lazy.LazyBlocks`).
Recovery on a CPU, whose buffers keep their sizes step after step, wants the opposite: `reuse_buffers`.
Elsewhere than glibc they do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


@functools.cache
def _glibc(name: str, *argtypes):
    """glibc's function `name` taking `argtypes` and returning an int, or None where the C library is not glibc."""
    lib = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


# glibc's mallopt parameters (malloc.h), each with the environment variable a user sets it with
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
USER_SETS = {M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_", M_TOP_PAD: "MALLOC_TOP_PAD_",
             M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_", M_MMAP_MAX: "MALLOC_MMAP_MAX_"}
LARGE = 4 << 20  # bytes: a buffer this large or larger is mapped on its own (see the module docstring)
REUSE = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 256 << 20))


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's `mallopt` for each (parameter, value); whether all were set (False where not glibc, or where the
    user set one of them in the environment: theirs stand, and none of these is set)."""
    if any(USER_SETS[param] in os.environ for param, _ in settings):
        return False
    fn = _glibc("mallopt", ctypes.c_int, ctypes.c_int)
    return fn is not None and all(bool(fn(param, value)) for param, value in settings)


def map_large_buffers(threshold: int = LARGE) -> bool:
    """Serve every buffer of `threshold` bytes or more by its own mmap, for the rest of the process (a fixed
    threshold: glibc no longer raises it); whether it was set (False where not glibc, or where the user set
    `MALLOC_MMAP_THRESHOLD_`: theirs stands)."""
    return _mallopt((M_MMAP_THRESHOLD, threshold))


def reuse_buffers() -> bool:
    """Serve every buffer from the heap and keep the heap's free top, for the rest of the process: a loop that
    allocates the same large buffers every step (recovery's training, generation and evaluation: logits,
    activations, gradients) then reuses them, where each would otherwise be a fresh mapping of zeroed pages
    (the quick start's recovery: 40 million page faults, 90 s of its 282 s in the kernel; 125 s with this,
    the same weights, peak RSS 2.9 GB against 2.1). The opposite of `map_large_buffers`, for a process whose
    buffers keep their sizes. Whether it was set (False where not glibc, or where the user set one of
    `MALLOC_MMAP_MAX_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`: theirs stand)."""
    return _mallopt(*REUSE)


def can_release() -> bool:
    """Whether `release_freed` can return free pages here (the C library is glibc)."""
    return _glibc("malloc_trim", ctypes.c_size_t) is not None


def release_freed() -> bool:
    """Return the allocator's free pages to the system; whether anything was (False where not glibc)."""
    fn = _glibc("malloc_trim", ctypes.c_size_t)
    return bool(fn(0)) if fn is not None else False
