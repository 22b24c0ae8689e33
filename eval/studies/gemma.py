"""Every scorer x compensation on Gemma 3 270M, the one real pretrained decoder: development splits choose, the
evaluation splits report (issue 48, item 5).

    python -m eval.studies.gemma --split dev         [--windows 32]  [--targets 0.25,0.5] [--scorers a,b]
    python -m eval.studies.gemma --split evaluation  [--windows 256] [--scorers refit-energy,cosine,entropy]
                                                   [--compensations refit]
    python -m eval.studies.gemma --tables            (prints the tables of every results file written)

One calibration pass per split (64 windows of 128 tokens, the three shipped kinds of text mixed in equal
shares, as recipes/gemma3-270m.yaml calibrates) gives every scorer's plans; each plan is scored under a scoped
mask with zero, mean and refit compensation on each kind of text: the perplexity change against the unpruned
model on the same windows with a paired 95% bootstrap interval over windows. Budget: global, any shape (the
scorers decide how many heads each layer loses). Scored windows are spread evenly over each text (the
first N windows of a split are one play's opening scenes).

- `--split dev`: calibration on the plays othello + as_you_like_it and the even documents of
  `python-docs:dev` / `package-docs:dev`; scored on the plays henry_v + winters_tale and the odd documents:
  no calibration text is ever scored, and no evaluation text is read.
- `--split evaluation`: calibration `shakespeare:calibration` + `python-docs:dev` + `package-docs:dev` (the
  recipe's); scored on `shakespeare:evaluation`, `python-docs:evaluation`, `package-docs:evaluation`.

Cells already in the results file are kept and skipped (the study resumes where it stopped). Writes
eval/results/studies/gemma/<split>.json. Gemma's weights here are the Q4_K_M GGUF de-quantized: a real, slightly
noisy model.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from eval.common import RESULTS, ROOT
from pruner.core import arch, assets, data, mixture
from pruner.evaluation.perplexity import EvalWindows, paired_delta, sliding_windows
from pruner.pruning.per_layer import CurveRequest
from pruner.pruning.scoring import get_scorer
from pruner.pruning.selection import curve_key, select
from pruner.runs import compensating, context, pipeline
from pruner.runs.recipe_io import load_recipe

OUT = RESULTS / "studies" / "gemma"
RECIPE = ROOT / "recipes" / "gemma3-270m.yaml"
SCORERS = ("refit-energy", "sink-aware", "cosine", "entropy", "bos-sink", "output-norm", "fluctuation",
           "gradient", "ablation")
COMPENSATIONS = ("zero", "mean", "refit")
SETTINGS = ["selection.shape=any", "selection.budget=global", "calibration.num_samples=64",
            "capture.metrics=[cosine]"]  # threads: torch's default (OMP_NUM_THREADS)
KINDS = ("plays", "python-docs", "package-docs")


def load(source: str) -> list[str]:
    """The texts of a source spec such as `python-docs:dev`."""
    return data.load_texts(data.TextSource(source))


def plays(names) -> list[str]:
    """The calibration plays of these names, one text each."""
    return [(assets.shakespeare("calibration") / f"{n}.txt").read_text() for n in names]


def texts(split: str) -> tuple[list[list[str]], dict[str, list[str]]]:
    """(calibration corpora, one per kind; {kind: scored texts}) of a split."""
    if split == "dev":
        py, pk = load("python-docs:dev"), load("package-docs:dev")
        return ([plays(("othello", "as_you_like_it")), py[0::2], pk[0::2]],
                {"plays": plays(("henry_v", "winters_tale")), "python-docs": py[1::2], "package-docs": pk[1::2]})
    return ([load("shakespeare:calibration"), load("python-docs:dev"), load("package-docs:dev")],
            {"plays": load("shakespeare:evaluation"), "python-docs": load("python-docs:evaluation"),
             "package-docs": load("package-docs:evaluation")})


def spread(windows: EvalWindows, n: int) -> EvalWindows:
    """`n` windows evenly spaced over all of them (all when there are fewer)."""
    if len(windows) <= n:
        return windows
    idx = torch.linspace(0, len(windows) - 1, n).round().long()
    return EvalWindows(windows.input_ids[idx], windows.attention_mask[idx], windows.labels[idx])


def session(corpora: list[list[str]], settings: list[str]):
    """The recipe's session with the calibration samples drawn from `corpora` in equal shares."""
    recipe = load_recipe(RECIPE, SETTINGS + settings)
    s = context.prepare(recipe, progress=False, evaluation=False, given=context.Given(calibration_texts=corpora[0]))
    s.calibration, s.heldout = mixture.mixed_samples(s.tokenizer, corpora, "windows", 128,
                                                     draw=mixture.Draw(num_samples=64, seed=0, holdout=0))
    return s


def nll(s, windows: EvalWindows, heads=None, comp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-window summed NLL and token counts of the base model, or of a plan under a scoped mask."""
    got, count, _ = pipeline._window_scores(replace(s, _evaluation=windows, _downstream=None), heads, comp)
    return got, count


def cells(split: str, scorers: list[str], targets: list[float], compensations: list[str], windows: int,
          path: Path) -> list[dict]:
    """Every (scorer, target, compensation, kind of text) cell not already in `path`; records appended as they
    finish."""
    records = json.loads(path.read_text()) if path.exists() else []
    done = {(r["scorer"], r["target"], r["compensation"], r["text"]) for r in records}
    todo = [(n, t) for n in scorers for t in targets
            if any((n, t, c, k) not in done for c in compensations for k in KINDS)]
    if not todo:
        return records
    corpora, kinds = texts(split)
    t0 = time.time()
    s = session(corpora, [])
    scored = {k: spread(sliding_windows(s.tokenizer, t, 128, bos=True), windows) for k, t in kinds.items()}
    base = {k: nll(s, w) for k, w in scored.items()}
    print(f"base: {', '.join(f'{k} {math.exp(b[0].sum() / b[1].sum()):.2f}' for k, b in base.items())} "
          f"({time.time() - t0:.0f} s)", flush=True)
    geom = arch.geometry(s.model)
    names = list(dict.fromkeys(n for n, _ in todo))
    cfg0 = pipeline.selection_config(s.recipe, s.model, targets[0])
    keys = tuple(dict.fromkeys(curve_key(get_scorer(n), geom, cfg0) for n in names))
    t0 = time.time()
    inputs = pipeline.scoring_inputs(s, [get_scorer(n) for n in names], CurveRequest(keys), compensations,
                                     progress=True)
    print(f"calibration and scores: {time.time() - t0:.0f} s", flush=True)
    for name, target in todo:
        plan = select(get_scorer(name), inputs, geom, pipeline.selection_config(s.recipe, s.model, target))
        for kind in compensations:
            spec = s.recipe.surgery.model_copy(update={"compensation": kind})
            comp = compensating.compensation(s.model, plan.heads, spec, inputs)
            for text, w in scored.items():
                if (name, target, kind, text) in done:
                    continue
                t0 = time.time()
                d = paired_delta(base[text], nll(s, w, plan.heads, comp), n_boot=1000, seed=0)
                records.append({"scorer": name, "target": target, "compensation": kind, "text": text,
                                "pruned_heads": len(plan.entries), "base": d.base, "pruned": d.pruned,
                                "delta": d.delta, "ci_low": d.ci_low, "ci_high": d.ci_high, "windows": d.windows,
                                "tokens": d.tokens, "seconds": round(time.time() - t0, 1),
                                "heads": {str(k): v for k, v in plan.heads.items()}})
                path.write_text(json.dumps(records, indent=1))
                print(f"{name} {target:.0%} {kind} {text}: {d.delta:+.2f} [{d.ci_low:+.2f}, {d.ci_high:+.2f}]",
                      flush=True)
    return records


def tables(records: list[dict], column: str = "target", heading=lambda t: f"{t:.0%}", note: str = "") -> str:
    """Per kind of text: scorer x compensation rows, one column per value of `column` (a target here, a count of
    layers in `eval.studies.gemma_layers`), `+delta [low, high]`; `note` ends each text's caption."""
    lines = []
    targets = sorted({r[column] for r in records})
    for text in KINDS:
        rows = [r for r in records if r["text"] == text]
        if not rows:
            continue
        lines += [f"\n{text} (base perplexity {rows[0]['base']:.2f}, {rows[0]['windows']} windows{note})\n",
                  "| scorer | compensation | " + " | ".join(heading(t) for t in targets) + " |",
                  "|---|---|" + "---|" * len(targets)]
        for name in dict.fromkeys(r["scorer"] for r in rows):
            for kind in COMPENSATIONS:
                got = {r[column]: r for r in rows if r["scorer"] == name and r["compensation"] == kind}
                if got:
                    lines.append(f"| {name} | {kind} | " + " | ".join(
                        f"{got[t]['delta']:+.2f} [{got[t]['ci_low']:+.2f}, {got[t]['ci_high']:+.2f}]"
                        if t in got else "" for t in targets) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", choices=("dev", "evaluation"))
    p.add_argument("--windows", type=int, default=None, help="scored windows per kind of text (dev 32, "
                                                                "evaluation 256)")
    p.add_argument("--targets", default="0.25,0.5")
    p.add_argument("--scorers", default=",".join(SCORERS))
    p.add_argument("--compensations", default=",".join(COMPENSATIONS))
    p.add_argument("--tables", action="store_true")
    a = p.parse_args()
    if a.tables or a.split is None:
        for split in ("dev", "evaluation"):
            if (OUT / f"{split}.json").exists():
                print(f"\n## {split}\n" + tables(json.loads((OUT / f"{split}.json").read_text())))
        return
    OUT.mkdir(parents=True, exist_ok=True)
    windows = a.windows or (32 if a.split == "dev" else 256)
    records = cells(a.split, a.scorers.split(","), [float(t) for t in a.targets.split(",")],
                    a.compensations.split(","), windows, OUT / f"{a.split}.json")
    print(tables(records))


if __name__ == "__main__":
    main()
