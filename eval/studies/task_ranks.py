"""Do accuracy and perplexity rank the scorers the same way? Read a compare.json written with evaluation.tasks.

    python -m eval.studies.task_ranks runs/evidence-tasks/compare.json [--metric acc] [--cells]

For every compensation x sparsity: the Spearman correlation across scorers between the
perplexity change and each task's accuracy change (sign flipped, so 1 = the same order),
the same for the mean accuracy change over tasks, and the best scorer by each. With
`--cells`: instead, a row per scorer and a column per compensation x sparsity, each cell
`perplexity change / mean accuracy change over tasks` (points). Prints markdown; writes nothing (the driver
keeps the output in eval/results/studies/tasks/ranks-quickstart.md and cells-quickstart.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scipy.stats import spearmanr

from pruner.core.tables import markdown_table


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("compare_json")
    ap.add_argument("--metric", default="acc")
    ap.add_argument("--cells", action="store_true", help="print the perplexity / accuracy change of every plan")
    args = ap.parse_args()
    records = [r for r in json.loads(Path(args.compare_json).read_text()) if "error" not in r and r.get("tasks")]
    if args.cells:
        print(cells(records, args.metric))
        return
    task_names = list(dict.fromkeys(t for r in records for t in r["tasks"]))
    rows = []
    for comp in dict.fromkeys(r["compensation"] for r in records):
        for sparsity in sorted({r["sparsity"] for r in records}):
            cell = [r for r in records if r["compensation"] == comp and r["sparsity"] == sparsity]
            ppl = [r["delta"] for r in cell]
            acc = {t: [r["tasks"][t][args.metric]["delta"] for r in cell] for t in task_names}
            mean_acc = [sum(acc[t][i] for t in task_names) / len(task_names) for i in range(len(cell))]
            best_ppl = min(cell, key=lambda r: r["delta"])["scorer"]
            best_acc = cell[max(range(len(cell)), key=lambda i: mean_acc[i])]["scorer"]
            rows.append([comp, f"{sparsity:g}", len(cell)] + [f"{_same_order(ppl, acc[t]):+.2f}" for t in task_names]
                        + [f"{_same_order(ppl, mean_acc):+.2f}", best_ppl, best_acc])
    print(f"Spearman rho across scorers: perplexity change vs {args.metric} change (1 = same order)\n")
    print(markdown_table(["compensation", "sparsity", "scorers", *task_names, "mean over tasks",
                          "best by perplexity", f"best by mean {args.metric}"], rows))


def _same_order(ppl_changes: list[float], acc_changes: list[float]) -> float:
    """Spearman rho between accuracy changes and perplexity changes with the sign flipped: 1 = the same order."""
    return spearmanr([-x for x in ppl_changes], acc_changes).statistic


def cells(records: list[dict], metric: str) -> str:
    """Markdown: a row per scorer, a column per compensation x sparsity, `ppl change / mean acc change`."""
    comps = list(dict.fromkeys(r["compensation"] for r in records))
    sparsities = sorted({r["sparsity"] for r in records})
    by = {(r["scorer"], r["sparsity"], r["compensation"]): r for r in records}
    cols = [(c, s) for c in comps for s in sparsities]
    rows = []
    for scorer in dict.fromkeys(r["scorer"] for r in records):
        row = [scorer]
        for c, s in cols:
            r = by.get((scorer, s, c))
            acc = [] if r is None else [t[metric]["delta"] for t in r["tasks"].values() if metric in t]
            row.append("—" if not acc else f"{r['delta']:+.2f} / {100 * sum(acc) / len(acc):+.1f}")
        rows.append(row)
    return markdown_table(["scorer"] + [f"{c} @ {s:g}" for c, s in cols], rows)


if __name__ == "__main__":
    main()
