"""The plan of every scorer at one sparsity, with convention sensitivity (issue evidence).

    python -m eval.studies.scorer_plans gpt2-shakespeare llama-shakespeare [--target 0.25]

Prints, per model and scorer, the pruned heads as layer:head and, for redundancy
scorers, how many would change under the other convention. Writes nothing (`python -m eval compare` keeps
its output in runs/reference-plans.md).
"""

from __future__ import annotations

import argparse

from pruner.core import arch
from pruner.core.tables import markdown_table
from pruner.pruning.per_layer import CurveRequest
from pruner.pruning.scoring import SCORERS, get_scorer
from pruner.pruning.selection import SelectionConfig, convention_sensitivity, curve_key, select
from pruner.runs import context, pipeline
from pruner.runs.recipe_io import load_recipe


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--target", type=float, default=0.25)
    args = ap.parse_args()
    for name in args.models:
        recipe = load_recipe({"model": {"path": name}, "evaluation": {"data": "shakespeare:evaluation",
                                                                      "num_samples": 1}})
        session = context.prepare(recipe, progress=False)
        geom = arch.geometry(session.model)
        cfg = SelectionConfig(target=args.target)
        scorers = [get_scorer(s) for s in SCORERS]
        inputs = pipeline.scoring_inputs(session, scorers, CurveRequest(tuple(curve_key(s, geom, cfg) for s in scorers)),
                                         [session.recipe.surgery.compensation], progress=False)
        print(f"\n## {name}: {geom.n_layers} layers x {geom.n_heads} heads, {args.target:.0%} pruned")
        rows = []
        for s in SCORERS:
            scorer = get_scorer(s)
            plan = select(scorer, inputs, geom, cfg)
            sens = convention_sensitivity(scorer, inputs, geom, cfg, plan)
            heads = " ".join(f"{layer}:{h}" for layer, hs in plan.heads.items() for h in hs)
            note = "—" if sens is None else (f"{sens.changed}/{len(plan.entries)} change under {sens.other} "
                                             f"(out: {sens.only_this}, in: {sens.only_other})")
            rows.append([s, heads, note])
        print(markdown_table(["scorer", "pruned heads (layer:head)", "convention sensitivity"], rows), flush=True)


if __name__ == "__main__":
    main()
