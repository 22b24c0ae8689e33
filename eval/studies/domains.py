"""Choosing the default scorer on development splits of two kinds of text (issue 26), never the evaluation ones.

    python -m eval.studies.domains [--models minilm-causal,gpt2-shakespeare,llama-shakespeare] [--windows 128]

Calibration: two plays of the calibration split (othello, as_you_like_it), as eval.studies.scorers does;
development perplexity on the other two (henry_v, winters_tale) and on `python-docs:dev` (the standard
library's docstrings of the dev modules). Candidates are importance scores defined here on the registry's
`ScoringInputs`, run through the registry's selection and scoped masks with the default compensation
(refit, ridge auto) and with mean compensation. The candidates test the issue's lead -- pricing each
layer's output energy in loss units (the loss gradient's energy at the layer's attention output, from one
backward pass over the calibration windows) instead of the residual-norm heuristic -- against the current
default (`sink-aware`) and the refit-aware scorer. Prints one table per domain and the mean rank of each
candidate over every (model, domain, compensation, sparsity) cell; writes eval/results/studies/domains/dev.json.
"""

from __future__ import annotations

import argparse
import json

import torch

from eval.common import RESULTS
from pruner.attention.capture import CaptureConfig
from pruner.attention.sinks import SinkSpec
from pruner.checkpoints import loading
from pruner.core import arch, assets, data
from pruner.core.runtime import forward
from pruner.core.tables import markdown_table
from pruner.evaluation.perplexity import paired_delta, sliding_windows, window_nll
from pruner.pruning import surgery
from pruner.pruning.calibrate import calibrate
from pruner.pruning.compensation import compensate
from pruner.pruning.scoring import SCORERS, Scorer, refit_costs
from pruner.pruning.selection import SelectionConfig, SelectionError, select

CAL_PLAYS = ("othello", "as_you_like_it")
DEV_PLAYS = ("henry_v", "winters_tale")
SENSITIVITY: torch.Tensor | None = None  # (layer,) E||dL/d(attention output)||^2 per token, this model


def plays(names):
    return [(assets.shakespeare("calibration") / f"{p}.txt").read_text() for p in names]


def loss_sensitivity(model, batch: data.TokenBatch) -> torch.Tensor:
    """Per layer, the mean squared norm of the loss gradient at the attention block's output (the output
    projection's output) per real token: what a unit of output energy costs in loss, to first order."""
    ad = arch.adapter_for(model)
    sums = torch.zeros(arch.geometry(model).n_layers, dtype=torch.float64)
    outs = {}
    hooks = [arch.get(b, ad.o_proj).register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o))
             for i, b in enumerate(arch.blocks(model))]
    tokens = 0
    try:
        for b in batch.batches(8):
            outs.clear()
            logits = forward(model, b.input_ids, b.attention_mask).logits[:, :-1]
            target = b.input_ids[:, 1:].masked_fill(b.attention_mask[:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100,
                                                     reduction="sum")
            grads = torch.autograd.grad(loss, [outs[i] for i in sorted(outs)])
            for i, g in enumerate(grads):
                sums[i] += g.double().square().sum()
            tokens += int((target != -100).sum())
    finally:
        for h in hooks:
            h.remove()
    return sums / tokens


def candidates() -> dict[str, Scorer]:
    def marginal(inp, alive):
        k = inp.cross
        return torch.diagonal(k, dim1=-2, dim2=-1) + 2 * torch.einsum("lhg,lg->lh", k, (~alive).to(k.dtype))

    def loss_priced(inp, alive, conv):  # mean-compensation energy, in loss units, content share kept
        return marginal(inp, alive) * (1 - inp.stats.sink_mass) * SENSITIVITY[:, None]

    def loss_priced_plain(inp, alive, conv):  # the same without the content-share factor
        return marginal(inp, alive) * SENSITIVITY[:, None]

    def refit_loss_priced(inp, alive, conv):  # what refit cannot rebuild, in loss units
        return refit_costs(inp, alive) * SENSITIVITY.double()[:, None]

    return {
        "sink-aware": SCORERS["sink-aware"], "refit-energy": SCORERS["refit-energy"],
        "fluctuation": SCORERS["fluctuation"], "output-norm": SCORERS["output-norm"],
        "sink-aware, loss units": Scorer("sink-aware, loss units", loss_priced, adaptive=True),
        "joint energy, loss units": Scorer("joint energy, loss units", loss_priced_plain, adaptive=True),
        "refit-energy, loss units": Scorer("refit-energy, loss units", refit_loss_priced, adaptive=True),
    }


def study(name: str, windows: int, targets: list[float], comps: list[str]) -> list[dict]:
    global SENSITIVITY
    model, tok = loading.load_model(name), loading.load_tokenizer(name)
    cal = data.token_windows(tok, plays(CAL_PLAYS), 128, num_samples=64, seed=0)
    inputs = calibrate(model, cal, SinkSpec("first"), tok, config=CaptureConfig(metrics=("cosine",), outputs=True,
                                                                                 folds=4))
    SENSITIVITY = loss_sensitivity(model, cal)
    domains = {"plays-dev": sliding_windows(tok, plays(DEV_PLAYS), 128, max_windows=windows),
               "python-docs-dev": sliding_windows(tok, data.load_texts(data.TextSource("python-docs:dev")), 128,
                                                  max_windows=windows)}
    geom = arch.geometry(model)
    records = []
    for domain, dev in domains.items():
        base = window_nll(model, dev)
        for cand, scorer in candidates().items():
            for t in targets:
                try:
                    plan = select(scorer, inputs, geom, SelectionConfig(target=t))
                except SelectionError:
                    continue
                for c in comps:
                    comp = compensate(model, plan.heads, inputs.stats.outputs, c, "auto", inputs.stats.folds)
                    with surgery.masked(model, plan.heads, comp):
                        d = paired_delta(base, window_nll(model, dev), n_boot=200)
                    records.append({"model": name, "domain": domain, "scorer": cand, "sparsity": t,
                                    "compensation": c, "delta": d.delta, "ci_low": d.ci_low, "ci_high": d.ci_high,
                                    "base": d.base})
                    print(f"{name} {domain} {cand:28s} {t:4g} {c:5s} {d.delta:+9.2f}", flush=True)
    return records


def ranks(records: list[dict]) -> dict[str, float]:
    """Mean rank of each candidate (1 = best) over every (model, domain, compensation, sparsity) cell."""
    cells: dict[tuple, list] = {}
    for r in records:
        cells.setdefault((r["model"], r["domain"], r["compensation"], r["sparsity"]), []).append(r)
    out: dict[str, list[int]] = {}
    for rs in cells.values():
        for i, r in enumerate(sorted(rs, key=lambda r: r["delta"])):
            out.setdefault(r["scorer"], []).append(i + 1)
    return {k: sum(v) / len(v) for k, v in sorted(out.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm-causal,gpt2-shakespeare,llama-shakespeare")
    ap.add_argument("--windows", type=int, default=128)
    ap.add_argument("--targets", default="0.25,0.5")
    ap.add_argument("--comps", default="refit,mean")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    records = []
    for name in args.models.split(","):
        records += study(name, args.windows, [float(t) for t in args.targets.split(",")], args.comps.split(","))
    (RESULTS / "studies" / "domains" / "dev.json").write_text(json.dumps(records, indent=1) + "\n")
    cols = sorted({(r["compensation"], r["sparsity"]) for r in records})
    for model in dict.fromkeys(r["model"] for r in records):
        for domain in dict.fromkeys(r["domain"] for r in records):
            cell = {(r["scorer"], r["compensation"], r["sparsity"]): r["delta"] for r in records
                    if r["model"] == model and r["domain"] == domain}
            rows = [[s] + [f"{cell[(s, c, t)]:+.2f}" if (s, c, t) in cell else "n/a" for c, t in cols]
                    for s in candidates()]
            print(f"\n{model}, {domain}:\n" + markdown_table(["scorer"] + [f"{c} @ {t:g}" for c, t in cols], rows))
    print("\nmean rank over every cell (1 = best):\n" + markdown_table(
        ["scorer", "mean rank"], [[k, f"{v:.2f}"] for k, v in ranks(records).items()]))


if __name__ == "__main__":
    main()
