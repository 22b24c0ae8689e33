"""Which plan to pick (issue 32): at the same parameter budget, a global-budget plan (layers differ; llama.cpp
runs it as `deci`) against the uniform plan (the same heads in every layer; vanilla everywhere).

    python -m eval.studies.plans                     # the table of docs/export.md#which-plan-to-pick
    python -m eval.studies.plans --targets 0.5 --repeats 2 --out runs/plans.json

The shipped Llama decoder, `recipes/llama-shakespeare.yaml` (its scorer, 64 x 128 calibration tokens, GQA
equal: every KV head kept, so both plans remove the same query heads' parameters), with `refit`
compensation (plain weights, so the uniform plan is a vanilla checkpoint at every target). For each target:
`pruner prune` twice per plan, evaluating on the evaluation plays and on `python-docs:evaluation` (64 windows
x 128 tokens each, perplexity paired with the unpruned model, 95% bootstrap CI), then `pruner bench RUN
--runtime llama.cpp` (float16 GGUF; prefill T=64 and 255, decode at batch 1 after a 32-token prompt, 64 new
tokens; `--repeats` interleaved rounds). gpt2-shakespeare and minilm-causal (the quickstart's recipe), the
other shipped decoders, have no uniform vanilla shape and no GGUF (their configs derive the head width from
hidden / heads): perplexity only, the uniform plan in the per-layer form.
Writes `--out` (default eval/results/studies/plans.json).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from eval.common import RESULTS, ROOT
from pruner.cli import main as cli
from pruner.core import environment
from pruner.evaluation.timing import BenchConfig

DATA = ("shakespeare:evaluation", "python-docs:evaluation")
SHAPES = {"uniform": ["selection.shape=servable", "selection.budget=layer"],
          "global": ["selection.shape=any", "selection.budget=global"]}
COMMON = ["surgery.compensation=refit", "surgery.mode=mask", "bench.enabled=false", "evaluation.latency=false"]


RECIPES = {"minilm-causal": "quickstart"}


def prune(recipe: str, out: Path, sets: list[str]) -> dict:
    args = ["prune", str(ROOT / "recipes" / f"{RECIPES.get(recipe, recipe)}.yaml"), "--out", str(out)]
    assert cli(args + [x for s in COMMON + sets for x in ("--set", s)]) == 0, (recipe, sets)
    m = json.loads((out / "metrics.json").read_text())
    heads = json.loads((out / "plan.json").read_text())["heads"]
    return {"ppl": m["evaluation"], "params_after": m["params_after"], "params_before": m["params_before"],
            "pruned_per_layer": {k: len(v) for k, v in heads.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="0.25,0.5")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "studies" / "plans.json"))
    args = ap.parse_args()
    from pruner.runs import folders

    records = []
    with tempfile.TemporaryDirectory(prefix="plan-choice-") as work:
        for recipe in ("llama-shakespeare", "gpt2-shakespeare", "minilm-causal"):
            for target in (float(t) for t in args.targets.split(",")):
                for shape, sets in SHAPES.items():
                    if recipe != "llama-shakespeare" and shape == "uniform":
                        sets = ["selection.shape=any", "selection.budget=layer"]  # no servable shape: per-layer form
                    rec = {"model": recipe, "target": target, "plan": shape}
                    for data in DATA:
                        out = Path(work) / f"{recipe}-{target}-{shape}-{data.split(':')[0]}"
                        rec[data] = prune(recipe, out, sets + [f"selection.target={target}",
                                                               f"evaluation.data={data}"])
                    if recipe == "llama-shakespeare":
                        cfg = BenchConfig(lengths=(64, 255), decode=((1, 32),), new_tokens=64, repeats=args.repeats)
                        res = folders.bench_run_llamacpp(out, cfg, "float16", progress=False)
                        rec["llama.cpp"] = res.to_dict()
                        print(res.markdown(), flush=True)
                    print(json.dumps({k: v for k, v in rec.items() if k != "llama.cpp"}), flush=True)
                    records.append(rec)
    Path(args.out).write_text(json.dumps({"records": records, "environment": environment.versions()}, indent=1)
                              + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
