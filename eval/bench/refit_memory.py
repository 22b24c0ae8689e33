"""The working set of one layer's refit, in (H d_head)^2 float64 matrices ("squares"), against the memory model.

    python -m eval.bench.refit_memory [--d 4096] [--d-model 4096] [--folds 4] [--pruned 0.5]

A layer of the Llama-3-8B width by default (H d_head = d_model = 4096: a square is 128 MiB): random float64
moments, a bfloat16 output projection, every second channel pruned. Measures the process's anonymous memory
(RssAnon, sampled every 2 ms) above what the inputs already hold, while `refit.choose_ridge` (ridge auto over
the folds) and then `refit.second_moment` + `refit.fit_layer` run, and prints both next to
`pruner.runs.calibration_memory.REFIT_SQUARES`, the squares the memory model counts for them. Writes nothing.
"""

from __future__ import annotations

import argparse

import torch

from pruner.core.proc_status import Sampler, status
from pruner.pruning import refit
from pruner.runs.calibration_memory import REFIT_SQUARES


def peak_above(fn) -> int:
    """Peak RssAnon while `fn()` runs (sampled every 2 ms), above RssAnon before it."""
    base = status()["RssAnon"]
    with Sampler() as sampled:
        fn()
    return sampled.peaks["RssAnon"] - base


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=4096, help="H d_head: the output projection's input channels")
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--folds", type=int, default=4)
    ap.add_argument("--pruned", type=float, default=0.5)
    args = ap.parse_args()
    torch.manual_seed(0)
    D = args.d
    x = torch.randn(D, D // 2, dtype=torch.float64)
    joint = torch.stack([x @ x.t() + torch.eye(D, dtype=torch.float64) for _ in range(args.folds)])  # fold sums
    del x
    o = torch.randn(args.folds, D, dtype=torch.float64)
    n = torch.full((args.folds,), float(D), dtype=torch.float64)
    total = joint.sum(0)
    w = torch.randn(args.d_model, D).to(torch.bfloat16)
    pruned = torch.zeros(D, dtype=torch.bool)
    pruned[:: max(1, round(1 / args.pruned))] = True
    square = D * D * 8
    ridge = peak_above(lambda: refit.choose_ridge(w, joint, o, n, pruned, True))
    fit = peak_above(lambda: refit.fit_layer(w, *refit.second_moment(o.sum(0), total, n.sum(), True), pruned, 1e-3))
    print(f"D = {D}, d_model = {args.d_model}, {args.folds} folds, {int(pruned.sum())} channels pruned; "
          f"a square is {square / 2**20:.0f} MiB")
    print(f"ridge auto (choose_ridge) above its sums:               {ridge / square:.2f} squares")
    print(f"the fit (second_moment + fit_layer) above its sums:      {fit / square:.2f} squares "
          f"(the new columns, (d_model, D) float64, included)")
    print(f"the memory model counts:                                {REFIT_SQUARES} squares for either")


if __name__ == "__main__":
    main()
