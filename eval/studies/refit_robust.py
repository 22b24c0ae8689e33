"""Issue 50, item 2: a refit that cannot do worse than mean compensation on a change of text.

    OMP_NUM_THREADS=1 python -m eval.studies.refit_robust --split dev        [--models minilm-causal,...] [--windows 128]
    OMP_NUM_THREADS=1 python -m eval.studies.refit_robust --split evaluation [--models ...] [--windows 256]
    python -m eval.studies.refit_robust --tables                             (the tables of every results file written)
    OMP_NUM_THREADS=1 python -m eval.studies.refit_robust --energies llama-shakespeare [--texts python-docs,plays]

Per shipped decoder (minilm-causal = the quick start's, gpt2-shakespeare, llama-shakespeare) and target (25 / 40 /
50% of the heads, the recipe's scorer, global budget, selection.shape any), one calibration (64 windows of 128
tokens, the recipes') captures every window's output moments as a fold of its own, so every fold assignment below is
a regrouping of the same sums. Compensations compared on the same plans and the same windows:

- `zero`, `mean` (the pruned heads' mean output in the bias; Llama gets a bias for it);
- `refit`: the refit before this study (ridge auto, folds = window i mod 4, shrinking towards A = 0);
- `FOLDS/TARGET/RULE` candidates: the ridge chosen per layer by cross-validation with folds `mod4` (as before),
  `contig4` (four contiguous stretches of the calibration stream, which is sampled in stream order) or `doc` (one
  fold per calibration document); shrinking towards `zero` (A = 0) or towards `mean` (A0, the kept heads' channels
  rebuilding the pruned heads' mean output: A0 = c mu_P^T, c the ridge regression of the constant 1 on x_K; with an
  intercept the mean is the bias and A0 = 0, so both targets are the same fit); rule `1se` (the largest ridge within
  one standard error of the least held-out energy) or `min` (the least);
- `pick/contig4`: per layer, the old refit or mean (its target), whichever leaves less held-out energy on the
  contiguous folds.

Texts, windows spread evenly over each text (every window of a split has its place; the first N would be one play's
opening): with `--split dev` calibration on othello + as_you_like_it, scored on henry_v + winters_tale and the odd
documents of python-docs:dev / package-docs:dev (as eval/mixture_auto_study.py); with `--split evaluation` calibration
on shakespeare:calibration, scored on shakespeare:evaluation, python-docs:evaluation, package-docs:evaluation. Cells:
perplexity change with a paired 95% bootstrap CI (`paired_delta`), and each candidate against mean on the same
windows. Writes eval/results/studies/refit/robust_<split>.json.

`--energies MODEL` (dev split) prints, per scored text, target and layer, the energy each of zero / mean / refit
leaves unexplained *on the scored text itself* (the text's own output moments, E||W_P x_P - dW x - db||^2): whether
any choice made by held-out layer energy -- even held out on the scored text -- could prefer mean where perplexity does.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from eval.common import RESULTS, ROOT
from pruner.attention.moments import FoldMoments
from pruner.core import arch, assets, data
from pruner.evaluation.perplexity import EvalWindows, paired_delta, sliding_windows, window_scores
from pruner.pruning import refit, surgery
from pruner.pruning.compensation import compensate, has_bias
from pruner.pruning.per_layer import CurveRequest
from pruner.pruning.scoring import get_scorer
from pruner.pruning.selection import curve_key, select
from pruner.runs import context, pipeline
from pruner.runs.recipe_io import load_recipe

OUT = RESULTS / "studies" / "refit"
TARGETS = (0.25, 0.4, 0.5)
RECIPES = {"minilm-causal": "quickstart"}
SETTINGS = ["selection.shape=any", "selection.budget=global", "calibration.num_samples=64", "threads=1",
            "surgery.compensation=refit", "surgery.ridge=auto"]
TARGET_RIDGE = 1e-3  # c's ridge (relative), regressing the constant on the kept channels


def plays(names) -> list[str]:
    """The calibration plays of these names, one text each."""
    return [(assets.shakespeare("calibration") / f"{n}.txt").read_text() for n in names]


def load(source: str) -> list[str]:
    """The texts of a source spec such as `python-docs:dev`."""
    return data.load_texts(data.TextSource(source))


def texts(split: str) -> tuple[list[str], dict[str, list[str]]]:
    """(calibration documents in stream order, {kind: scored documents})."""
    if split == "dev":
        return plays(("othello", "as_you_like_it")), {
            "plays": plays(("henry_v", "winters_tale")), "python-docs": load("python-docs:dev")[1::2],
            "package-docs": load("package-docs:dev")[1::2]}
    return load("shakespeare:calibration"), {"plays": load("shakespeare:evaluation"),
                                             "python-docs": load("python-docs:evaluation"),
                                             "package-docs": load("package-docs:evaluation")}


def spread(w: EvalWindows, n: int) -> EvalWindows:
    """`n` windows spread evenly over the text (all of them when there are fewer)."""
    if len(w) <= n:
        return w
    idx = torch.linspace(0, len(w) - 1, n).round().long()
    return EvalWindows(w.input_ids[idx], w.attention_mask[idx], w.labels[idx])


def documents(tok, docs: list[str], batch, length: int, num_samples: int, seed: int) -> list[int]:
    """Each calibration window's document (the one its first token is in), as `data.token_windows` cut them."""
    sep = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    stream, ends = [], []
    for t in docs:
        stream += tok(t, add_special_tokens=False, verbose=False)["input_ids"] + ([int(sep)] if sep is not None else [])
        ends.append(len(stream))
    body = length - 1  # a BOS starts every window
    idx = data._sample(len(stream) // body, num_samples, seed)
    first = torch.tensor([stream[i * body] for i in idx])
    assert torch.equal(first, batch.input_ids[:, 1]), "the calibration windows are not token_windows' (a mixture?)"
    return [bisect.bisect_right(ends, i * body) for i in idx]


def regroup(fm: FoldMoments, assign: list[int]) -> FoldMoments:
    """Per-window fold sums (K = windows) summed into the folds `assign` names."""
    a = torch.tensor(assign)
    k = int(a.max()) + 1
    return FoldMoments(*(torch.zeros((k, *x.shape[1:]), dtype=x.dtype).index_add_(0, a, x)
                         for x in (fm.tokens, fm.o, fm.joint)))


def assignments(n: int, docs: list[int]) -> dict[str, list[int]]:
    return {"mod4": [i % 4 for i in range(n)], "contig4": [i * 4 // n for i in range(n)], "doc": docs}


# --- the candidates' math (direct solves: the oracle the package's fast version is tested against) ---------------

def moments(joint, o, n, intercept):
    """(mu, S) from sums: covariance with an intercept, uncentred moment without."""
    mu = o / n
    s = joint / n
    return mu, (s - torch.outer(mu, mu) if intercept else s)


def toward(s, mu, K, P, intercept, target: str):
    """A0 (|K|, |P|): zero, or the kept channels rebuilding the pruned heads' mean (no intercept only)."""
    if target == "zero" or intercept:
        return torch.zeros(len(K), len(P), dtype=torch.float64)
    t = s[K[:, None], K] + refit.ridge_lambda(s, TARGET_RIDGE) * torch.eye(len(K), dtype=torch.float64)
    c = torch.linalg.solve(t, mu[K])  # E[(1 - c^T x_K)^2] + lam |c|^2, least
    return torch.outer(c, mu[P])


def solve(s, K, P, lam, a0):
    if math.isinf(lam):
        return a0
    t = s[K[:, None], K] + lam * torch.eye(len(K), dtype=torch.float64)
    return torch.linalg.solve(t, s[K[:, None], P] + lam * a0)


def energy(G, c, K, P, a):
    """tr(G E[(x_P - A^T x_K)(...)^T]) under the moment c (around the training mean with an intercept)."""
    cpp, ckp, ckk = c[P[:, None], P], c[K[:, None], P], c[K[:, None], K]
    return float((G * (cpp - a.t() @ ckp - ckp.t() @ a + a.t() @ ckk @ a)).sum())


def heldout(w, fm: FoldMoments, pruned, intercept, target):
    """(folds, grid) held-out energy of each ridge, trained without each fold."""
    fm = FoldMoments(fm.tokens.double(), fm.o.double(), fm.joint.double())
    P, K = pruned.nonzero().flatten(), (~pruned).nonzero().flatten()
    w_p = w[:, P].double()
    G = w_p.t() @ w_p
    out = torch.zeros(len(fm.tokens), len(refit.RIDGE_GRID), dtype=torch.float64)
    for f in range(len(fm.tokens)):
        nt = fm.tokens.sum() - fm.tokens[f]
        mu, s = moments(fm.joint.sum(0) - fm.joint[f], fm.o.sum(0) - fm.o[f], nt, intercept)
        x, m = fm.o[f] / fm.tokens[f], fm.joint[f] / fm.tokens[f]
        c = m - torch.outer(x, mu) - torch.outer(mu, x) + torch.outer(mu, mu) if intercept else m
        a0 = toward(s, mu, K, P, intercept, target)
        lam0 = float(torch.diagonal(s).mean())
        for i, rel in enumerate(refit.RIDGE_GRID):
            out[f, i] = energy(G, c, K, P, solve(s, K, P, rel * lam0, a0))
    return out, fm.tokens


def pick(per_fold, n, rule):
    """Index into the grid: `1se` the largest ridge within one standard error of the least, `min` the least."""
    wts = (n / n.sum())[:, None]
    mean = (per_fold * wts).sum(0)
    best = int(mean.argmin())
    if rule == "min":
        return best
    se = per_fold.std(0) / math.sqrt(len(n))
    return max(i for i in range(len(mean)) if mean[i] <= mean[best] + se[best])


def candidate(model, heads, outputs, folds, name, old=None):
    """The compensation `name` = FOLDS/TARGET/RULE or pick/FOLDS (see the module docstring); `folds`: {name: per-layer
    regrouped FoldMoments}. Returns (Compensation, {layer: chosen relative ridge})."""
    g = arch.geometry(model)
    parts = name.split("/")
    bias, weight, ridges = {}, {}, {}
    for layer, hs in heads.items():
        if not hs:
            continue
        w = arch.o_weight_cols(model, layer).detach().double()
        pruned = torch.zeros(w.shape[1], dtype=torch.bool)
        pruned[surgery._slots(hs, g.head_dim)] = True
        icpt = has_bias(model, layer)
        P, K = pruned.nonzero().flatten(), (~pruned).nonzero().flatten()
        if parts[0] == "pick":  # the old fit (towards zero) against the mean target alone (ridge inf)
            i_old = refit.RIDGE_GRID.index(old[layer])
            energies = []
            for target in ("zero", "mean"):
                per_fold, n = heldout(w, folds[parts[1]][layer], pruned, icpt, target)
                energies.append(float((per_fold * (n / n.sum())[:, None]).sum(0)[i_old if target == "zero" else -1]))
            rel, target = (old[layer], "zero") if energies[0] <= energies[1] else (math.inf, "mean")
        else:
            fname, target, rule = parts
            per_fold, n = heldout(w, folds[fname][layer], pruned, icpt, target)
            rel = refit.RIDGE_GRID[pick(per_fold, n, rule)]
        mom = outputs[layer]
        mu, s = moments(mom.joint.double().reshape(w.shape[1], -1), mom.o.double().reshape(-1),
                        float(mom.tokens), icpt)
        a = solve(s, K, P, rel * float(torch.diagonal(s).mean()), toward(s, mu, K, P, icpt, target))
        dw = torch.zeros_like(w)
        dw[:, K] = w[:, P] @ a.t()
        weight[layer], ridges[layer] = dw.float(), rel
        if icpt:
            bias[layer] = (w[:, P] @ (mu[P] - a.t() @ mu[K])).float()
    return surgery.Compensation("refit", bias, weight), ridges


# --- the study ------------------------------------------------------------------------------------------------------

def scores(s, windows, heads=None, comp=None):
    with surgery.masked(s.model, heads or {}, comp):
        nll, count, _ = window_scores(s.model, windows, 8, False, s.causal, pool=False)
    return nll, count


def compensations(m, heads: dict[int, list[int]], outputs, folds: dict, names: list[str], model: str
                  ) -> tuple[dict, dict]:
    """({compensation: (its fit, {layer: ridge})} for zero, mean, refit and the candidates `names`, and each one's
    signature: a candidate that chose the same fit as another is scored once)."""
    comps = {"zero": (surgery.Compensation(), {}), "mean": (compensate(m, heads, outputs, "mean"), {})}
    old = compensate(m, heads, outputs, "refit", "auto", folds["mod4"])
    comps["refit"] = (old, {k: v["ridge"] for k, v in old.fits.items()})
    for name in names:
        comps[name] = candidate(m, heads, outputs, folds, name, comps["refit"][1])
    return comps, signatures(comps, model)


def study(model: str, split: str, n_windows: int, names: list[str]) -> list[dict]:
    cal, kinds = texts(split)
    r = load_recipe(ROOT / "recipes" / f"{RECIPES.get(model, model)}.yaml", SETTINGS)
    s = context.prepare(r, progress=False, evaluation=False, given=context.Given(calibration_texts=cal))
    docs = documents(s.tokenizer, cal, s.calibration, r.calibration.length, r.calibration.num_samples,
                     r.calibration.seed)
    n = len(s.calibration)
    every = r.model_copy(update={"surgery": r.surgery.model_copy(update={"folds": n})})  # a fold per window
    s = replace(s, recipe=every)
    scorer = get_scorer(r.scorer.name)
    geom = arch.geometry(s.model)
    t0 = time.time()
    inputs = pipeline.scoring_inputs(s, [scorer], CurveRequest((curve_key(scorer, geom, pipeline.selection_config(
        r, s.model, 0.25)),)), ["mean", "refit"], progress=False)
    outputs = inputs.stats.outputs
    folds = {k: [regroup(f, a) for f in inputs.stats.folds] for k, a in assignments(n, docs).items()}
    print(f"{model}: calibration {time.time() - t0:.0f} s, {n} windows of {len(set(docs))} documents", flush=True)
    evals = {k: spread(sliding_windows(s.tokenizer, t, 128, bos=r.evaluation.bos), n_windows)
             for k, t in kinds.items()}
    base = {k: scores(s, w) for k, w in evals.items()}
    out = []
    for target in TARGETS:
        plan = select(scorer, inputs, geom, pipeline.selection_config(r, s.model, target))
        comps, same = compensations(s.model, plan.heads, outputs, folds, names, model)
        for kind, w in evals.items():
            mean_scores, seen = None, {}
            for name, (comp, ridges) in comps.items():
                if same[name] not in seen:  # a candidate that chose the same fit as another is scored once
                    seen[same[name]] = scores(s, w, plan.heads, comp)
                got = seen[same[name]]
                d = paired_delta(base[kind], got)
                if name == "mean":
                    mean_scores = got
                vs = None if mean_scores is None or name in ("zero", "mean") else paired_delta(mean_scores, got)
                out.append({"model": model, "target": target, "text": kind, "compensation": name,
                            "base": d.base, "delta": d.delta, "ci": [d.ci_low, d.ci_high],
                            "vs_mean": None if vs is None else [vs.delta, vs.ci_low, vs.ci_high],
                            "ridges": {str(k): v for k, v in ridges.items()}, "windows": len(w)})
        print(f"{model} @ {target:.0%} (plays; ridges by layer): " + ", ".join(
            f"{r['compensation']} {r['delta']:+.2f} " + "/".join(f"{v:g}" for v in r["ridges"].values())
            for r in out if r["target"] == target and r["text"] == "plays"), flush=True)
    return out


def energies(model: str, kinds: list[str]) -> None:
    """The `--energies` diagnostic (see the module docstring): printed, not written."""
    from pruner.attention.capture import CaptureConfig, capture_stats

    cal, texts_ = texts("dev")
    r = load_recipe(ROOT / "recipes" / f"{RECIPES.get(model, model)}.yaml", SETTINGS)
    s = context.prepare(r, progress=False, evaluation=False, given=context.Given(calibration_texts=cal))
    scorer, geom = get_scorer(r.scorer.name), arch.geometry(s.model)
    inputs = pipeline.scoring_inputs(s, [scorer], CurveRequest((curve_key(scorer, geom, pipeline.selection_config(
        r, s.model, 0.25)),)), ["mean", "refit"], progress=False)
    for kind in kinds:
        w = spread(sliding_windows(s.tokenizer, texts_[kind], 128, bos=r.evaluation.bos), 128)
        seen = capture_stats(s.model, data.TokenBatch(w.input_ids, w.attention_mask), s.sinks, s.tokenizer,
                             CaptureConfig(metrics=(), outputs=True)).outputs  # the scored text's own moments
        for target in TARGETS:
            plan = select(scorer, inputs, geom, pipeline.selection_config(r, s.model, target))
            comps = {"zero": surgery.Compensation(),
                     "mean": compensate(s.model, plan.heads, inputs.stats.outputs, "mean"),
                     "refit": compensate(s.model, plan.heads, inputs.stats.outputs, "refit", "auto", inputs.stats.folds)}
            per = {k: [] for k in comps}
            for layer, hs in sorted(plan.heads.items()):
                if not hs:
                    continue
                W = arch.o_weight_cols(s.model, layer).detach().double()  # (d_model, D)
                pruned = torch.zeros(W.shape[1], dtype=torch.bool)
                pruned[surgery._slots(hs, geom.head_dim)] = True
                m = seen[layer]
                mu, M = m.o.double().reshape(-1) / float(m.tokens), m.joint.double() / float(m.tokens)
                for k, c in comps.items():  # residual r = L x - b: what the pruned heads wrote minus the compensation
                    L = torch.zeros_like(W)
                    L[:, pruned] = W[:, pruned]
                    L = L - c.weight[layer].double() if layer in c.weight else L
                    b = c.bias.get(layer, torch.zeros(W.shape[0])).detach().double()
                    per[k].append(float((L @ M * L).sum() - 2 * b @ (L @ mu) + b @ b))
            print(f"{model} {kind} {target:.0%}: " + "; ".join(
                f"{k} " + "/".join(f"{x:.3g}" for x in v) + f" (sum {sum(v):.3g})" for k, v in per.items()), flush=True)


def signatures(comps: dict, model: str) -> dict[str, tuple]:
    """Per compensation, what determines its fit: its target (no intercept only) and each layer's ridge."""
    out = {}
    for name, (comp, ridges) in comps.items():
        if not ridges:
            out[name] = (name,)
            continue
        target = "zero" if name == "refit" or "/zero/" in name or model != "llama-shakespeare" else "mean"
        out[name] = tuple((k, "zero" if name.startswith("pick") and math.isfinite(v) else target, v)
                          for k, v in sorted(ridges.items()))
    return out


def candidates(model: str) -> list[str]:
    intercept = model != "llama-shakespeare"  # the output projection has a bias (BERT, GPT-2)
    targets = ("mean",) if intercept else ("zero", "mean")
    return [f"{f}/{t}/{r}" for t in targets for f in ("mod4", "contig4", "doc") for r in ("1se", "min")
            if not (f == "mod4" and r == "min")] + ["pick/contig4", "pick/doc"]


def fmt(x: float) -> str:
    return f"{x:+.2f}"


def change_cell(r: dict) -> str:
    """A record's change, and its difference to mean [95% CI] where it has one."""
    return fmt(r["delta"]) + ("" if r["vs_mean"] is None else " ({:+.2f} [{:+.2f}, {:+.2f}])".format(*r["vs_mean"]))


def ci_cell(r: dict) -> str:
    """A record's change [95% CI]."""
    return f"{r['delta']:+.2f} [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}]"


def tables(records: list[dict]) -> str:
    """Per model and text: every compensation's change at each target; against mean: [CI] of candidate - mean."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in records):
        for text in dict.fromkeys(r["text"] for r in records):
            rows = [r for r in records if r["model"] == model and r["text"] == text]
            if not rows:
                continue
            lines += [f"\n{model}, {text} (base {rows[0]['base']:.2f}, {rows[0]['windows']} windows): change; "
                      "candidate - mean [95% CI]\n",
                      "| compensation | " + " | ".join(f"{t:.0%}" for t in TARGETS) + " |", "|---|" + "---|" * 3]
            for name in dict.fromkeys(r["compensation"] for r in rows):
                got = {r["target"]: r for r in rows if r["compensation"] == name}
                lines.append(f"| {name} | " + " | ".join(change_cell(got[t]) if t in got else "" for t in TARGETS)
                             + " |")
    return "\n".join(lines + [summary(records), against_mean(records)])


def against_mean(records: list[dict], name: str = "refit") -> str:
    """The issue's table: per model, text and target, mean and `name` [95% CI], their paired difference [95% CI],
    and whether `name` is within the bar (no worse than mean by more than 5% or 0.05)."""
    out = [f"\n| model | text | target | mean | {name} | {name} - mean | within the bar |", "|---|---|---|---|---|---|---|"]
    for r in records:
        if r["compensation"] != name:
            continue
        m = next(x for x in records if x["compensation"] == "mean" and
                 (x["model"], x["text"], x["target"]) == (r["model"], r["text"], r["target"]))
        out.append(f"| {r['model']} | {r['text']} ({r['base']:.1f}) | {r['target']:.0%} | "
                   f"{ci_cell(m)} | {ci_cell(r)} | "
                   "{:+.2f} [{:+.2f}, {:+.2f}] | ".format(*r["vs_mean"]) + ("yes" if within(r["delta"], m["delta"])
                                                                             else "**no**") + " |")
    return "\n".join(out)


def within(x: float, mean: float) -> bool:
    """The issue's bar: no worse than mean by more than 5% of mean's change, or 0.05."""
    return x <= mean + max(0.05, 0.05 * abs(mean))


def summary(records: list[dict]) -> str:
    """Per compensation, over the cells it ran: within the bar of mean, worse than mean beyond the 95% CI, the worst
    excess over mean, and the mean change relative to the base perplexity."""
    out = ["\n| compensation | cells <= mean (+5% or +0.05) | cells worse than mean (CI above 0) | worst excess "
           "over mean | mean change, % of base |", "|---|---|---|---|---|"]
    mean = {(r["model"], r["target"], r["text"]): r["delta"] for r in records if r["compensation"] == "mean"}
    for name in dict.fromkeys(r["compensation"] for r in records):
        rows = [r for r in records if r["compensation"] == name]
        ok = sum(within(r["delta"], mean[(r["model"], r["target"], r["text"])]) for r in rows)
        paired = [r for r in rows if r["vs_mean"] is not None]  # zero and mean carry no comparison with mean
        worse = str(sum(r["vs_mean"][1] > 0 for r in paired)) if paired else "-"
        worst = max(r["delta"] - mean[(r["model"], r["target"], r["text"])] for r in rows)
        rel = 100 * sum(r["delta"] / r["base"] for r in rows) / len(rows)
        out.append(f"| {name} | {ok} of {len(rows)} | {worse} | {worst:+.2f} | {rel:+.2f} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", choices=("dev", "evaluation"))
    p.add_argument("--models", default="minilm-causal,gpt2-shakespeare,llama-shakespeare")
    p.add_argument("--windows", type=int, default=None, help="per text: 128 on dev, 256 on evaluation")
    p.add_argument("--candidates", default=None, help="comma-separated; default: every candidate")
    p.add_argument("--out", default=None, help="results file (default eval/results/studies/refit/robust_SPLIT.json)")
    p.add_argument("--tables", action="store_true")
    p.add_argument("--energies", default=None, metavar="MODEL", help="the per-layer energy diagnostic (dev)")
    p.add_argument("--texts", default="python-docs,plays,package-docs", help="with --energies")
    a = p.parse_args()
    if a.energies:
        torch.set_num_threads(1)
        return energies(a.energies, a.texts.split(","))
    if a.tables:
        for split in ("dev", "evaluation"):
            f = OUT / f"robust_{split}.json"
            if f.exists():
                print(f"\n## {split}\n" + tables(json.loads(f.read_text())))
        return
    torch.set_num_threads(1)
    path = Path(a.out) if a.out else OUT / f"robust_{a.split}.json"
    models = a.models.split(",")
    windows = a.windows or (128 if a.split == "dev" else 256)
    records = [r for r in (json.loads(path.read_text()) if path.exists() else []) if r["model"] not in models]
    for model in models:  # each model's records replace its earlier ones; the other models' are kept
        names = a.candidates.split(",") if a.candidates else candidates(model)
        records += study(model, a.split, windows, names)
        path.write_text(json.dumps(records, indent=1))
    print(tables(records))


if __name__ == "__main__":
    main()
