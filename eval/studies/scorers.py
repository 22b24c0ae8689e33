"""Design study for the sink-aware scorer, on a development split (never the evaluation split).

    python -m eval.studies.scorers [MODEL] [--targets 0.25,0.4,0.5] [--windows 48]

Calibration: 2 plays of the calibration split; development perplexity: the
other 2 plays. Candidate scores are defined here (pure functions of the same
`ScoringInputs` the registry uses), run through the registry's selection and
scoped masks, and printed as a table of perplexity changes. Writes nothing.
"""

from __future__ import annotations

import argparse

import torch

from pruner.attention.capture import CaptureConfig
from pruner.attention.sinks import SinkSpec
from pruner.checkpoints import loading
from pruner.core import arch, assets, data
from pruner.evaluation.perplexity import paired_delta, sliding_windows, window_nll
from pruner.pruning import surgery
from pruner.pruning.calibrate import CalibrationOptions, calibrate
from pruner.pruning.compensation import compensation_bias
from pruner.pruning.scoring import SCORERS, Scorer, _max_similarity, fluctuation_exact
from pruner.pruning.selection import SelectionConfig, select

CAL_PLAYS = ("othello", "as_you_like_it")
DEV_PLAYS = ("henry_v", "winters_tale")


def texts(plays):
    return [(assets.shakespeare("calibration") / f"{p}.txt").read_text() for p in plays]


RESID: torch.Tensor | None = None  # (layer,) mean squared norm of the residual stream at the layer's input


def residual_energy(model, batch) -> torch.Tensor:
    from pruner.core.runtime import forward

    with torch.no_grad():
        hs = forward(model, batch.input_ids, batch.attention_mask, output_hidden_states=True).hidden_states
    return torch.stack([h.double().pow(2).sum(-1).mean() for h in hs[:-1]])


# --- candidate sink-aware scores (importance, higher = keep) ---------------------------------------

def energy(inp, alive, conv):
    return fluctuation_exact(inp)["o"]


def content_only(inp, alive, conv):
    f = fluctuation_exact(inp)
    return f["w"]


def redundancy_discount(inp, alive, conv):
    rho = _max_similarity(inp.stats.pairs["cosine/content"], alive)
    return fluctuation_exact(inp)["o"] * (1 - rho ** 2)


def rel_layer(inp, alive, conv):
    f = fluctuation_exact(inp)["o"]
    return f / f.sum(-1, keepdim=True)


def content_weight(inp, alive, conv):
    return fluctuation_exact(inp)["o"] * (1 - inp.stats.sink_mass)


def rel_resid(inp, alive, conv):
    return fluctuation_exact(inp)["o"] / RESID[:, None]


def content_rel_resid(inp, alive, conv):
    return fluctuation_exact(inp)["w"] / RESID[:, None]


def split_half(inp, alive, conv):
    f = fluctuation_exact(inp)
    return f["w"] + 0.5 * f["u"]


def flap_content_weight(inp, alive, conv):
    return SCORERS["fluctuation"](inp, alive) * (1 - inp.stats.sink_mass)


def content_x_content_weight(inp, alive, conv):
    return fluctuation_exact(inp)["w"] * (1 - inp.stats.sink_mass)


def exact_x_sq(inp, alive, conv):
    return fluctuation_exact(inp)["o"] * (1 - inp.stats.sink_mass) ** 2


def flap_of(inp, key):
    rows = []
    for m, g in zip(inp.stats.outputs, inp.gram):
        mean = getattr(m, key) / m.tokens
        var = torch.diagonal(getattr(m, key + key), dim1=-2, dim2=-1) / m.tokens - mean ** 2
        rows.append((var * torch.diagonal(g, dim1=-2, dim2=-1)).sum(-1))
    return torch.stack(rows)


def flap_w(inp, alive, conv):
    return flap_of(inp, "w")


def flap_sqrt(inp, alive, conv):
    return flap_of(inp, "o") * (1 - inp.stats.sink_mass).sqrt()


def flap_w_plus_u(inp, alive, conv):
    return flap_of(inp, "w") + flap_of(inp, "u") * (1 - inp.stats.sink_mass)


def joint(inp, alive, conv, weight=None):
    k = inp.cross
    pruned = (~alive).double()  # (L, H)
    marginal = torch.diagonal(k, dim1=-2, dim2=-1) + 2 * torch.einsum("lhg,lg->lh", k, pruned)
    return marginal if weight is None else marginal * weight(inp)


def variants() -> dict[str, Scorer]:
    """Candidate sink-aware scores (importance, higher = keep)."""
    return {
        "joint-x-(1-s)/resid": Scorer("joint-x-(1-s)/resid", lambda i, a, c: joint(
            i, a, c, lambda x: (1 - x.stats.sink_mass) / RESID[:, None]), adaptive=True),
        "flap/resid": Scorer("flap/resid", lambda i, a, c: SCORERS["fluctuation"](i, a) / RESID[:, None]),
        "joint": Scorer("joint", joint, adaptive=True),
        "joint-x-(1-s)": Scorer("joint-x-(1-s)", lambda i, a, c: joint(i, a, c, lambda x: 1 - x.stats.sink_mass),
                                adaptive=True),
        "flap-w": Scorer("flap-w", flap_w),
        "flap-x-sqrt(1-s)": Scorer("flap-x-sqrt(1-s)", flap_sqrt),
        "flap-w+(1-s)u": Scorer("flap-w+(1-s)u", flap_w_plus_u),
        "flap-x-(1-s)": Scorer("flap-x-(1-s)", flap_content_weight),
        "fluct-w-x-(1-s)": Scorer("fluct-w-x-(1-s)", content_x_content_weight),
        "fluct-x-(1-s)^2": Scorer("fluct-x-(1-s)^2", exact_x_sq),
        "fluct/resid": Scorer("fluct/resid", rel_resid),
        "fluct-content/resid": Scorer("fluct-content/resid", content_rel_resid),
        "fluct-w+0.5u": Scorer("fluct-w+0.5u", split_half),
        "fluct-exact": Scorer("fluct-exact", energy),
        "fluct-content": Scorer("fluct-content", content_only),
        "fluct-x-(1-rho2)": Scorer("fluct-x-(1-rho2)", redundancy_discount, adaptive=True),
        "fluct-layer-share": Scorer("fluct-layer-share", rel_layer),
        "fluct-x-(1-s)": Scorer("fluct-x-(1-s)", content_weight),
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}")
    ap.add_argument("model", nargs="?", default="minilm-causal")
    ap.add_argument("--targets", default="0.25,0.4,0.5")
    ap.add_argument("--baselines", default="fluctuation,gradient,cosine")
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--only", default="", help="comma-separated subset of scorer names")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = loading.load_model(args.model), loading.load_tokenizer(args.model)
    cal = data.token_windows(tok, texts(CAL_PLAYS), 128, num_samples=64, seed=0)
    dev = sliding_windows(tok, texts(DEV_PLAYS), 128, max_windows=args.windows)
    inputs = calibrate(model, cal, SinkSpec("first"), tok,
                       config=CaptureConfig(metrics=("cosine",), outputs=True, channels=True),
                       options=CalibrationOptions(gradient="gradient" in args.baselines))
    base = window_nll(model, dev)
    global RESID
    RESID = residual_energy(model, cal)
    print("residual energy per layer:", [round(x, 1) for x in RESID.tolist()])
    geom = arch.geometry(model)
    scorers = {n: SCORERS[n] for n in args.baselines.split(",") if n} | variants()
    if args.only:
        scorers = {k: v for k, v in scorers.items() if k in args.only.split(",")}
    targets = [float(t) for t in args.targets.split(",")]
    print(f"{args.model}: base dev perplexity {paired_delta(base, base).base:.2f}; mean compensation")
    print(f"{'scorer':22s}" + "".join(f"{t:>10g}" for t in targets))
    for name, scorer in scorers.items():
        cells = []
        for t in targets:
            plan = select(scorer, inputs, geom, SelectionConfig(target=t))
            bias = compensation_bias(model, plan.heads, inputs.stats.outputs)
            with surgery.masked(model, plan.heads, bias):
                d = paired_delta(base, window_nll(model, dev), n_boot=1)
            cells.append(d.delta)
        print(f"{name:22s}" + "".join(f"{c:>+10.2f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
