"""Whole attention layers removed from Gemma 3 270M (selection.unit: layer), against query heads at the same count.

    python -m eval.studies.gemma_layers --split dev         [--windows 32]  [--counts 2,4,6]
    python -m eval.studies.gemma_layers --split evaluation  [--windows 256] [--scorers layer-cosine,heads]
    python -m eval.studies.gemma_layers --tables            (prints the tables of every results file written)

Gemma 3 270M has 18 layers of 4 query heads over 1 KV head. Removing k attention layers frees k/18 of the KV
cache (and the layers' q/k/v/o); pruning query heads frees none -- every layer keeps its one KV head while it
keeps any query head. Each cell removes 2 / 4 / 6 of the 18 attention layers as each layer scorer ranks them
(`layer-sink-aware`, `layer-cosine`, `layer-ablation`), with zero and mean compensation, and -- the `heads`
row -- prunes the same number of query heads (4 per layer removed: the same attention compute) with the
recipe's head scorer under a global budget, which frees no KV cache, with mean and refit (the recipe's). Each is
scored under a scoped mask on each kind of text: the perplexity change against the unpruned model on the same windows, with a paired 95%
bootstrap interval over windows (`eval.studies.gemma`'s splits, calibration and windows).

One calibration pass serves every layer scorer (the joint output moments and the attention blocks' cosine
sums); `layer-ablation` measures L + 1 passes per compensation on `--ablation-samples` calibration samples;
the head row calibrates once more for its scorer. Cells already in the results file are skipped. Writes
eval/results/studies/gemma/layers-<split>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from eval.studies import gemma
from pruner.core import arch
from pruner.evaluation.perplexity import paired_delta, sliding_windows
from pruner.pruning.ablation import layer_ablations, subset
from pruner.pruning.compensation import compensate
from pruner.pruning.per_layer import CurveRequest
from pruner.pruning.scoring import LAYER_SCORERS, get_scorer
from pruner.pruning.selection import SelectionConfig, curve_key, select, select_layers
from pruner.runs import compensating, layer_plan, pipeline
from pruner.runs.recipe_io import load_recipe

SCORERS = (*LAYER_SCORERS, "heads")
COMPENSATIONS = ("zero", "mean")  # for layers: refit resolves to mean in a layer with no head left
HEAD_COMPENSATIONS = ("mean", "refit")  # the head row: refit is Gemma's default, zero is ruinous (evidence/gemma.md)
LAYER_SETTINGS = ["selection.unit=layer", "scorer.name=layer-cosine", "surgery.compensation=refit"]


def _compensate(model, outputs, kind: str, heads):
    return compensate(model, heads, outputs, kind)


def layer_plans(s, names: list[str], counts: list[int], compensations: list[str], samples: int) -> dict:
    """{(scorer, k, compensation): head set} of every layer scorer (one calibration for all of them)."""
    inputs = layer_plan.layer_inputs(s, get_scorer("layer-cosine"))  # joint moments (refit) and cosine sums
    geom, plans = arch.geometry(s.model), {}
    for kind in compensations:
        measured = None
        if "layer-ablation" in names:
            removing = partial(_compensate, s.model, inputs.stats.outputs, kind)
            measured = layer_ablations(s.model, subset(s.calibration, samples), removing).increase
        for name in (n for n in names if n in LAYER_SCORERS):
            scored = replace(inputs, layer_ablation=measured)
            for k in counts:
                plans[(name, k, kind)] = select_layers(get_scorer(name), scored, geom, SelectionConfig(target=k))
    return {"plans": plans, "inputs": inputs}


def head_plans(s, counts: list[int], compensations: list[str]) -> dict:
    """{k: the plan of k x heads-per-layer query heads} by the recipe's head scorer, global budget, any shape."""
    recipe = load_recipe(gemma.RECIPE, gemma.SETTINGS)
    hs = replace(s, recipe=recipe)
    geom, scorer = arch.geometry(s.model), get_scorer(recipe.scorer.name)
    cfg = pipeline.selection_config(recipe, s.model, float(counts[0] * geom.n_heads))
    inputs = pipeline.scoring_inputs(hs, [scorer], CurveRequest((curve_key(scorer, geom, cfg),)),
                                     compensations, progress=False)
    plans = {k: select(scorer, inputs, geom, pipeline.selection_config(recipe, s.model, float(k * geom.n_heads)))
             for k in counts}
    return {"plans": plans, "inputs": inputs, "scorer": scorer.name}


def record(name: str, k: int, kind: str, text: str, plan, d, freed: float, seconds: float) -> dict:
    return {"scorer": name, "layers": k, "compensation": kind, "text": text, "pruned_heads": len(plan.entries),
            "removed_layers": list(plan.layers), "kv_cache_freed": freed, "base": d.base, "pruned": d.pruned,
            "delta": d.delta, "ci_low": d.ci_low, "ci_high": d.ci_high, "windows": d.windows, "tokens": d.tokens,
            "seconds": round(seconds, 1)}


def cells(split: str, names: list[str], counts: list[int], compensations: dict[str, list[str]], windows: int,
          samples: int, path: Path) -> list[dict]:
    """Every (scorer, k, compensation, kind of text) cell not already in `path`; records appended as they
    finish. `compensations` has the layer rows' (`layers`) and the head row's (`heads`)."""
    records = json.loads(path.read_text()) if path.exists() else []
    done = {(r["scorer"], r["layers"], r["compensation"], r["text"]) for r in records}
    corpora, kinds = gemma.texts(split)
    t0 = time.time()
    s = gemma.session(corpora, LAYER_SETTINGS)
    scored = {k: gemma.spread(sliding_windows(s.tokenizer, t, 128, bos=True), windows) for k, t in kinds.items()}
    base = {k: gemma.nll(s, w) for k, w in scored.items()}
    print(f"base: {', '.join(f'{k} {math.exp(b[0].sum() / b[1].sum()):.2f}' for k, b in base.items())} "
          f"({time.time() - t0:.0f} s)", flush=True)
    L = arch.geometry(s.model).n_layers
    layers = (layer_plans(s, names, counts, compensations["layers"], samples) if set(names) & set(LAYER_SCORERS)
              else None)
    heads = head_plans(s, counts, compensations["heads"]) if "heads" in names else None
    for name in names:
        for k in counts:
            for kind in compensations["heads" if name == "heads" else "layers"]:
                src = heads if name == "heads" else layers
                plan = src["plans"][k] if name == "heads" else src["plans"][(name, k, kind)]
                spec = s.recipe.surgery.model_copy(update={"compensation": kind})
                comp = compensating.compensation(s.model, plan.heads, spec, src["inputs"])
                label = name if name != "heads" else f"heads ({heads['scorer']})"  # as the record names it
                for text, w in scored.items():
                    if (label, k, kind, text) in done:
                        continue
                    t0 = time.time()
                    d = paired_delta(base[text], gemma.nll(s, w, plan.heads, comp), n_boot=1000, seed=0)
                    freed = 0.0 if name == "heads" else k / L  # 1 KV head per layer: a layer's share of the cache
                    records.append(record(label, k, kind, text, plan, d, freed, time.time() - t0))
                    path.write_text(json.dumps(records, indent=1))
                    print(f"{name} {k} layers {kind} {text}: {d.delta:+.2f} [{d.ci_low:+.2f}, {d.ci_high:+.2f}] "
                          f"(KV cache freed {freed:.0%})", flush=True)
    return records


def tables(records: list[dict]) -> str:
    """`eval.studies.gemma`'s tables with one column per count of layers, and what each row frees."""
    return gemma.tables(records, "layers", lambda k: f"{k} layers", "; KV cache freed: k/18 for layers, none for heads")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", choices=("dev", "evaluation"))
    p.add_argument("--windows", type=int, default=None, help="scored windows per kind of text (dev 32, "
                                                                "evaluation 256)")
    p.add_argument("--counts", default="2,4,6", help="attention layers removed (of 18)")
    p.add_argument("--scorers", default=",".join(SCORERS), help="layer scorers, and `heads` for the head row")
    p.add_argument("--compensations", default=",".join(COMPENSATIONS), help="of the layer rows")
    p.add_argument("--head-compensations", default=",".join(HEAD_COMPENSATIONS), help="of the head row")
    p.add_argument("--ablation-samples", type=int, default=16, help="calibration samples layer-ablation measures")
    p.add_argument("--out", type=Path, default=None, help="results file (default: the split's)")
    p.add_argument("--tables", action="store_true")
    a = p.parse_args()
    if a.tables or a.split is None:
        for split in ("dev", "evaluation"):
            if (gemma.OUT / f"layers-{split}.json").exists():
                print(f"\n## {split}\n" + tables(json.loads((gemma.OUT / f"layers-{split}.json").read_text())))
        return
    gemma.OUT.mkdir(parents=True, exist_ok=True)
    windows = a.windows or (32 if a.split == "dev" else 256)
    records = cells(a.split, a.scorers.split(","), [int(k) for k in a.counts.split(",")],
                    {"layers": a.compensations.split(","), "heads": a.head_compensations.split(",")}, windows,
                    a.ablation_samples,
                    a.out or gemma.OUT / f"layers-{a.split}.json")
    print(tables(records))


if __name__ == "__main__":
    main()
