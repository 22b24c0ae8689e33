"""Giving freed host memory back to the system between blocks.

A layer-by-layer pass frees and allocates the same large buffers once per block (a block's weights, its
activations, a layer's sums), of slightly different sizes. glibc's allocator serves buffers below its
mmap threshold -- which it raises as large buffers are freed -- from its heap, and a freed buffer there
stays mapped until the heap's top is free: with every block the process's anonymous memory crept upward
(+27% from 4 to 32 blocks of the Llama-3-8B width, eval/bench_prune_layerwise.py) though what it held
did not grow. `release_freed` asks the allocator to return the free pages (`malloc_trim(0)`, which since
glibc 2.8 also releases whole free pages inside the heap) where a block is offloaded, before a finished
layer's curves and its refit, and between the ridge's folds: a few milliseconds against a block's seconds,
where forcing every large buffer through mmap (`MALLOC_MMAP_THRESHOLD_`) cost 50% of the wall time.
Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():
    """glibc's `malloc_trim`, or None where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_freed() -> bool:
    """Return the allocator's free pages to the system; whether anything was (False where not glibc)."""
    fn = _trim()
    return bool(fn(0)) if fn is not None else False
