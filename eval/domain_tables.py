"""Issue 26's tables and target checks from eval/run_domain_evidence.sh (eval/results/domains/*.json).

    python eval/domain_tables.py [--default sink-aware,refit]

Per domain (the evaluation plays; the Python standard library's docstrings) and shipped decoder: every
scorer's perplexity change [95% CI] under zero / mean / refit at 10 / 25 / 40 / 50%; then the targets:
1. the default pair within +5% (or +0.05, whichever is larger) of the best other scorer with the same
   compensation, at every sparsity;
2. the default compensation no worse than mean compensation for the default scorer, at every sparsity.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pruner.core.tables import change_cell, markdown_table

RESULTS = Path(__file__).resolve().parent / "results" / "domains"
MODELS = {"quickstart": "causal all-MiniLM-L6-v2", "gpt2-shakespeare": "GPT-2 (from scratch)",
          "llama-shakespeare": "Llama, GQA (from scratch)"}
DOMAINS = {"shakespeare": "the evaluation plays (shakespeare:evaluation)",
           "python-docs": "the Python standard library's docstrings (python-docs:evaluation)"}
NOT_BASELINES = ("random",)  # a floor, not a competitor


def load(path: Path) -> tuple[dict, float, int]:
    records = [r for r in json.loads(path.read_text()) if "error" not in r]
    cells = {(r["scorer"], r["sparsity"], r["compensation"]): r for r in records}
    return cells, records[0]["base"], records[0]["windows"]


def table(cells: dict) -> str:
    scorers = list(dict.fromkeys(s for s, _, _ in cells))
    cols = sorted({(c, t) for _, t, c in cells}, key=lambda x: (("zero", "mean", "refit").index(x[0]), x[1]))
    rows = [[s] + [change_cell(cells.get((s, t, c))) for c, t in cols] for s in scorers]
    return markdown_table(["scorer"] + [f"{c} @ {t:g}" for c, t in cols], rows)


def margin(best: float) -> float:
    return max(0.05 * abs(best), 0.05)


def checks(cells: dict, scorer: str, comp: str) -> tuple[list[list], list[list]]:
    """Rows of the two target tables: (sparsity, ours, best other, met?)."""
    sparsities = sorted({t for _, t, _ in cells})
    vs_best, vs_mean = [], []
    for t in sparsities:
        mine = cells.get((scorer, t, comp))
        others = [(r["delta"], s) for (s, tt, c), r in cells.items() if tt == t and c == comp
                  and s != scorer and s not in NOT_BASELINES]
        if mine is None or not others:
            continue
        best, name = min(others)
        gap = mine["delta"] - (best + margin(best))
        vs_best.append([f"{t:g}", change_cell(mine), f"{name}: {change_cell(cells[(name, t, comp)])}",
                        "yes" if gap <= 0 else f"**no** (by {gap:.2f})"])
        mean = cells.get((scorer, t, "mean"))
        if mean is not None and comp != "mean":
            vs_mean.append([f"{t:g}", change_cell(mine), change_cell(mean),
                            "yes" if mine["delta"] <= mean["delta"] else
                            f"**no** (by {mine['delta'] - mean['delta']:.2f})"])
    return vs_best, vs_mean


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--default", default="sink-aware,refit", help="SCORER,COMPENSATION: the default pair")
    args = ap.parse_args()
    scorer, comp = args.default.split(",")
    met = {"best": [0, 0], "mean": [0, 0]}
    for domain, about in DOMAINS.items():
        print(f"\n## {about}\n")
        for recipe, model in MODELS.items():
            path = RESULTS / f"{recipe}-{domain}.json"
            if not path.exists():
                continue
            cells, base, windows = load(path)
            print(f"### {model} (`recipes/{recipe}.yaml`), base perplexity {base:.2f}, {windows} windows\n")
            print(table(cells) + "\n")
            vs_best, vs_mean = checks(cells, scorer, comp)
            print(f"Target 1: `{scorer}` + `{comp}` within +5% (or +0.05) of the best other scorer with `{comp}`:\n")
            print(markdown_table(["sparsity", "default pair", "best other scorer", "met?"], vs_best) + "\n")
            print(f"Target 2: `{comp}` no worse than `mean` for `{scorer}`:\n")
            print(markdown_table(["sparsity", comp, "mean", "met?"], vs_mean) + "\n")
            for key, rows in (("best", vs_best), ("mean", vs_mean)):
                met[key][0] += sum(r[-1] == "yes" for r in rows)
                met[key][1] += len(rows)
    print(f"Targets met: 1 (best other scorer) {met['best'][0]}/{met['best'][1]} cells, "
          f"2 (no worse than mean) {met['mean'][0]}/{met['mean'][1]} cells")


if __name__ == "__main__":
    main()
