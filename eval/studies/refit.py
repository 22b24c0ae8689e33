"""Refit compensation and refit-aware selection, on a development split (never the evaluation split).

    python -m eval.studies.refit [MODEL] [--targets 0.1,0.25,0.4,0.5] [--windows 256] [--out FILE]
        [--scorers sink-aware,fluctuation,refit-energy,...] [--comps zero,mean,refit,refit-seq]

The project's dev-split convention (eval.studies.scorers): calibration on 2 plays
of the calibration split, perplexity on the other 2 plays. Every scorer x target
plan is evaluated under every compensation with a scoped mask on the same
windows; cells are perplexity change [95% paired bootstrap CI]. Compensations:

- zero, mean, refit (one-shot, from the unpruned model's moments; an intercept
  where the output projection has a bias), refit-seq (sequential: each layer's
  moments re-collected on the model already pruned and refitted below it),
  refit-noint (refit without an intercept even where there is a bias: what the
  bias-free architectures get), refit-ridge=X (another ridge).

Scorer variants beyond the registry: `refit-energy*(1-s)` (the refit-aware cost
times the sink-aware scorer's content share).
Encoders (`minilm`): lines of the same plays, masked-token perplexity.
Writes `--out` (default eval/results/studies/refit/dev-MODEL.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eval.common import RESULTS
from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.attention.sinks import SinkSpec
from pruner.checkpoints import loading
from pruner.core import arch, assets, data
from pruner.core.tables import change_cell, markdown_table
from pruner.evaluation.perplexity import masked_lines, paired_delta, sliding_windows, window_nll
from pruner.pruning import surgery
from pruner.pruning.calibrate import CalibrationOptions, calibrate
from pruner.pruning.compensation import compensate, refit_layer, refit_sequential
from pruner.pruning.scoring import SCORERS, Scorer, get_scorer
from pruner.pruning.selection import SelectionConfig, SelectionError, select
from pruner.runs.recipe import ModelSpec

CAL_PLAYS = ("othello", "as_you_like_it")
DEV_PLAYS = ("henry_v", "winters_tale")


def texts(plays):
    return [(assets.shakespeare("calibration") / f"{p}.txt").read_text() for p in plays]


def variants() -> dict[str, Scorer]:
    def content_share(inp, alive, conv):
        return SCORERS["refit-energy"](inp, alive) * (1 - inp.stats.sink_mass)

    return {"refit-energy*(1-s)": Scorer("refit-energy*(1-s)", content_share, adaptive=True)}


def scorer_of(name: str) -> Scorer:
    return variants().get(name) or get_scorer(name)


def compensation(name: str, model, heads, outputs, collect, ridge: float):
    if name in ("zero", "mean", "refit"):
        return compensate(model, heads, outputs, name, ridge)
    if name == "refit-seq":
        return refit_sequential(model, heads, collect, ridge)
    if name == "refit-noint":
        comp = surgery.Compensation("refit")
        for layer, hs in heads.items():
            fit = refit_layer(model, layer, hs, outputs[layer], ridge, intercept=False)
            comp.weight[layer] = fit.delta_w.float()
        return comp
    if name.startswith("refit-ridge="):
        return compensate(model, heads, outputs, "refit", float(name.split("=")[1]))
    raise ValueError(name)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}")
    ap.add_argument("model", nargs="?", default="minilm-causal")
    ap.add_argument("--targets", default="0.1,0.25,0.4,0.5")
    ap.add_argument("--windows", type=int, default=256)
    ap.add_argument("--scorers", default="sink-aware,fluctuation,refit-energy,refit-energy*(1-s),cosine,gradient")
    ap.add_argument("--comps", default="zero,mean,refit,refit-seq")
    ap.add_argument("--ridge", type=float, default=1e-3)
    ap.add_argument("--budget", default="global")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    encoder = args.model == "minilm"
    model = loading.load_base(ModelSpec(path=args.model, mlm_readout="shipped" if encoder else None))
    tok = loading.load_tokenizer(args.model)
    scorers = args.scorers.split(",")
    cal, dev, sinks = samples(tok, encoder, args.windows)
    inputs = calibrate(model, cal, sinks, tok, config=CaptureConfig(metrics=("cosine",), outputs=True),
                       options=CalibrationOptions(gradient="gradient" in scorers, ridge=args.ridge, seed=0))
    outputs = inputs.stats.outputs

    def collect():
        return capture_stats(model, cal, sinks, tok, CaptureConfig(metrics=(), outputs=True)).outputs

    def nll():
        return window_nll(model, dev, causal=not encoder)

    base = nll()
    geom = arch.geometry(model)
    targets = [float(t) for t in args.targets.split(",")]
    comps = args.comps.split(",")
    print(f"{args.model}: dev perplexity {paired_delta(base, base, n_boot=1).base:.2f} on {len(dev)} "
          f"{'lines' if encoder else 'windows'} ({'+'.join(DEV_PLAYS)}); calibration {len(cal)} samples of "
          f"{'+'.join(CAL_PLAYS)}; ridge {args.ridge:g}", flush=True)
    records = []
    for name in scorers:
        for t in targets:
            try:
                plan = select(scorer_of(name), inputs, geom, SelectionConfig(target=t, budget=args.budget))
            except SelectionError as e:
                print(f"{name} @ {t:g}: {e}")
                continue
            for c in comps:
                comp = compensation(c, model, plan.heads, outputs, collect, args.ridge)
                with surgery.masked(model, plan.heads, comp):
                    d = paired_delta(base, nll(), n_boot=1000)
                unexplained = sum(f["unexplained"] for f in comp.fits.values()) if comp.fits else None
                records.append({"scorer": name, "target": t, "compensation": c, "heads": plan.heads,
                                "delta": d.delta, "ci_low": d.ci_low, "ci_high": d.ci_high, "base": d.base,
                                "unexplained": unexplained})
                print(f"{name:20s} {t:5.2f} {c:12s} {d.delta:+8.2f} [{d.ci_low:+.2f}, {d.ci_high:+.2f}]", flush=True)
    write(args, len(dev), records, round(time.time() - t0))
    print_table(records, targets)


def samples(tok, encoder: bool, windows: int):
    """(calibration samples, development windows, sinks): lines and special-token sinks for the encoder, token
    windows and the first token for the decoders."""
    if encoder:
        return (data.samples(tok, texts(CAL_PLAYS), "lines", 64, num_samples=256, seed=0),
                masked_lines(tok, texts(DEV_PLAYS), 64, num_samples=windows, seed=0), SinkSpec("special"))
    return (data.token_windows(tok, texts(CAL_PLAYS), 128, num_samples=64, seed=0),
            sliding_windows(tok, texts(DEV_PLAYS), 128, max_windows=windows), SinkSpec("first"))


def write(args, windows: int, records: list[dict], seconds: int) -> None:
    """The records, with the settings they were made with, into the results file."""
    out = Path(args.out or RESULTS / "studies" / "refit" / f"dev-{args.model}.json")
    out.write_text(json.dumps({"model": args.model, "windows": windows, "ridge": args.ridge, "budget": args.budget,
                               "records": records, "seconds": seconds}, indent=1) + "\n")


def print_table(records: list[dict], targets: list[float]) -> None:
    cell = {(r["scorer"], r["compensation"], r["target"]): r for r in records}
    rows = [[s, c] + [change_cell(cell.get((s, c, t))) for t in targets]
            for s in dict.fromkeys(r["scorer"] for r in records) for c in dict.fromkeys(r["compensation"] for r in records)]
    print("\n" + markdown_table(["scorer", "compensation"] + [f"{t:g}" for t in targets], rows))


if __name__ == "__main__":
    main()
