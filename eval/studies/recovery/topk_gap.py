"""The KL gap of the cached teacher: full-vocabulary KL(teacher || pruned student) against what the cache allows --
the top-k + collapsed tail bin, and the top-k + m tokens sampled from the tail -- on the same windows
(docs/recovery.md).

    python -m eval.studies.recovery.topk_gap MODEL RUN_DIR [--k 64] [--m 8] [--windows 16]

MODEL is the run's base (a shipped name), RUN_DIR a `pruner prune` run folder (its model/ is the student).
Prints the mean KL per token the three ways, their ratios and the teacher's mean tail mass beyond the top k, on
windows of 128 tokens of shakespeare:evaluation and python-docs:evaluation (what recovery is measured on).
Writes nothing.
"""

from __future__ import annotations

import argparse

import torch

import pruner
from pruner.checkpoints import loading
from pruner.core import data
from pruner.evaluation.perplexity import sliding_windows
from pruner.recovery import loss


@torch.no_grad()
def gap(teacher, student, windows, k: int, m: int) -> dict:
    full = top = sampled = tail = n = 0.0
    g = torch.Generator().manual_seed(0)
    for i in range(0, len(windows), 4):
        ids, mask = windows.input_ids[i:i + 4], windows.attention_mask[i:i + 4]
        t = teacher(input_ids=ids, attention_mask=mask).logits
        s = student(input_ids=ids, attention_mask=mask).logits
        f, c = loss.full_kl(s, t, mask)
        targets = loss.topk_targets(t, k)
        collapsed, _ = loss.topk_kl(s, *targets, mask)
        estimate, _ = loss.topk_kl(s, *targets, mask, samples=loss.tail_samples(t, targets[1], m, g))
        full, top, n = full + float(f), top + float(collapsed), n + float(c)
        sampled += float(estimate)
        tail += float((targets[2].exp() * mask).sum())
    return {"full_kl": full / n, "topk_kl": top / n, "ratio": top / full, "sampled_kl": sampled / n,
            "sampled_ratio": sampled / full, "tail_mass": tail / n}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("run")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--m", type=int, default=8, help="tail samples per token")
    ap.add_argument("--windows", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = loading.load_tokenizer(args.model)
    teacher, student = loading.load_model(args.model), pruner.load(f"{args.run}/model").float()
    for domain in ("shakespeare:evaluation", "python-docs:evaluation"):
        w = sliding_windows(tok, data.load_texts(data.TextSource(domain)), 128, max_windows=args.windows)
        r = gap(teacher, student, w, args.k, args.m)
        print(f"{args.model} {domain} k={args.k}: full KL {r['full_kl']:.4f}, top-k + collapsed tail "
              f"{r['topk_kl']:.4f} ({r['ratio']:.1%} of it), top-k + {args.m} tail samples {r['sampled_kl']:.4f} "
              f"({r['sampled_ratio']:.1%}), teacher tail mass beyond the top k {r['tail_mass']:.3f}")


if __name__ == "__main__":
    main()
