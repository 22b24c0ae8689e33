"""The shipped offline task suite on the shipped models: base accuracy, chance, and a damaged model's.

    python -m eval.studies.tasks [--models minilm-causal,gpt2-shakespeare,llama-shakespeare,minilm]
                                           [--limit N] [--seeds 3]

Damaged = half of the heads, drawn at random (seeded), zero-ablated with the scoped mask. Each
document's damaged accuracy is its mean over `--seeds` head draws; the change is paired with the
base on the same documents, with a 95% bootstrap CI over documents. The causal models run the
harness tasks (`shakespeare` tag); the encoder all-MiniLM-L6-v2 (`minilm`) runs the embedding
task. Prints the docs table (docs/downstream.md) and writes `--out` (default eval/results/studies/tasks/suite.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from eval.common import RESULTS
from pruner.checkpoints import loading
from pruner.core import arch
from pruner.core.tables import change_cell, markdown_table
from pruner.evaluation import tasks
from pruner.pruning import surgery

CHANCE = {"shakespeare_cloze": 0.25, "shakespeare_recall": 0.25, "shakespeare_order": 0.5, "shakespeare_speech": 0.5}


def random_half(model, seed: int) -> dict[int, list[int]]:
    """Half of all heads, drawn uniformly at random: {layer: [head, ...]}."""
    g = arch.geometry(model)
    n = g.n_layers * g.n_heads
    heads: dict[int, list[int]] = {}
    for f in sorted(torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: n // 2].tolist()):
        heads.setdefault(f // g.n_heads, []).append(f % g.n_heads)
    return heads


def mean_scores(runs: list[dict[str, tasks.TaskScores]]) -> dict[str, tasks.TaskScores]:
    """Per document, the mean of each metric over several runs on the same documents."""
    out = {}
    for name, first in runs[0].items():
        out[name] = tasks.TaskScores(name, first.doc_ids, first.prompts, {
            m: torch.stack([r[name].metrics[m] for r in runs]).mean(0) for m in first.metrics})
    return out


def study(name: str, limit: int | None, seeds: int, batch_size: int) -> list[dict]:
    encoder = name == "minilm"
    model, tok = loading.load_model(name), loading.load_tokenizer(name)
    names = ("shakespeare_speech",) if encoder else ("shakespeare_cloze", "shakespeare_recall", "shakespeare_order")
    ds = tasks.Downstream(model, tok, tasks.TaskSpec(names, limit=limit, batch_size=batch_size), causal=not encoder)
    t0 = time.time()
    base = ds.scores()
    seconds = time.time() - t0
    damaged = []
    for seed in range(seeds):
        with surgery.masked(model, random_half(model, seed)):
            damaged.append(ds.scores())
    rows = []
    for task, metrics in ds.paired(base, mean_scores(damaged)).items():
        for metric, d in metrics.items():
            rows.append({"model": name, "task": task, "metric": metric, "chance": CHANCE[task], **d,
                         "per_seed": [r[task].metrics[metric].mean().item() for r in damaged],
                         "base_seconds": round(seconds, 1)})
    return rows


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["model", "task", "metric", "documents", "chance", "base", "damaged", "change [95% CI]"],
        [[r["model"], r["task"], r["metric"], r["docs"], f"{r['chance']:.2f}", f"{r['base']:.3f}", f"{r['pruned']:.3f}",
          change_cell(r, 3)] for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="minilm-causal,gpt2-shakespeare,llama-shakespeare,minilm")
    ap.add_argument("--limit", type=int, default=None, help="first N documents of each task (default: all)")
    ap.add_argument("--seeds", type=int, default=3, help="random head draws for the damaged model")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS / "studies" / "tasks" / "suite.json"))
    args = ap.parse_args()
    load = os.getloadavg()
    rows = []
    for name in args.models.split(","):
        rows += study(name, args.limit, args.seeds, args.batch_size)
        print(f"{name} done ({os.getloadavg()[0]:.1f} load)", flush=True)
    print(f"load average {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end; damaged = random half of the "
          f"heads, zero-ablated, mean over {args.seeds} draws\n")
    print(table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"load_average": load, "seeds": args.seeds, "limit": args.limit,
                                          "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
