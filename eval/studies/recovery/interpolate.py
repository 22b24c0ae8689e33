"""The straight path from the pruned to the recovered weights, on development text only: is a point between them
better than either end (weight interpolation, as WiSE-FT does for fine-tuning), and would the recovery's own
validation KL find it?

    python -m eval.studies.recovery.interpolate MODEL SPARSITY RECOVERED [--alphas 0 0.25 0.5 0.75 1] [--out OUT]

The run is OUT/runs/MODEL-SPARSITY (eval.studies.recovery.study's; default OUT eval/results/studies/recovery) and
RECOVERED a `pruner recover` output of it with `generated` data. For each alpha, the weights pruned + alpha (recovered -
pruned): the validation KL on the recovery's held-back generated windows (what a guard can choose alpha on) and
R on the development text of both domains (`shakespeare:calibration`, `python-docs:dev`; 64 windows of 128 tokens),
never the evaluation windows. Prints a markdown table; appends the rows to OUT/interpolate.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eval.common import RESULTS
from eval.studies.recovery.measure import DEV, damage, reference, window_nll, windows


def validation_windows(run: Path, spec):
    """The recovery's held-back windows: the first rows of the run's generated set for this budget."""
    from pruner.core import data
    from pruner.recovery import data as rdata

    n_train, n_val = rdata.counts(spec)
    loaded = (torch.load(p, weights_only=True) for p in (run / "recovery-cache").glob("generated-*.pt"))
    sets = [ids for ids in loaded if len(ids) == n_train + n_val]
    if len(sets) != 1:
        raise SystemExit(f"{run}/recovery-cache: {len(sets)} generated sets of {n_train + n_val} windows, not one")
    ids = sets[0][:n_val]
    batch = data.TokenBatch(ids, torch.ones_like(ids))
    return rdata.Windows(batch, batch, rdata.GENERATED, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("sparsity")
    ap.add_argument("recovered")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0, 0.25, 0.5, 0.75, 1])
    ap.add_argument("--out", default=str(RESULTS / "studies" / "recovery"))
    args = ap.parse_args()
    import pruner
    from pruner.checkpoints import loading
    from pruner.recovery.spec import RecoverySpec
    from pruner.recovery.teacher import Resident
    from pruner.recovery.train import validation_kl

    out, rec = Path(args.out), Path(args.recovered)
    run = out / "runs" / f"{args.model}-{args.sparsity}"
    spec = RecoverySpec(**json.loads((rec / "metrics.json").read_text())["recovery"]["spec"])
    ref = reference(run, args.model, DEV, "dev-reference.json", plain=False)
    tok, teacher = loading.load_tokenizer(args.model), loading.load_model(args.model).float().eval()
    model = pruner.load(run / "model").float().eval()
    pruned = {k: v.clone() for k, v in model.state_dict().items()}
    recovered = pruner.load(rec / "model").float().state_dict()
    val = validation_windows(run, spec)
    rows = []
    for a in args.alphas:
        model.load_state_dict({k: p + a * (recovered[k] - p) if p.is_floating_point() else p
                               for k, p in pruned.items()})
        row = {"model": args.model, "sparsity": float(args.sparsity), "recovered": rec.name, "alpha": a,
               "validation_kl": validation_kl(model, Resident(teacher, spec.temperature), val, spec, 0)}
        for d in DEV:
            total, count = window_nll(model, windows(tok, d))
            row[d] = damage(ref[d]["base"], ref[d]["pruned"], sum(total) / sum(count))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out / "interpolate.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n| alpha | validation KL | {' | '.join(f'{d} ppl / R' for d in DEV)} |")
    print("|---|---|" + "---|" * len(DEV))
    for r in rows:
        cells = [f"{r[d]['ppl_recovered']:.2f} / {r[d]['R']:.2f}" if r[d]["R"] is not None else
                 f"{r[d]['ppl_recovered']:.2f} / n/a" for d in DEV]
        print(f"| {r['alpha']:g} | {r['validation_kl']:.5f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
