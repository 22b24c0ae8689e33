"""On a CUDA machine: the whole pipeline gives the CPU's answers, and the compact export reloads there.

    python -m eval.gpu.check [--out FILE.json]    (needs a GPU; about a minute)
    python -m eval.gpu.check --device cpu         (the checks' code path on a CPU: both sides on the CPU)

For each shipped from-scratch decoder (GPT-2 with an output bias, Llama with GQA and
none), one `pruner.compare` per device over every scorer x 25% x {zero, mean, refit},
float32, the recipe's windows: the chosen heads must be the same and the perplexity
changes equal to 1e-3 (GPU reductions run in another order, so not to the last bit).
Then one `pruner.prune` on the GPU with `surgery.mode: remove` and refit compensation,
saved: the save reload-checks the compact model on the GPU (logits and greedy tokens).
Prints one line per check and `gpu_check: N failed`, writes `--out` (default: a temporary folder's gpu_check.json);
exits 1 if any failed. Each check runs whatever the others did, so one run reports everything.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

from eval.common import ROOT
from eval.common import shipped_plays as plays

RECIPES = ("llama-shakespeare", "gpt2-shakespeare")


def compare_on(recipe: str, device: str):
    import pruner

    t0 = time.perf_counter()
    c = pruner.compare(recipe=str(ROOT / "recipes" / f"{recipe}.yaml"), data=plays("calibration"),
                       eval_data=plays("evaluation"), sparsities=(0.25,), progress=False, device=device)
    return {(r["scorer"], r["compensation"]): r for r in c.records}, time.perf_counter() - t0


def check_compare(recipe: str, device: str) -> list[str]:
    cpu, t_cpu = compare_on(recipe, "cpu")
    gpu, t_gpu = compare_on(recipe, device)
    bad = []
    for key, a in cpu.items():
        b = gpu[key]
        if "error" in a or "error" in b:
            if a.get("error") != b.get("error"):
                bad.append(f"{key}: cpu {a.get('error')!r} vs cuda {b.get('error')!r}")
            continue
        if a["heads"] != b["heads"]:
            bad.append(f"{key}: different heads")
        if abs(a["delta"] - b["delta"]) > 1e-3 or abs(a["base"] - b["base"]) > 1e-3:
            bad.append(f"{key}: delta {a['delta']:.5f} vs {b['delta']:.5f}, base {a['base']:.4f} vs {b['base']:.4f}")
    worst = max((abs(a["delta"] - gpu[k]["delta"]) for k, a in cpu.items() if "delta" in a), default=0.0)
    print(f"compare {recipe}: {len(cpu)} plans, cpu {t_cpu:.1f} s, cuda {t_gpu:.1f} s, "
          f"max |delta_cpu - delta_cuda| {worst:.2e}" + ("" if not bad else f"; MISMATCH: {bad}"), flush=True)
    return bad


def check_prune_export(recipe: str, out: Path, device: str) -> list[str]:
    import pruner

    runs = []
    for i, dev in enumerate(("cpu", device)):
        t0 = time.perf_counter()
        r = pruner.prune(recipe=str(ROOT / "recipes" / f"{recipe}.yaml"), data=plays("calibration"),
                         eval_data=plays("evaluation"), device=dev, progress=False, compensation="refit",
                         mode="remove")
        folder = r.save(out / f"prune-{recipe}-{i}-{dev}", overwrite=True)  # model/: compact, reload-checked on `dev`
        runs.append((r.metrics["evaluation"], time.perf_counter() - t0, r.plan.heads))
    pruner.load(folder / "model")  # the saved compact model loads back (pruner's own loader, on the CPU)
    (a, t_cpu, h_cpu), (b, t_gpu, h_gpu) = runs
    bad = [] if h_cpu == h_gpu else ["different heads"]
    if abs(a["delta"] - b["delta"]) > 1e-3:
        bad.append(f"delta {a['delta']:.5f} (cpu) vs {b['delta']:.5f} (cuda)")
    print(f"prune {recipe} (remove + refit, saved, reload-checked): cpu {a['base']:.3f} -> {a['base'] + a['delta']:.3f} "
          f"in {t_cpu:.1f} s; {device} {b['base']:.3f} -> {b['base'] + b['delta']:.3f} in {t_gpu:.1f} s"
          + ("" if not bad else f"; MISMATCH: {bad}"), flush=True)
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="the JSON written (default: a temporary folder's gpu_check.json)")
    ap.add_argument("--device", default="cuda", help="the device checked against the CPU (cpu: checks the script)")
    args = ap.parse_args(argv)
    import torch
    import transformers

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device")
        return 1
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {where}", flush=True)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp()) / "gpu_check.json"
    runs = Path(tempfile.mkdtemp())  # the pruned run folders
    failed, report = 0, {}
    for recipe in RECIPES:
        for name, fn, extra in (("compare", check_compare, ()), ("prune-export", check_prune_export, (runs,))):
            try:
                bad = fn(recipe, *extra, args.device)
            except Exception:  # report and go on: one GPU session must show every failure
                bad = [traceback.format_exc()]
                print(f"{name} {recipe}: FAILED\n{bad[0]}", flush=True)
            failed += bool(bad)
            report[f"{name}/{recipe}"] = bad
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"gpu_check: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
