"""Issue 26's tables and target checks from `python -m eval domains` (eval/results/studies/domains/*.json).

    python -m eval.studies.domain_tables [--default refit-energy,refit]   # or sink-aware,refit: the former default

Per domain (the evaluation plays; the Python standard library's docstrings) and shipped decoder: every
scorer's perplexity change [95% CI] under zero / mean / refit at 10 / 25 / 40 / 50%; then the targets:
1. the default pair within +5% (or +0.05, whichever is larger) of the best other scorer with the same
   compensation, at every sparsity -- checked against every scorer, and against the proxies alone (every
   scorer but the measured `ablation`, which costs L x H extra passes);
2. the default compensation no worse than mean compensation for the default scorer, at every sparsity.
Last, each scorer's mean rank with the default compensation over every (model, domain, sparsity) cell.
Writes nothing (the driver keeps the output in eval/results/studies/domains/tables.md, which docs/results.md
includes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.common import RESULTS
from pruner.core.tables import change_cell, markdown_table

COMPARES = RESULTS / "studies" / "domains"  # <recipe>-<domain>.json
MODELS = {"quickstart": "causal all-MiniLM-L6-v2", "gpt2-shakespeare": "GPT-2 (from scratch)",
          "llama-shakespeare": "Llama, GQA (from scratch)"}
DOMAINS = {"shakespeare": "the evaluation plays (shakespeare:evaluation)",
           "python-docs": "the Python standard library's docstrings (python-docs:evaluation)"}
NOT_BASELINES = ("random",)  # a floor, not a competitor
MEASURED = ("ablation",)  # the measured yardstick, not a proxy


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


def _versus(cells: dict, mine: dict, t: float, comp: str, others: list[str]) -> tuple[str, str]:
    """The best of `others` at (t, comp), and whether `mine` is within its margin."""
    best, name = min((cells[(s, t, comp)]["delta"], s) for s in others if (s, t, comp) in cells)
    gap = mine["delta"] - (best + margin(best))
    return f"{name}: {change_cell(cells[(name, t, comp)])}", "yes" if gap <= 0 else f"**no** (by {gap:.2f})"


def checks(cells: dict, scorer: str, comp: str) -> tuple[list[list], list[list]]:
    """Rows of the two target tables: (sparsity, ours, best other, met?, best proxy, met?) and
    (sparsity, ours, mean, met?)."""
    sparsities = sorted({t for _, t, _ in cells})
    names = [s for s in dict.fromkeys(s for s, _, _ in cells) if s != scorer and s not in NOT_BASELINES]
    vs_best, vs_mean = [], []
    for t in sparsities:
        mine = cells.get((scorer, t, comp))
        if mine is None:
            continue
        row = [f"{t:g}", change_cell(mine), *_versus(cells, mine, t, comp, names)]
        vs_best.append(row + list(_versus(cells, mine, t, comp, [s for s in names if s not in MEASURED])))
        mean = cells.get((scorer, t, "mean"))
        if mean is not None and comp != "mean":
            vs_mean.append([f"{t:g}", change_cell(mine), change_cell(mean),
                            "yes" if mine["delta"] <= mean["delta"] else
                            f"**no** (by {mine['delta'] - mean['delta']:.2f})"])
    return vs_best, vs_mean


def mean_ranks(files: list[dict], comp: str) -> list[list]:
    """Each scorer's mean rank (1 = smallest change) with `comp` over every (file, sparsity) cell."""
    ranks: dict[str, list[int]] = {}
    for cells in files:
        for t in sorted({t for _, t, _ in cells}):
            row = sorted((r["delta"], s) for (s, tt, c), r in cells.items() if tt == t and c == comp)
            for i, (_, s) in enumerate(row):
                ranks.setdefault(s, []).append(i + 1)
    out = sorted(ranks.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
    return [[s, f"{sum(r) / len(r):.2f}", sum(x == 1 for x in r), len(r)] for s, r in out]


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--default", default="refit-energy,refit", help="SCORER,COMPENSATION: the default pair")
    args = ap.parse_args()
    scorer, comp = args.default.split(",")
    met = {"best": [0, 0], "proxy": [0, 0], "mean": [0, 0]}
    files = []
    for domain, about in DOMAINS.items():
        print(f"\n### On {about}\n")
        for recipe, model in MODELS.items():
            path = COMPARES / f"{recipe}-{domain}.json"
            if not path.exists():
                continue
            cells, base, windows = load(path)
            files.append(cells)
            print(f"#### {model} (`recipes/{recipe}.yaml`), base perplexity {base:.2f}, {windows} windows\n")
            print(table(cells) + "\n")
            vs_best, vs_mean = checks(cells, scorer, comp)
            print(f"Target 1: `{scorer}` + `{comp}` within +5% (or +0.05) of the best other scorer with `{comp}`, "
                  "and of the best proxy (every scorer but the measured `ablation`):\n")
            print(markdown_table(["sparsity", "default pair", "best other scorer", "met?", "best proxy", "met?"],
                                 vs_best) + "\n")
            print(f"Target 2: `{comp}` no worse than `mean` for `{scorer}`:\n")
            print(markdown_table(["sparsity", comp, "mean", "met?"], vs_mean) + "\n")
            for key, rows, col in (("best", vs_best, 3), ("proxy", vs_best, 5), ("mean", vs_mean, 3)):
                met[key][0] += sum(r[col] == "yes" for r in rows)
                met[key][1] += len(rows)
    print(f"Targets met: 1 (best other scorer) {met['best'][0]}/{met['best'][1]} cells, against the proxies "
          f"alone {met['proxy'][0]}/{met['proxy'][1]}; 2 (no worse than mean) {met['mean'][0]}/{met['mean'][1]} "
          "cells\n")
    print(f"Mean rank with `{comp}` over every model, domain and sparsity (1 = smallest increase):\n")
    print(markdown_table(["scorer", "mean rank", "cells ranked first", "cells"], mean_ranks(files, comp)))


if __name__ == "__main__":
    main()
