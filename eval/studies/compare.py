"""The `pruner compare` evidence: every scorer x sparsity x compensation on the shipped recipes, one calibration
pass per run, the same evaluation windows for every plan; the runs the docs' comparison tables come from. Each run
writes runs/FOLDER/ and copies what the set keeps to eval/results/studies/ (below).

    python -m eval.studies.compare SET [RECIPE ...] [--threads N]      (hours on 2 CPU cores for a whole set)
    python -m eval.studies.compare refit gpt2-shakespeare --threads 1

Each run is `python -m pruner.cli compare recipes/RECIPE.yaml --out runs/FOLDER ...` in a child process, with
the cosine pair metric only (what the scorers read) and, for the llama recipe, a global budget (its per-layer
budget is for compact saving). The sets, and what each keeps under eval/results/studies/:

  scorers           every scorer x {10, 25, 40, 50}% x {zero, mean}, the recipes' windows (docs/results.md):
                    runs/compare-RECIPE/ only
  refit             ... x {zero, mean, refit}, 256 evaluation windows (the encoder: its recipe's 512 lines)
                    (docs/results.md "Refit on every shipped model"): refit/compare-RECIPE.{json,md}
  quickstart-10     the quick start at 10% x {zero, mean, refit}, 256 windows: refit/compare-quickstart-10.{json,md}
  quickstart-refit  the quick start at {25, 40, 50}% x {zero, mean, refit}, 256 windows (issue 14):
                    refit/compare-quickstart.{json,md}
  quickstart-tasks  the same with the shipped offline task suite beside perplexity (first 100 documents of each
                    task, 64 windows; resumable) (docs/downstream.md, issue 15): tasks/compare-quickstart.{json,md}
  domains           the three decoders x {10, 25, 40, 50}% x {zero, mean, refit} on the evaluation plays and on
                    the Python standard library's docstrings, 256 windows each (issue 26):
                    domains/RECIPE-DOMAIN.json

The tables are printed from what is kept by eval.studies.refit_tables, domain_tables and task_ranks
(`python -m eval TABLE` runs them after the compares).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass

from eval.common import RESULTS, ROOT

DECODERS = ("gpt2-shakespeare", "llama-shakespeare", "quickstart")
DOMAINS = ("shakespeare:evaluation", "python-docs:evaluation")
COSINE = ("--set", "capture.metrics=[cosine]")
ALL_COMPENSATIONS = ("--compensation", "zero,mean,refit")
WINDOWS_256 = ("--set", "evaluation.num_samples=256")


@dataclass(frozen=True)
class Run:
    """One `pruner compare` of `recipe` into runs/`folder`, its compare.json (and .md) copied to `keep`."""

    recipe: str
    folder: str
    args: tuple[str, ...]
    keep: str | None = None  # a path under eval/results/studies without the suffix
    markdown: bool = True    # also keep compare.md


def _budget(recipe: str) -> tuple[str, ...]:
    return ("--set", "selection.budget=global") if recipe == "llama-shakespeare" else ()


def _threads(n: int) -> tuple[str, ...]:
    return ("--set", f"threads={n}")


def runs_of(name: str, recipes: list[str], threads: int) -> list[Run]:
    """The runs of the set `name` (on `recipes` where the set takes them)."""
    quick = ("--sparsities", "0.25,0.4,0.5", *ALL_COMPENSATIONS, *COSINE, *_threads(threads))
    if name == "scorers":
        return [Run(r, f"compare-{r}", ("--overwrite", *COSINE, *_budget(r))) for r in recipes]
    if name == "refit":
        return [Run(r, f"refit-compare-{r}", ("--overwrite", *ALL_COMPENSATIONS, *COSINE, *_threads(threads),
                                              *(() if r == "minilm-encoder" else WINDOWS_256), *_budget(r)),
                    f"refit/compare-{r}") for r in recipes]
    if name == "quickstart-10":
        return [Run("quickstart", "refit-compare-quickstart-10", ("--overwrite", "--sparsities", "0.1",
                                                                  *ALL_COMPENSATIONS, *WINDOWS_256, *COSINE),
                    "refit/compare-quickstart-10")]
    if name == "quickstart-refit":
        return [Run("quickstart", "evidence-refit", ("--overwrite", *quick, *WINDOWS_256), "refit/compare-quickstart")]
    if name == "quickstart-tasks":
        return [Run("quickstart", "evidence-tasks", ("--resume", *quick, "--set", "evaluation.tasks=[shakespeare]",
                                                     "--set", "evaluation.task_limit=100"), "tasks/compare-quickstart")]
    if name == "domains":
        return [Run(r, f"domains/{r}-{d.split(':')[0]}",
                    ("--overwrite", *ALL_COMPENSATIONS, *COSINE, *_threads(threads), *WINDOWS_256,
                     "--set", f"evaluation.data={d}", *_budget(r)),
                    f"domains/{r}-{d.split(':')[0]}", markdown=False) for r in recipes for d in DOMAINS]
    raise SystemExit(f"unknown set {name!r}; valid: {', '.join(SETS)}")


SETS = {"scorers": ("quickstart", "gpt2-shakespeare", "llama-shakespeare", "minilm-encoder"),
        "refit": ("gpt2-shakespeare", "llama-shakespeare", "quickstart", "minilm-encoder"),
        "quickstart-10": (), "quickstart-refit": (), "quickstart-tasks": (), "domains": DECODERS}


def run(r: Run) -> None:
    """One compare in a child process (its output shows), then what it keeps copied under eval/results/studies."""
    folder = ROOT / "runs" / r.folder
    cmd = [sys.executable, "-m", "pruner.cli", "compare", str(ROOT / "recipes" / f"{r.recipe}.yaml"),
           "--out", str(folder), *r.args]
    print("$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    if r.keep:
        keep = RESULTS / "studies" / r.keep
        keep.parent.mkdir(parents=True, exist_ok=True)
        for suffix in (".json", ".md") if r.markdown else (".json",):
            shutil.copyfile(folder / f"compare{suffix}", keep.with_suffix(suffix))


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("set", choices=list(SETS))
    ap.add_argument("recipes", nargs="*", help="default: the set's recipes")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per run (refit, quickstart-*, domains)")
    args = ap.parse_args()
    for r in runs_of(args.set, args.recipes or list(SETS[args.set]), args.threads):
        run(r)


if __name__ == "__main__":
    main()
