"""Where recovery moves a student: its next-token NLL, its entropy and its KL to the teacher, next to the teacher's,
on development text (docs/recovery.md, "Why the plays do not come back").

    python -m eval.studies.recovery.entropy MODEL NAME=MODEL_DIR [NAME=MODEL_DIR ...] [--domains D ...]

MODEL is the base (a shipped name: the teacher); each NAME=MODEL_DIR a student checkpoint folder (a run's model/,
pruned or recovered). For each domain (default: the development text of eval.studies.recovery.dev, never the evaluation
windows) and each model, over 64 windows of 128 tokens: the mean NLL of the text, the mean entropy of the model's
next-token distribution, their difference (NLL - entropy: > 0 where the model is more confident than the text
bears out) and the mean full-vocabulary KL(teacher || model). A student flatter than its teacher (higher entropy)
pays on text the teacher predicts well and gains where the teacher is overconfident. Prints a markdown table;
writes nothing.
"""

from __future__ import annotations

import argparse

import torch

import pruner
from eval.studies.recovery.measure import DEV, divergence, window_nll, windows
from pruner.checkpoints import loading


def measure(teacher, model, w) -> dict:
    """Mean NLL, entropy and KL(teacher || model) per predicted token of the windows `w`."""
    total, count = window_nll(model, w)
    div, n = divergence(teacher, model, w), sum(count)
    return {"nll": sum(total) / n, "entropy": sum(div["entropy"]) / n, "kl": sum(div["kl"]) / n}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("students", nargs="+", metavar="NAME=MODEL_DIR")
    ap.add_argument("--domains", nargs="+", default=list(DEV))
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok, teacher = loading.load_tokenizer(args.model), loading.load_model(args.model).float()
    models = {"teacher (base)": teacher} | {name: pruner.load(path).float()
                                           for name, path in (s.split("=", 1) for s in args.students)}
    print("| domain | model | NLL | entropy | NLL - entropy | KL(teacher ‖ model) |")
    print("|---|---|---|---|---|---|")
    for domain in args.domains:
        w = windows(tok, domain)
        for name, m in models.items():
            r = measure(teacher, m, w)
            print(f"| {domain} | {name} | {r['nll']:.4f} | {r['entropy']:.4f} | {r['nll'] - r['entropy']:+.4f} | "
                  f"{r['kl']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
