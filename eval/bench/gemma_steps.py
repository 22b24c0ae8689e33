"""How long each Gemma 3 270M step takes, and what pruning it buys: the commands a user runs, timed one by one.

    python -m eval.bench.gemma_steps                    # every step, into runs/gemma-steps/ (about 20 min, 2 cores)
    python -m eval.bench.gemma_steps --steps prune,gguf # some of them (a later step reads an earlier one's run)
    python -m eval.bench.gemma_steps --tables           # print the tables of the last results file

Each step is the command a user types (`pruner ...`), run in a fresh process on this machine's cores and timed
from start to exit; its peak resident memory is the child's own (`os.wait4`). The steps:

- `convert`: the first use of the extra's GGUF file -- de-quantized by transformers' reader and written into
  an empty cache (`PRUNER_CACHE` set to a temporary folder, so the cache a user already has is left alone);
- `prune`: `pruner prune recipes/gemma3-270m.yaml` -- calibration, fluctuation scores, refit, removal of half
  the query heads, the perplexity change on 64 windows, a vanilla `Gemma3ForCausalLM` saved, and the recipe's
  bench (both models in PyTorch, interleaved rounds);
- `gguf`: `pruner export RUN --format gguf --quantize q4_k_m` -- the float32 GGUF, llama.cpp's greedy tokens
  checked against PyTorch's, and llama.cpp's own Q4_K_M quantization with its perplexity;
- `bench-llama.cpp`: `pruner bench RUN --runtime llama.cpp` -- base and pruned as float16 GGUFs, timed there;
- `layers`: the same recipe with `selection.unit: layer` (`layer-cosine`, 2 of the 18 attention layers), whose
  bench shows the KV cache a removed layer frees (query heads free none: one KV head per layer).

Writes `--out` (default eval/results/bench/gemma_steps.json): each step's command, wall seconds, peak GiB and
the bench tables of the runs (the recipe's, in metrics.json; bench-llama.cpp.md).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from eval.common import GIB, RESULTS, ROOT, child_env, run_timed

RECIPE = "recipes/gemma3-270m.yaml"
STEPS = ("convert", "prune", "gguf", "bench-llama.cpp", "layers")
LAYERS = ["--set", "selection.unit=layer", "--set", "scorer.name=layer-cosine", "--set", "selection.target=2"]


def commands(work: Path) -> dict[str, list[str]]:
    """{step: argv}: what a user types for each step, its runs under `work`."""
    heads, layers = work / "heads", work / "layers"
    return {
        "convert": ["python", "-c", "from pruner.core import assets; print(assets.resolve('gemma-3-270m'))"],
        "prune": ["pruner", "prune", RECIPE, "--out", str(heads), "--overwrite"],
        "gguf": ["pruner", "export", str(heads), "--format", "gguf", "--quantize", "q4_k_m"],
        "bench-llama.cpp": ["pruner", "bench", str(heads), "--runtime", "llama.cpp", "--lengths", "128,512",
                            "--decode", "1x16", "--new-tokens", "32", "--repeats", "3"],
        "layers": ["pruner", "prune", RECIPE, "--out", str(layers), "--overwrite", *LAYERS],
    }


def timed(argv: list[str], env: dict[str, str]) -> dict:
    """Run `argv` to its end: wall seconds, the child's peak resident GiB, its exit code and its output's tail."""
    done = run_timed(argv, env, stdout=True)
    return {"command": " ".join(argv), "seconds": round(done.seconds, 1), "peak_gib": round(done.peak_bytes / GIB, 2),
            "returncode": done.returncode, "tail": done.output[-3000:]}


def run_steps(steps: list[str], work: Path) -> dict[str, dict]:
    """Each step in turn (the first failure stops); `convert` into an empty cache of its own."""
    cmds, out = commands(work), {}
    with tempfile.TemporaryDirectory(prefix="pruner-cache-") as cache:
        for step in steps:
            env = child_env(**({"PRUNER_CACHE": cache} if step == "convert" else {}))
            print(f"{step}: {' '.join(cmds[step])}", flush=True)
            out[step] = timed(cmds[step], env)
            print(f"  {out[step]['seconds']:.0f} s, peak {out[step]['peak_gib']:.2f} GiB, "
                  f"exit {out[step]['returncode']}", flush=True)
            if out[step]["returncode"]:
                print(out[step]["tail"], flush=True)
                break
    return out


def bench_tables(work: Path) -> dict[str, str]:
    """The bench tables of the runs: PyTorch for both (the recipe's bench, in metrics.json), llama.cpp for the
    head run (bench-llama.cpp.md)."""
    from pruner.evaluation.bench import BenchResult

    out = {}
    for name, run in (("heads, PyTorch", work / "heads"), ("2 layers, PyTorch", work / "layers")):
        metrics = run / "metrics.json"
        bench = json.loads(metrics.read_text()).get("bench") if metrics.exists() else None
        if bench:
            out[name] = BenchResult.from_dict(bench).table()
    if (work / "heads" / "bench-llama.cpp.md").exists():
        out["heads, llama.cpp"] = (work / "heads" / "bench-llama.cpp.md").read_text()
    return out


def tables(result: dict) -> str:
    lines = ["| step | command | wall | peak |", "|---|---|---|---|"]
    for step, r in result["steps"].items():
        lines.append(f"| {step} | `{r['command']}` | {r['seconds']:.0f} s | {r['peak_gib']:.2f} GiB |")
    for name, text in result.get("bench", {}).items():
        lines += ["", f"### {name}", "", text.strip()]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, in order: {', '.join(STEPS)}")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "gemma-steps", help="where the runs are written")
    p.add_argument("--out", type=Path, default=RESULTS / "bench" / "gemma_steps.json")
    p.add_argument("--tables", action="store_true", help="print the tables of --out and stop")
    a = p.parse_args()
    if a.tables:
        print(tables(json.loads(a.out.read_text())))
        return
    steps = a.steps.split(",")
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        p.error(f"unknown step {unknown[0]!r}: choose from {', '.join(STEPS)}")
    a.work.mkdir(parents=True, exist_ok=True)
    result = {"load_average_before": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count(),
              "steps": run_steps(steps, a.work)}
    result["bench"] = bench_tables(a.work)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    old = json.loads(a.out.read_text()) if a.out.exists() else {}
    result["steps"] = {**old.get("steps", {}), **result["steps"]}  # a partial rerun keeps the other steps' figures
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(tables(result))


if __name__ == "__main__":
    main()
