"""Host memory layer by layer: where a layer-by-layer `pruner prune` holds its anonymous memory, block after block.

    python -m eval.bench.heap_by_layer RECIPE RUN_DIR [--out FILE.jsonl]
    python -m eval.bench.heap_by_layer RECIPE RUN_DIR --out eval/results/bench/heap_by_layer/8b-32-default.jsonl

Runs `pruner prune RECIPE --out RUN_DIR` in this process and records, as each layer finishes
(`pruner.pruning.per_layer.LayerFinisher.finish`): RssAnon when the layer's sums are complete and its peak
during the curves and the refit ("max_inside") and during the next block's batches ("max_between"); the
live tensors in anonymous memory (memory-mapped weights and file-backed compensations left out); and
glibc's heap (`mallinfo2`: the heap's size, what is in use, what is free inside it, what is mapped on its
own). A heap that grows while what is in use does not is fragmentation: the allocator cannot reuse its
free space for the next block's buffers. Compare `MALLOC_MMAP_THRESHOLD_=...` runs against the default
(pruner sets 4 MiB itself in a layer-by-layer run since 2026-12-03: `pruner.core.host_memory`).
Linux with glibc only. Prints one JSON line per event and writes them to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
from pathlib import Path

import torch

from pruner.core.proc_status import Sampler, status

GIB = 2**30


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap() -> dict:
    """glibc's heap in GiB: its size (every arena), in use, free inside it, and mapped on its own."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return {"heap": m.arena / GIB, "in_use": m.uordblks / GIB, "free_in_heap": m.fordblks / GIB,
            "mapped": m.hblkhd / GIB}


def live_anonymous_tensors() -> int:
    """Bytes of the live CPU tensors whose storage is in anonymous memory (not in a file mapping)."""
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        p = line.split()
        a, b = (int(x, 16) for x in p[0].split("-"))
        maps.append((a, b, p[5] if len(p) > 5 else ""))
    seen, total = set(), 0
    for o in gc.get_objects():
        if not isinstance(o, torch.Tensor) or o.device.type != "cpu":
            continue
        st = o.untyped_storage()
        k = st.data_ptr()
        if k in seen or k == 0:
            continue
        seen.add(k)
        if next((p for a, b, p in maps if a <= k < b), "?") in ("", "[heap]"):
            total += st.nbytes()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from pruner.pruning import per_layer

    sampler = Sampler()  # RssAnon every 2 ms; its peak restarts at every record
    lines = []

    def record(layer: int, at: str, **extra) -> None:
        row = {"layer": layer, "at": at, "anon": status()["RssAnon"] / GIB,
               "live_anonymous_tensors": live_anonymous_tensors() / GIB, **heap(), **extra}
        lines.append(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
        print(lines[-1], file=sys.stderr, flush=True)

    finish = per_layer.LayerFinisher.finish

    def probed(self, layer, sums, residual):
        record(layer, "sums complete", max_between=sampler.peaks.pop("RssAnon", 0) / GIB)
        out = finish(self, layer, sums, residual)
        record(layer, "curves and refit done", max_inside=sampler.peaks.pop("RssAnon", 0) / GIB)
        return out

    per_layer.LayerFinisher.finish = probed
    from pruner.cli import main as cli

    with sampler:
        code = cli(["prune", args.recipe, "--out", args.run_dir, "--overwrite"])
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
