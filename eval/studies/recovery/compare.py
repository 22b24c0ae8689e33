"""Two recoveries of the same run compared on the same windows: the difference of their damage recovered with its
95% paired bootstrap interval (docs/recovery.md: is `cached` behind `resident`, or is the gap noise?).

    python -m eval.studies.recovery.compare MODEL RUN_DIR A=MODEL_DIR B=MODEL_DIR [--windows N|all]

MODEL is the run's base (a shipped name), RUN_DIR a run folder eval.studies.recovery.study made (its reference.json,
reference-all.json with `--windows all`, holds the base and pruned models' per-window NLL sums), A and B two
recovered model/ folders of it. For each held-out domain: R of each, R_A - R_B, and the interval over 2,000
resamples of 64 contiguous blocks of the windows (one window each at the default 64; the same resample for both:
paired). Prints a markdown table; writes nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

import pruner
from eval.studies.recovery.measure import DOMAINS, blocks, reference_path, window_count, window_nll, windows
from pruner.checkpoints import loading


def _recovered(base: np.ndarray, pruned: np.ndarray, after: np.ndarray) -> float:
    """R = (NLL_pruned - NLL_recovered) / (NLL_pruned - NLL_base) from per-block sums."""
    return (pruned.sum() - after.sum()) / (pruned.sum() - base.sum())


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("run")
    ap.add_argument("a", metavar="A=MODEL_DIR")
    ap.add_argument("b", metavar="B=MODEL_DIR")
    ap.add_argument("--windows", type=window_count, default=64, help="the windows the study scored: N "
                    "or all")
    args = ap.parse_args()
    torch.set_num_threads(1)
    count = args.windows
    ref = json.loads(reference_path(Path(args.run), count).read_text())
    tok = loading.load_tokenizer(args.model)
    (na, pa), (nb, pb) = (x.split("=", 1) for x in (args.a, args.b))
    ma, mb = pruner.load(pa).float(), pruner.load(pb).float()
    print(f"| domain | R {na} | R {nb} | R {na} - R {nb} [95% CI] |")
    print("|---|---|---|---|")
    for d in (d for d in DOMAINS if d in ref):  # references made before package-docs was scored hold two
        w, r = windows(tok, d, count), ref[d]["windows"]
        base, pruned = blocks(r["base"]), blocks(r["pruned"])
        a, b = blocks(window_nll(ma, w)[0]), blocks(window_nll(mb, w)[0])
        idx = np.random.default_rng(0).integers(0, len(base), (2000, len(base)))  # (resample, block)
        lost = (pruned[idx] - base[idx]).sum(1)
        diff = ((b[idx] - a[idx]).sum(1) / lost)[lost > 0]  # R_A - R_B = (NLL_B - NLL_A) / (NLL_pruned - NLL_base)
        ra, rb = (_recovered(base, pruned, x) for x in (a, b))
        print(f"| {d} | {ra:.2f} | {rb:.2f} | {ra - rb:+.2f} [{np.quantile(diff, 0.025):+.2f}, "
              f"{np.quantile(diff, 0.975):+.2f}] |", flush=True)


if __name__ == "__main__":
    main()
