"""Reading the next block while one runs (`capture.read_ahead`): a layer-by-layer pass from a cold disk cache.

    python -m eval.bench.read_ahead /tmp/pruner-bench-layerwise/8b-all --windows 4 --length 256 --repeats 2

The folder is a checkpoint written one shard per block (`python -m eval.bench.layerwise 8b` writes the
Llama-3-8B shape there). Each case runs in a fresh process after the kernel's page cache is dropped
(`/proc/sys/vm/drop_caches`: needs root; without it the cache is warm and the script says so): the
layer-by-layer forward of `--windows` random windows (`pruner.core.layerwise`, blocks read lazily by
`pruner.checkpoints.lazy`), with the next block read ahead on a background thread and without. Cases
alternate (off, on, off, on, ...) so that a shared machine's load falls on both alike; the median is
reported, with the time a plain `cat` of the shards takes (the disk's share). Peak RSS per case: read
ahead holds one more block. Writes eval/results/bench/read_ahead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from eval.common import RESULTS, child_env, command_line, run_module
from pruner.core.proc_status import status


def drop_caches() -> bool:
    """Empty the page cache (root only); False where it cannot."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def case(folder: Path, windows: int, length: int, read_ahead: bool, threads: int) -> dict:
    """In this process: one layer-by-layer forward from disk."""
    import torch

    from pruner.checkpoints.lazy import lazy_model
    from pruner.core import arch
    from pruner.core.layerwise import first_block_calls, run_blocks

    torch.set_num_threads(threads)
    lazy = lazy_model(folder, "bfloat16")
    lazy.read_ahead = read_ahead
    ids = torch.randint(3, lazy.model.config.vocab_size, (windows, length), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    calls = first_block_calls(lazy.model, [(ids[i:i + 4], torch.ones_like(ids[i:i + 4])) for i in range(0, windows, 4)],
                              "cpu")
    run_blocks(lazy, calls, arch.geometry(lazy.model).n_layers, "cpu")
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_rss": status()["VmHWM"]}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--case", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    folder = Path(args.folder)
    if args.case:
        print(json.dumps(case(folder, args.windows, args.length, args.case == "on", args.threads)))
        return
    env = child_env(OMP_NUM_THREADS=str(args.threads))
    cold = drop_caches()
    t0 = time.perf_counter()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    cat_s = time.perf_counter() - t0
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            drop_caches()
            out = run_module(__spec__.name, [str(folder), "--case", mode, "--windows", str(args.windows),
                                             "--length", str(args.length), "--threads", str(args.threads)], env)
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"read ahead {mode}: {runs[mode][-1]['seconds']:.1f} s, peak RSS "
                  f"{runs[mode][-1]['peak_rss'] / 2**30:.2f} GiB", flush=True)
    med = {m: statistics.median(r["seconds"] for r in runs[m]) for m in runs}
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"\n{folder} ({size / 2**30:.1f} GiB), {args.windows} windows x {args.length} tokens, {args.threads} threads, "
          f"page cache {'dropped before each case' if cold else 'WARM (not root: could not drop it)'}")
    print(f"reading every shard alone: {cat_s:.1f} s ({size / cat_s / 2**30:.2f} GiB/s)")
    print(f"layer-by-layer forward: {med['off']:.1f} s without read ahead, {med['on']:.1f} s with "
          f"({med['off'] / med['on']:.2f}x faster; median of {args.repeats})")
    result = {"folder": str(folder), "bytes": size, "cold": cold, "cat_s": cat_s, "windows": args.windows,
              "length": args.length, "threads": args.threads, "runs": runs, "median_s": med,
              "command": command_line()}
    out = RESULTS / "bench" / "read_ahead.json"
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
