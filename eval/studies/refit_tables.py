"""Issue 14's target checks from the compare runs of `python -m eval refit-compare` (and `refit-quickstart`).

    python -m eval.studies.refit_tables [--default sink-aware,refit] [--model quickstart]

Reads eval/results/studies/refit/compare-<recipe>.json and prints, at 25 / 40 / 50% of heads:
1. refit vs mean for the default scorer and for FLAP (`fluctuation`);
2. the default scorer + compensation pair vs 1/4 of the best baseline's zero-ablation increase;
3. the default pair vs every baseline given the same compensation;
and, for every recipe found, each scorer's best compensation per sparsity. Writes nothing (the driver keeps
the quick start's checks in eval/results/studies/refit/targets-quickstart.md).
"""

from __future__ import annotations

import argparse
import json

from eval.common import RESULTS
from pruner.core.tables import change_cell, markdown_table

COMPARES = RESULTS / "studies" / "refit"  # compare-<recipe>.json
OURS = ("sink-aware", "refit-energy")  # not baselines
TARGETS = (0.25, 0.4, 0.5)


def load(recipe: str) -> dict:
    records = json.loads((COMPARES / f"compare-{recipe}.json").read_text())
    return {(r["scorer"], r["sparsity"], r["compensation"]): r for r in records if "error" not in r}


def checks(cell: dict, scorer: str, comp: str) -> None:
    baselines = sorted({s for s, _, _ in cell} - set(OURS))
    print("\n1. refit vs mean (perplexity change [95% CI]); target: refit <= mean\n")
    rows = []
    for s in dict.fromkeys([scorer, "fluctuation"]):
        rows += [[s, c] + [change_cell(cell.get((s, t, c))) for t in TARGETS] for c in ("mean", "refit")]
        ok = [cell[(s, t, "refit")]["delta"] <= cell[(s, t, "mean")]["delta"] for t in TARGETS
              if (s, t, "refit") in cell and (s, t, "mean") in cell]
        rows.append([s, "refit <= mean?"] + ["yes" if x else "**no**" for x in ok])
    print(markdown_table(["scorer", "compensation"] + [f"{t:g}" for t in TARGETS], rows))
    print(f"\n2. default pair `{scorer}` + `{comp}` vs 1/4 of the best baseline's zero-ablation increase\n")
    rows = []
    for t in TARGETS:
        mine = cell.get((scorer, t, comp))
        zeros = [(cell[(b, t, "zero")]["delta"], b) for b in baselines if (b, t, "zero") in cell]
        if mine is None or not zeros:
            continue
        best, name = min(zeros)
        rows.append([f"{t:g}", change_cell(mine), f"{best:+.2f} ({name})", f"{best / 4:+.2f}",
                     "yes" if mine["delta"] <= best / 4 else "**no**"])
    print(markdown_table(["sparsity", "default pair", "best baseline, zero", "1/4 of it", "met?"], rows))
    print(f"\n3. default pair vs every baseline with `{comp}` compensation (target: no worse than any)\n")
    rows = []
    for t in TARGETS:
        mine = cell.get((scorer, t, comp))
        others = [(cell[(b, t, comp)]["delta"], b) for b in baselines if (b, t, comp) in cell]
        if mine is None or not others:
            continue
        best, name = min(others)
        r = cell[(name, t, comp)]
        gap = mine["delta"] - best
        verdict = "yes" if gap <= 0 else f"**no** (by {gap:.2f})"
        rows.append([f"{t:g}", change_cell(mine), f"{name}: {change_cell(r)}", verdict])
    print(markdown_table(["sparsity", "default pair", "best baseline with the same compensation", "met?"], rows))


def best_compensation(recipe: str, cell: dict) -> None:
    sparsities = sorted({t for _, t, _ in cell})
    print(f"\n{recipe}: each scorer's change under zero / mean / refit (the smallest in bold)\n")
    rows = []
    for s in dict.fromkeys(s for s, _, _ in cell):
        row = []
        for t in sparsities:
            vals = {c: cell[(s, t, c)]["delta"] for c in ("zero", "mean", "refit") if (s, t, c) in cell}
            lo = min(vals.values()) if vals else None
            row.append(" / ".join((f"**{v:+.2f}**" if v == lo else f"{v:+.2f}") for v in vals.values()))
        rows.append([s] + row)
    print(markdown_table(["scorer"] + [f"{t:g}" for t in sparsities], rows))


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--default", default="sink-aware,refit", help="SCORER,COMPENSATION: the default pair")
    ap.add_argument("--model", default="quickstart", help="the recipe the targets are set on")
    args = ap.parse_args()
    scorer, comp = args.default.split(",")
    if (COMPARES / f"compare-{args.model}.json").exists():
        print(f"# targets on {args.model}")
        checks(load(args.model), scorer, comp)
    for path in sorted(COMPARES.glob("compare-*.json")):
        recipe = path.stem.removeprefix("compare-")
        best_compensation(recipe, load(recipe))


if __name__ == "__main__":
    main()
