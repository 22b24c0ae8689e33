"""`pruner prune` end to end on a model larger than half this machine's memory, never whole in memory (issue 24).

    python eval/bench_prune_layerwise.py 8b                    # Llama-3-8B shape, 14.96 GiB in bfloat16
    python eval/bench_prune_layerwise.py 8b --scorer sink-aware --moments float32   # the lean settings
    python eval/bench_prune_layerwise.py 70b-width --layers 2  # the 70B width, cut to 2 blocks

The checkpoint is the one `eval/bench_layerwise.py` writes (random bfloat16 weights from the public config, one
safetensors shard per block; built here if missing, never held in memory), with the shipped Llama tokenizer
copied beside it. `pruner prune` runs on it in a fresh process with `capture.onload: sequential`: calibration,
the base's and the plan's perplexity, mean compensation, the surgery and the written model/ (with its reload
check) all one block at a time. Printed: the process's peak resident memory (ru_maxrss of the child) against
the model's size, wall time, and the pruned checkpoint on disk against the base. Writes
eval/results/bench_prune_layerwise-<case>.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_layerwise import write_checkpoint  # beside this script: python puts eval/ on the path

ROOT = Path(__file__).resolve().parents[1]

RECIPE = """\
model: {{path: {folder}, dtype: bfloat16}}
capture: {{onload: sequential, metrics: [cosine], moments: {moments}}}
calibration: {{data: shakespeare:calibration, length: {length}, num_samples: {windows}, batch_size: 4}}
evaluation: {{data: shakespeare:evaluation, length: {length}, num_samples: {windows}, batch_size: 4, latency: false,
             bootstrap: 200}}
bench: {{enabled: false}}
sinks: {{mode: first}}
scorer: {{name: {scorer}}}
selection: {{target: {target}, gqa: equal}}
surgery: {{mode: remove, compensation: mean, ridge: 0.1}}
threads: {threads}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["8b", "70b-width", "1b"])
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many blocks")
    ap.add_argument("--windows", type=int, default=4, help="calibration and evaluation windows")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scorer", default="refit-energy")
    ap.add_argument("--moments", default="float64", choices=["float64", "float32"])
    ap.add_argument("--work", default="/tmp/pruner-bench-layerwise")
    args = ap.parse_args()

    folder = write_checkpoint(args.model, args.layers, Path(args.work) / f"{args.model}-{args.layers or 'all'}")
    cfg = json.loads((folder / "config.json").read_text())
    if not cfg.get("architectures"):  # written by an older bench_layerwise.py: say it is a causal LM
        (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer for the text (ids below every vocab size)
        shutil.copyfile(ROOT / "pruner" / "assets" / "models" / "llama-shakespeare" / f, folder / f)
    work = Path(args.work) / f"prune-{args.model}-{args.layers or 'all'}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    recipe = work / "recipe.yaml"
    recipe.write_text(RECIPE.format(folder=folder, length=args.length, windows=args.windows, target=args.target,
                                    threads=args.threads, scorer=args.scorer, moments=args.moments))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pruner.cli", "prune", str(recipe), "--out", str(work / "run")],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    base, pruned = size(folder), size(work / "run" / "model")
    m = json.loads((work / "run" / "metrics.json").read_text())
    r = {"model": args.model, "layers": m["total_heads"] // json.loads((folder / "config.json").read_text())[
        "num_attention_heads"], "windows": args.windows, "length": args.length, "threads": args.threads,
         "scorer": args.scorer, "moments": args.moments,
         "base_bytes": base, "pruned_bytes": pruned, "peak_rss": peak, "peak_over_model": peak / base,
         "wall_s": wall, "pruned_heads": m["pruned_heads"], "total_heads": m["total_heads"],
         "layout": m.get("model_layout"), "evaluation": m["evaluation"], "seconds_in_run": m["seconds"]}
    gib = lambda n: n / 2**30  # noqa: E731
    print(f"{args.model} ({r['layers']} layers), {args.windows} windows x {args.length} tokens, {args.threads} threads, "
          f"scorer {args.scorer}, capture.moments {args.moments}")
    print(f"  base checkpoint {gib(base):.2f} GiB; pruned {m['pruned_heads']}/{m['total_heads']} heads -> "
          f"{gib(pruned):.2f} GiB ({m.get('model_layout')}, {1 - pruned / base:.1%} smaller)")
    print(f"  pruner prune, end to end: peak RSS {gib(peak):.2f} GiB ({peak / base:.0%} of the model), "
          f"{wall:.0f} s")
    tag = "" if (args.scorer, args.moments) == ("refit-energy", "float64") else f"-{args.scorer}-{args.moments}"
    out = ROOT / "eval" / "results" / f"bench_prune_layerwise-{args.model}-{args.layers or 'all'}{tag}.json"
    out.write_text(json.dumps(r, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
