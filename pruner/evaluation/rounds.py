"""Interleaved timing rounds, one fresh process per model and round: what the runtime benches share.

A runtime that is not PyTorch (ONNX Runtime GenAI, llama.cpp) is timed in a process of its own per model
and round -- `python -m MODULE TARGET CASES`, whose last stdout line is the JSON of its measurements -- so
a process's peak resident set is one model's, and base and pruned alternate, so a shared machine's load
falls on both alike. Round 0 warms the file cache and is not kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pruner.core import proc_status
from pruner.evaluation.timing import BenchConfig, Timings


def peak_kib() -> int:
    """This process's peak resident set (VmHWM), KiB (0 where /proc cannot say)."""
    return proc_status.status().get("VmHWM", 0) // 1024


def spawn(module: str, target: Path, cases: dict, runtime: str) -> tuple[dict, str]:
    """(the measurements `python -m module target cases` printed last, its stderr); a failed process is one
    line naming the runtime, the target and its last error line."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    done = subprocess.run([sys.executable, "-m", module, str(target), json.dumps(cases)], capture_output=True,
                          text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"timing {target} in {runtime} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def interleaved(targets: dict[str, Path], cfg: BenchConfig, decode: list[tuple[int, int]],
                one: Callable[[Path], dict], runtime: str, progress: bool = False) -> dict[str, Timings]:
    """`cfg.repeats` kept rounds over `targets` (plus the warm-up), each target's round measured by `one`
    (-> {"prefill": {"T": s}, "decode": {"BxP": s/step}, "peak_kib": ..., optionally "kv_per_token"})."""
    runs = {name: Timings({T: [] for T in cfg.lengths}, {c: [] for c in decode}, []) for name in targets}
    for r in range(cfg.repeats + 1):
        for name, target in targets.items():
            got = one(target)
            if progress:
                print(f"{runtime} round {r}/{cfg.repeats}: {name}", file=sys.stderr, flush=True)
            if r == 0:
                continue
            for T in cfg.lengths:
                runs[name].prefill[T].append(got["prefill"][str(T)])
            for b, p in decode:
                runs[name].decode[(b, p)].append(got["decode"][f"{b}x{p}"])
            runs[name].memory.append(got["peak_kib"] * 1024)
            if "kv_per_token" in got:
                runs[name].kv_per_token = got["kv_per_token"]
    return runs
