"""Show that a refactoring changed no run: every shipped offline recipe pruned by this checkout and by another
revision gives the same plan, the same metrics and the same checkpoint bytes.

    python scripts/same_runs.py --base main                       # quickstart, llama/gpt2-shakespeare, minilm-encoder
    python scripts/same_runs.py --base main --recipes quickstart --work /tmp/same-runs

The base revision is exported with `git archive` into the work folder and run from there (PYTHONPATH first, so
its own pruner is imported); both runs get the same small settings (`--set`, below) so that a recipe takes
seconds. Compared: plan.json and metrics.json (less the wall-clock keys), and the SHA-256 of every file under
model/. Prints one line per recipe and exits 1 when any differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("quickstart", "llama-shakespeare", "gpt2-shakespeare", "minilm-encoder")  # the ones that need no Hub
SMALL = ["calibration.num_samples=8", "evaluation.num_samples=8", "evaluation.bootstrap=20",
         "evaluation.latency=false", "bench.enabled=false"]
TIMES = {"seconds", "latency_ms_before", "latency_ms_after"}  # wall clock: never equal twice


def prune(code: Path, recipe: str, out: Path) -> None:
    """`pruner prune` of a shipped recipe with `code`'s pruner into `out`."""
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pruner.cli", "prune", str(ROOT / "recipes" / f"{recipe}.yaml"), "--out", str(out),
           "--overwrite", *[a for s in SMALL for a in ("--set", s)]]
    done = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{recipe} with {code}: exit {done.returncode}\n{done.stderr[-2000:]}")


def fingerprint(run: Path) -> dict:
    """What must not change: the plan, the metrics but their timings, and every byte of model/."""
    metrics = {k: v for k, v in json.loads((run / "metrics.json").read_text()).items() if k not in TIMES}
    files = {str(f.relative_to(run)): hashlib.sha256(f.read_bytes()).hexdigest()
             for f in sorted((run / "model").rglob("*")) if f.is_file()}
    return {"plan": json.loads((run / "plan.json").read_text()), "metrics": metrics, "model": files}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare with (main, a commit)")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--work", default="/tmp/pruner-same-runs")
    args = ap.parse_args()
    work = Path(args.work)
    base = work / "base"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    differ = 0
    for recipe in args.recipes.split(","):
        got = {}
        for name, code in (("base", base), ("this", ROOT)):
            prune(code, recipe, work / f"{recipe}-{name}")
            got[name] = fingerprint(work / f"{recipe}-{name}")
        parts = [k for k in got["this"] if got["this"][k] != got["base"][k]]
        differ += bool(parts)
        print(f"{recipe}: " + (f"differs in {', '.join(parts)}" if parts else
                               f"same plan, metrics and {len(got['this']['model'])} model/ files"), flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
