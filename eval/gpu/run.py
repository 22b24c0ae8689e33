"""Every GPU measurement in one go on a CUDA machine (one GPU; nothing is downloaded), results and logs in OUT_DIR.

    python -m eval.gpu.run OUT_DIR [PART ...]      (default: every part; ~12 min on an H200)
    python -m eval gpu                             (OUT_DIR = eval/results/gpu)

  bench     calibration of a Llama-3-8B-shaped random model, bfloat16, 128 windows x 2048 tokens in batches of 8,
            against plain forward passes over the same windows, and the gradient scorer's pass (eval.bench.calibrate);
  batch4    the same model, 32 windows in batches of 4: what a smaller batch does to calibration's memory;
  profile   the top operators of one calibrate batch (8 x 2048) of that model;
  small     the CPU table's sizes (Qwen2.5-0.5B and Llama-3.2-1B shapes, 16 x 1024) on the GPU;
  check     the pipeline on the GPU gives the CPU's plans and perplexities, and the compact export reload-checks
            there (eval.gpu.check, the shipped from-scratch GPT-2 and Llama);
  recovery  recovery on the GPU gives the CPU's validation KL (the shipped Llama), then the Llama-3.2-1B shape, full
            and lora, teacher resident and cached: tokens/s and peak memory against the estimate (eval.gpu.recovery).

Writes OUT_DIR/PART.json and OUT_DIR/PART.log (the part's output without transformers' progress lines); a part that
fails or runs past its time limit is reported in its log and the next part runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from eval.common import child_env

CALIBRATE = ("eval.bench.calibrate", "--device", "cuda", "--threads", "8")
EIGHT_B = ("--model", "llama-3-8b", "--length", "2048")
PARTS = {  # part -> (time limit in seconds, `python -m` arguments before --out)
    "bench": (300, (*CALIBRATE, *EIGHT_B, "--windows", "128", "--repeats", "2")),
    "batch4": (300, (*CALIBRATE, *EIGHT_B, "--windows", "32", "--batch-size", "4", "--cases", "plain,calibrate")),
    "profile": (300, (*CALIBRATE, *EIGHT_B, "--windows", "8", "--cases", "calibrate", "--profile")),
    "small": (300, (*CALIBRATE, "--repeats", "3")),
    "check": (240, ("eval.gpu.check",)),
    "recovery": (400, ("eval.gpu.recovery",)),
}
NOISE = re.compile(r"Loading weights|Writing model shards")


def run_part(part: str, out: Path) -> int:
    """One part in a child process, its output shown and logged as it comes; killed past its time limit (with the
    processes it started: its own session)."""
    limit, args = PARTS[part]
    env = child_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", *args, "--out", str(out / f"{part}.json")]
    with open(out / f"{part}.log", "w") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                                 text=True, env=env, start_new_session=True) as proc:
        timer = threading.Timer(limit, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in proc.stdout:
                if not NOISE.search(line):
                    print(line, end="", flush=True)
                    log.write(line)
        finally:
            timer.cancel()
        if proc.wait() != 0:
            log.write(f"{part}: exit {proc.returncode}" + (f" (killed after {limit} s)" if proc.returncode < 0 else "")
                      + "\n")
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    out, parts = Path(argv[0]), argv[1:] or list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        sys.exit(f"unknown part {unknown[0]!r}; valid: {', '.join(PARTS)}")
    out.mkdir(parents=True, exist_ok=True)
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    failed = []
    for part in parts:
        print(f"== {part}  {time.strftime('%H:%M:%S', time.gmtime())}", flush=True)
        if run_part(part, out):
            failed.append(part)
    print(f"== done  {time.strftime('%H:%M:%S', time.gmtime())}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
