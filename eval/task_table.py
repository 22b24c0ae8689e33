"""Perplexity change next to the mean accuracy change over tasks, every scorer x sparsity x compensation.

    python eval/task_table.py runs/evidence-tasks/compare.json [--metric acc]

Reads a compare.json written with `evaluation.tasks`; prints one markdown table: a row per
scorer, a column per compensation x sparsity, each cell `perplexity change / accuracy change`
(accuracy: the mean over tasks of the paired per-task change of `--metric`, in points).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pruner.report import markdown_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("compare_json")
    ap.add_argument("--metric", default="acc")
    args = ap.parse_args()
    records = [r for r in json.loads(Path(args.compare_json).read_text()) if "error" not in r and r.get("tasks")]
    comps = list(dict.fromkeys(r["compensation"] for r in records))
    sparsities = sorted({r["sparsity"] for r in records})
    cell = {(r["scorer"], r["sparsity"], r["compensation"]): r for r in records}
    cols = [(c, s) for c in comps for s in sparsities]
    rows = []
    for scorer in dict.fromkeys(r["scorer"] for r in records):
        row = [scorer]
        for c, s in cols:
            r = cell.get((scorer, s, c))
            if r is None:
                row.append("—")
                continue
            acc = [t[args.metric]["delta"] for t in r["tasks"].values() if args.metric in t]
            row.append(f"{r['delta']:+.2f} / {100 * sum(acc) / len(acc):+.1f}")
        rows.append(row)
    print(markdown_table(["scorer"] + [f"{c} @ {s:g}" for c, s in cols], rows))


if __name__ == "__main__":
    main()
