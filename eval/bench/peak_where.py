"""Where a Python program's anonymous memory peaks: run it with a thread that samples RssAnon every 2 ms and keeps
the main thread's stack at each new peak (torch releases the GIL in its kernels, so the sample lands inside the
operation that allocated). Used by `python -m eval.bench.prune_layerwise --where` to check the memory model's parts.

    python -m eval.bench.peak_where OUT.json -m pruner.cli prune RECIPE --out RUN

Writes OUT.json: the peak in bytes, its stack (innermost last), and the largest peak seen under each top-level stage
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

from pruner.core.proc_status import status


def _stage(frames: list) -> str:
    """The function under `pipeline.run` (or the innermost pruner frame if the run has not started)."""
    names = [f"{Path(f.filename).stem}.{f.name}" for f in frames if "/pruner/" in f.filename]
    if "pipeline.run" in names:
        i = names.index("pipeline.run")
        return names[i + 1] if i + 1 < len(names) else names[i]
    return names[-1] if names else "startup"


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    if argv[:1] != ["-m"]:
        sys.exit("usage: python -m eval.bench.peak_where OUT.json -m MODULE ARGS...")
    main_id = threading.main_thread().ident
    state = {"peak": 0, "stack": [], "stages": {}, "done": False}

    def sample():
        while not state["done"]:
            now = status().get("RssAnon", 0)
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
