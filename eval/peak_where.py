"""Where a Python program's anonymous memory peaks: run it with a thread that samples RssAnon every 2 ms and keeps
the main thread's stack at each new peak (torch releases the GIL in its kernels, so the sample lands inside the
operation that allocated). Used by `eval/bench_prune_layerwise.py --where` to check the memory model's parts.

    python eval/peak_where.py OUT.json -m pruner.cli prune RECIPE --out RUN

OUT.json: the peak in bytes, its stack (innermost last), and the largest peak seen under each top-level stage
function of the run (the first frame under `pruner.runs.pipeline.run`), so each stage's peak can be read off.
"""

from __future__ import annotations

import json
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path


def _anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
    return 0


def _stage(frames: list) -> str:
    """The function under `pipeline.run` (or the innermost pruner frame if the run has not started)."""
    names = [f"{Path(f.filename).stem}.{f.name}" for f in frames if "/pruner/" in f.filename]
    if "pipeline.run" in names:
        i = names.index("pipeline.run")
        return names[i + 1] if i + 1 < len(names) else names[i]
    return names[-1] if names else "startup"


def main() -> None:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    if argv[:1] != ["-m"]:
        sys.exit("usage: peak_where.py OUT.json -m MODULE ARGS...")
    main_id = threading.main_thread().ident
    state = {"peak": 0, "stack": [], "stages": {}, "done": False}

    def sample():
        while not state["done"]:
            now = _anon()
            frame = sys._current_frames().get(main_id)
            if frame is not None:
                frames = traceback.extract_stack(frame)
                stage = _stage(frames)
                state["stages"][stage] = max(state["stages"].get(stage, 0), now)
                if now > state["peak"]:
                    state["peak"] = now
                    state["stack"] = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames
                                      if "/pruner/" in f.filename or "torch" in f.filename][-14:]
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    sys.argv = [argv[1], *argv[2:]]
    try:
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    else:
        code = 0
    finally:
        state["done"] = True
        t.join()
        out.write_text(json.dumps({k: state[k] for k in ("peak", "stack", "stages")}, indent=1) + "\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
