"""The recovery learning rate, chosen on the development split only: the validation KL of the held-back slice of the
recovery data (never the evaluation windows) for each learning rate.

    python eval/recovery_lr_dev.py MODEL SPARSITY [--lrs 1e-3 3e-4 1e-4 3e-5] [--tokens 32768]
                                   [--data generated] [--set recovery.KEY=V ...] [--out eval/results/recovery]

The run is the one eval/recovery_study.py prunes (default scorer refit-energy, refit, remove); each learning rate
is a `pruner recover RUN --set recovery.lr=LR` in its own process. Prints, per learning rate, the validation KL
of the pruned model, after every validation pass, the best with the step it was reached at and the restarts
(`recovery.restarts`; `--set recovery.restarts=0` measures a learning rate alone); appends the rows
to OUT/lr_dev.jsonl. The evaluation perplexities `pruner recover` writes are not read here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recovery_study import ROOT, cli, run_folder  # beside this script: python puts eval/ on the path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("sparsity")
    ap.add_argument("--lrs", nargs="+", default=["1e-3", "3e-4", "1e-4", "3e-5"])
    ap.add_argument("--tokens", default="32768")
    ap.add_argument("--data", default="generated")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--out", default=str(ROOT / "eval" / "results" / "recovery"))
    args = ap.parse_args()
    out = Path(args.out)
    run = run_folder(out, args.model, args.sparsity)
    print("| lr | validation KL: pruned | after each pass | best (step) | kept | restarts (step, lr) | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for lr in args.lrs:
        rec = out / "lr-dev" / f"{args.model}-{args.sparsity}-{lr}"
        sets = [x for s in [f"recovery.lr={lr}", *args.sets] for x in ("--set", s)]
        wall, _ = cli(["recover", str(run), "--out", str(rec), "--overwrite", "--tokens", args.tokens,
                       "--data", args.data, *sets])
        m = json.loads((rec / "metrics.json").read_text())["recovery"]
        row = {"model": args.model, "sparsity": float(args.sparsity), "tokens": int(args.tokens), "data": args.data,
               "lr": float(lr), "sets": args.sets, "validation_history": m["validation_history"],
               "validation_kl_pruned": m["validation_kl_pruned"], "validation_kl_best": m["validation_kl_best"],
               "best_step": m["best_step"], "kept": m["kept"], "restarts": m.get("restarts", []),
               "tokens_per_second": m["tokens_per_second"],
               "wall_s": round(wall, 1)}
        with open(out / "lr_dev.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        restarts = ", ".join(f"{k}: {r:.2g}" for k, r in m.get("restarts", [])) or "none"
        passes = " ".join(f"{v:.4f}" for _, v in m["validation_history"][1:])
        print(f"| {lr} | {m['validation_kl_pruned']:.4f} | {passes} | {m['validation_kl_best']:.4f} "
              f"({m['best_step']}) | {m['kept']} | {restarts} | {m['tokens_per_second']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
