"""`pruner prune` end to end, layer by layer, on models larger than half this machine's memory (issues 24, 33).

    python -m eval.bench.prune_layerwise 8b                                   # Llama-3-8B shape, default recipe
    python -m eval.bench.prune_layerwise 8b --layers 12 --recipe lean --windows 8 --length 128
    python -m eval.bench.prune_layerwise 8b --sweep 4,8,12,32                 # peak against depth
    python -m eval.bench.prune_layerwise 70b-width --layers 2                 # the 70B width, cut to 2 blocks
    git worktree add /tmp/before 2efc1d6                                      # the code before selection curves
    python -m eval.bench.prune_layerwise 8b --layers 8 --recipe today --code /tmp/before   # its wall time

The checkpoint is the one `eval.bench.layerwise` writes (random bfloat16 weights from the public config, in
HF's usual ~2 GB shards, several blocks to a shard; built here if missing, never held in memory), with the
shipped Llama tokenizer copied beside it. `pruner prune` runs on it in a fresh process with `capture.onload:
sequential`: calibration, the base's and the plan's perplexity, compensation, the surgery and the written
model/ (with its reload check) all one block at a time. Recipes: `default` -- the default scorer and
compensation (refit-energy, refit with ridge auto over 4 folds), mode remove, the servable shape; `lean` -- the
issue's case: sink-aware, mean compensation, mode mask; `today` -- the settings this benchmark ran before
selection curves (refit-energy, mean compensation, ridge 0.1), for the wall time against that code (`--code`).

Memory is the child's anonymous resident memory (RssAnon, sampled every 10 ms from /proc: the memory-mapped
weights are page cache, which the kernel can drop) and its peak resident set (VmHWM, page cache included),
against the model's size on disk and against `pruner plan-memory`'s prediction of the whole run
(`pruner.runs.prune_memory.run_plan`), above the RssAnon of the prepared session (a separate process that
imports what `prune` imports, reads the tokenizer, the text and the model's skeleton, and computes nothing:
`session_anon`). Writes eval/results/bench/prune_layerwise/<case>.json (MODEL-LAYERS-RECIPE[-CODE][-LABEL],
e.g. `8b-32-lean`, `8b-4-today-before` with `--code /tmp/before`, `8b-32-lean-threshold16MiB` with
`--label threshold16MiB`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eval.bench.layerwise import write_checkpoint
from eval.common import RESULTS, ROOT, child_env, gib
from pruner.core.proc_status import Sampler

RECIPES = {
    "default": "scorer: {{name: refit-energy}}\nsurgery: {{mode: remove, compensation: refit, ridge: auto}}\n",
    "lean": "scorer: {{name: sink-aware}}\nsurgery: {{mode: mask, compensation: mean}}\n",
    "today": "scorer: {{name: refit-energy}}\nsurgery: {{mode: remove, compensation: mean, ridge: 0.1}}\n",
}
COMMON = """\
model: {{path: {folder}, dtype: bfloat16}}
capture: {{onload: sequential, metrics: [cosine]}}
calibration: {{data: shakespeare:calibration, length: {length}, num_samples: {windows}, batch_size: 4}}
evaluation: {{data: shakespeare:evaluation, length: {length}, num_samples: {eval_windows}, batch_size: 4, latency: false,
             bootstrap: 200}}
bench: {{enabled: false}}
sinks: {{mode: first}}
selection: {{target: {target}, gqa: equal}}
threads: {threads}
"""


def run_sampled(cmd: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `cmd`, sampling its memory every 10 ms: the peaks of RssAnon and VmRSS, the last VmHWM seen."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    fields = ("RssAnon", "VmRSS", "VmHWM", "RssFile")
    with Sampler(proc.pid, fields, every=0.01) as sampled:
        out, err = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), {k: sampled.peaks.get(k, 0) for k in fields}


def interpreter_anon() -> int:
    """RssAnon of a fresh interpreter with what `pruner prune` imports: not pruner's to predict."""
    code = ("import torch, transformers, pruner.cli, pruner.runs.pipeline, pruner.runs.folders, pruner.checkpoints.lazy;"
            "from pruner.core.proc_status import status; print(status()['RssAnon'])")
    line = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(line)


def session_anon(recipe: Path) -> int:
    """RssAnon of a fresh process once `pruner prune`'s session is prepared and before any compute: the imports,
    the tokenizer, the calibration and evaluation text and windows, the model's skeleton with the weights outside
    the blocks mapped (`pruner.runs.context.prepare`). The memory model predicts what the run adds to it."""
    code = ("import sys; from pruner.core.proc_status import status; from pruner.runs import context; "
            "from pruner.runs.recipe_io import load_recipe; "
            "s = context.prepare(load_recipe(sys.argv[1]), progress=False, whole_model=False); "
            "print(status()['RssAnon'])")
    line = subprocess.run([sys.executable, "-c", code, str(recipe)], capture_output=True, text=True,
                          check=True).stdout
    return int(line.strip().splitlines()[-1])


def predicted(recipe: Path) -> dict:
    """`pruner plan-memory`'s prediction of the whole run (sequential, on this CPU): the anonymous peak (the
    memory-mapped weights and refit columns left out, as RssAnon leaves them out) and each stage's."""
    from pruner.core import arch
    from pruner.pruning.selection import check_target
    from pruner.runs import prune_memory
    from pruner.runs.pipeline import selection_config
    from pruner.runs.recipe_io import load_recipe

    r = load_recipe(recipe)
    model = prune_memory.recipe_model(r)
    quota = check_target(arch.geometry(model), selection_config(r, model))[1]
    plan = prune_memory.run_plan(r, model, quota)
    return {"peak": plan.anonymous, "stage": plan.anonymous_stage.name,
            "stages": {s.name: plan.of(s, anonymous=True) for s in plan.stages}}


def _shards_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _prepare(args, layers: int | None) -> tuple[Path, str, Path, Path]:
    """The synthetic checkpoint (with a tokenizer), the case's tag, a fresh work folder and its recipe:
    (checkpoint folder, tag, work folder, recipe file)."""
    folder = write_checkpoint(args.model, layers, Path(args.work) / f"{args.model}-{layers or 'all'}-2gb", 2 * 10**9)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer for the text (ids below every vocab size)
        shutil.copyfile(ROOT / "pruner" / "assets" / "models" / "llama-shakespeare" / f, folder / f)
    tag = "-".join([args.model, str(layers or "all"), args.recipe, *([Path(args.code).name] if args.code else []),
                    *([args.label] if args.label else [])])
    work = Path(args.work) / f"prune-{tag}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    recipe = work / "recipe.yaml"
    recipe.write_text(COMMON.format(folder=folder, length=args.length, windows=args.windows, target=args.target,
                                    eval_windows=args.eval_windows, threads=args.threads) + RECIPES[args.recipe].format())
    return folder, tag, work, recipe


def case(args, layers: int | None) -> dict:
    """One prune of a synthetic checkpoint in a child process, its memory sampled: the record written."""
    folder, tag, work, recipe = _prepare(args, layers)
    t0 = time.perf_counter()
    env = child_env() if args.where else None  # --where: the sampler is this checkout's eval.bench.peak_where
    if args.code:  # another checkout's pruner first (this one's eval after it, for the sampler)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(args.code).resolve()), str(ROOT)])}
    where = ["-m", "eval.bench.peak_where", str(work / "where.json")] if args.where else []
    done, peaks = run_sampled([sys.executable, *where, "-m", "pruner.cli", "prune", str(recipe), "--out",
                               str(work / "run")], env)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    base, pruned = _shards_bytes(folder), _shards_bytes(work / "run" / "model")
    m = json.loads((work / "run" / "metrics.json").read_text())
    pred = predicted(recipe)
    interp, session = interpreter_anon(), session_anon(recipe)
    r = {"model": args.model, "layers": m["total_heads"] // json.loads((folder / "config.json").read_text())[
        "num_attention_heads"], "recipe": args.recipe, "windows": args.windows, "eval_windows": args.eval_windows, "length": args.length,
         "threads": args.threads, "base_bytes": base, "pruned_bytes": pruned, "shards": len(list(folder.glob("*.safetensors"))),
         "peak_anon": peaks["RssAnon"], "peak_rss": peaks["VmRSS"], "interpreter_anon": interp,
         "session_anon": session,
         "anon_over_model": peaks["RssAnon"] / base, "predicted": pred,
         "measured_over_predicted": (peaks["RssAnon"] - session) / pred["peak"],
         "wall_s": wall, "pruned_heads": m["pruned_heads"], "total_heads": m["total_heads"],
         "layout": m.get("model_layout"), "evaluation": m["evaluation"], "seconds_in_run": m["seconds"]}
    print(f"{args.model} ({r['layers']} layers, {r['shards']} shards), recipe {args.recipe}, {args.windows} windows x "
          f"{args.length} tokens, {args.threads} threads")
    print(f"  base checkpoint {gib(base):.2f} GiB; pruned {m['pruned_heads']}/{m['total_heads']} heads -> "
          f"{gib(pruned):.2f} GiB ({m.get('model_layout')})")
    print(f"  peak anonymous memory {gib(peaks['RssAnon']):.2f} GiB ({peaks['RssAnon'] / base:.1%} of the model), "
          f"peak RSS {gib(peaks['VmRSS']):.2f} GiB (page cache included); {wall:.0f} s")
    print(f"  above the prepared session ({gib(session):.2f} GiB; the interpreter with pruner imported "
          f"{gib(interp):.2f}): {gib(peaks['RssAnon'] - session):.2f} GiB; predicted "
          f"{gib(pred['peak']):.2f} GiB (in {pred['stage']}): measured/predicted {r['measured_over_predicted']:.2f}")
    out = RESULTS / "bench" / "prune_layerwise" / f"{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.where:
        r["where"] = json.loads((work / "where.json").read_text())
        print("  peak at: " + " <- ".join(reversed(r["where"]["stack"][-6:])))
        for stage, peak in sorted(r["where"]["stages"].items(), key=lambda kv: -kv[1]):
            print(f"    {stage}: {gib(peak - session):.2f} GiB above the session")
    out.write_text(json.dumps(r, indent=1) + "\n")
    print(f"wrote {out}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["8b", "70b-width", "1b"])
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many blocks")
    ap.add_argument("--sweep", default=None, help="comma-separated block counts: one run each, then a table")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="default")
    ap.add_argument("--windows", type=int, default=16, help="calibration windows (refit at the 8B shape needs "
                    "4096 tokens or more: the output projection's channels)")
    ap.add_argument("--eval-windows", type=int, default=4, help="evaluation windows")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/pruner-bench-layerwise")
    ap.add_argument("--where", action="store_true", help="also record where the run's anonymous memory peaks "
                    "(eval.bench.peak_where: the stack at the peak and each stage's peak, in the work folder's "
                    "where.json)")
    ap.add_argument("--code", default=None, help="run `pruner prune` from this checkout instead (PYTHONPATH), e.g. "
                    "a worktree of an earlier commit, for the wall time against it (the prediction is this code's)")
    ap.add_argument("--label", default=None, help="appended to the results file's name, e.g. threshold16MiB for a run "
                    "under MALLOC_MMAP_THRESHOLD_=16777216")
    args = ap.parse_args()
    if args.sweep is None:
        case(args, args.layers)
        return
    rows = [case(args, int(n)) for n in args.sweep.split(",")]
    first = rows[0]["peak_anon"]
    print("\n| layers | checkpoint | peak anonymous | of the model | vs the first | predicted | wall |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['base_bytes'] / 2**30:.2f} GiB | {r['peak_anon'] / 2**30:.2f} GiB | "
              f"{r['anon_over_model']:.1%} | {r['peak_anon'] / first - 1:+.1%} | "
              f"{r['predicted']['peak'] / 2**30:.2f} GiB | {r['wall_s']:.0f} s |")


if __name__ == "__main__":
    main()
