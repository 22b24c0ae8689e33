"""What the recovery study and its satellites measure, shared: the pruned run of a shipped decoder, its held-out
windows, per-window NLL and KL, the damage recovered R and its bootstrap interval.

A run is `pruner prune` of a shipped recipe at a sparsity with the default scorer (refit-energy), refit
compensation and `surgery.mode: remove`, made once and kept in OUT/runs/MODEL-SPARSITY; its `reference`
(base and pruned NLLs per window) is computed once and kept beside it. Imported by eval.studies.recovery.study,
dev, compare, entropy and interpolate; not a script.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eval.common import ROOT, run_timed

DOMAINS = ("shakespeare:evaluation", "python-docs:evaluation", "package-docs:evaluation")
# development text: the calibration plays (the plays have no development split), the docstrings' and the packages'
# documentation's development splits
DEV = ("shakespeare:calibration", "python-docs:dev", "package-docs:dev")
RECIPES = {"gpt2-shakespeare": "gpt2-shakespeare.yaml", "llama-shakespeare": "llama-shakespeare.yaml",
           "minilm-causal": "quickstart.yaml", "gemma-3-270m": "gemma3-270m.yaml"}


def cli(args: list[str]) -> tuple[float, float]:
    """Run `pruner ARGS` in a child process; (wall seconds, this child's peak RSS in GiB: its own rusage, where
    RUSAGE_CHILDREN's would be the largest of every child so far)."""
    done = run_timed([sys.executable, "-m", "pruner.cli", *args], env=dict(os.environ), cwd=None)
    if done.returncode:
        raise SystemExit(f"pruner {' '.join(args)} failed: {done.output[-2000:]}")
    return done.seconds, done.peak_bytes / 2**30


def run_folder(out: Path, model: str, sparsity: str) -> Path:
    folder = out / "runs" / f"{model}-{sparsity}"
    if not (folder / "metrics.json").exists():
        cli(["prune", str(ROOT / "recipes" / RECIPES[model]), "--out", str(folder), "--overwrite",
             "--set", f"selection.target={sparsity}", "--set", "selection.shape=any",
             "--set", "surgery.compensation=refit",
             "--set", "surgery.mode=remove", "--set", "bench.enabled=false", "--set", "evaluation.latency=false"])
    return folder


def windows(tokenizer, domain: str, count: int | None = 64):
    """The windows of 128 tokens of `domain` every model is scored on: the first `count`, or every one (None).

    The first 64 are the opening 8,192 tokens of the split — on the plays, the first scenes of one play — so
    `--windows all` measures the domain where 64 measure one stretch of it."""
    from pruner.core import data
    from pruner.evaluation.perplexity import sliding_windows

    return sliding_windows(tokenizer, data.load_texts(data.TextSource(domain)), 128, max_windows=count)


def window_count(text: str) -> int | None:
    """`--windows`: a count, or `all` (None: every window)."""
    return None if text == "all" else int(text)


def nll(model, tokenizer, domain: str, count: int | None = 64) -> float:
    """Mean next-token NLL per token on the windows of `domain` (the first `count`, or every one)."""
    total, n = window_nll(model, windows(tokenizer, domain, count))
    return sum(total) / sum(n)


def window_nll(model, w) -> tuple[list[float], list[int]]:
    """Per window of `w`: the summed next-token NLL and the number of tokens predicted."""
    from pruner.evaluation.perplexity import window_scores

    total, count, _ = window_scores(model, w, 8, causal=True)
    return total.tolist(), count.tolist()


@torch.no_grad()
def divergence(teacher, model, w, batch: int = 8) -> dict[str, list[float]]:
    """Per window of `w`, summed over the positions its NLL counts: the full-vocabulary KL(teacher || model) and
    the entropies (nats) of the model and of the teacher."""
    kl, ent, ent_t = [], [], []
    model.eval()
    for i in range(0, len(w), batch):
        ids, mask = w.input_ids[i:i + batch], w.attention_mask[i:i + batch]
        on = (w.labels[i:i + batch, 1:] != -100).double()                          # (b, T-1)
        t = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        s = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)  # (b, T-1, V)
        kl += ((t.exp() * (t - s)).sum(-1).double() * on).sum(-1).tolist()
        ent += ((-(s.exp() * s).sum(-1)).double() * on).sum(-1).tolist()
        ent_t += ((-(t.exp() * t).sum(-1)).double() * on).sum(-1).tolist()
    return {"kl": kl, "entropy": ent, "entropy_teacher": ent_t}


def reference_path(run: Path, count: int | None = 64, name: str = "reference.json") -> Path:
    """Where a run keeps its `reference` for `count` windows: `name` for 64, `reference-all.json` for every one."""
    return run / (name if count == 64 else name.replace(".json", f"-{count or 'all'}.json"))


def reference(run: Path, model: str, domains: tuple[str, ...] = DOMAINS, name: str = "reference.json",
              plain: bool = True, count: int | None = 64) -> dict:
    """Base and pruned NLLs on `domains` (means, and per window with the pruned model's KL to the base) and
    (`plain`) the plain-training throughput, computed once per run and kept in the run folder
    (`reference_path`)."""
    path = reference_path(run, count, name)
    kept = json.loads(path.read_text()) if path.exists() else {}
    if kept and all("windows" in kept.get(d, {}) for d in domains) and (not plain or "plain_tokens_per_second" in kept):
        return kept
    import pruner
    from pruner.checkpoints import loading

    tok = loading.load_tokenizer(model)
    base, pruned = loading.load_model(model).float(), pruner.load(run / "model").float()
    ref = {}
    for d in domains:
        w = windows(tok, d, count)
        (b, n), (p, _) = window_nll(base, w), window_nll(pruned, w)
        div = divergence(base, pruned, w)
        ref[d] = {"base": sum(b) / sum(n), "pruned": sum(p) / sum(n),
                  "windows": {"count": n, "base": b, "pruned": p, "kl_pruned": div["kl"],
                              "entropy_pruned": div["entropy"], "entropy_base": div["entropy_teacher"]}}
    if plain:
        ref["plain_tokens_per_second"] = plain_training(pruned)
    path.write_text(json.dumps(ref, indent=1))
    return ref


def plain_training(model, steps: int = 6, batch: int = 8, length: int = 128) -> float:
    """Tokens/s of next-token cross-entropy training of `model` alone (AdamW, the recovery's batch), after a
    warm-up step: what training costs without a teacher."""
    from pruner.recovery.loss import next_token_ce

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (steps + 1, batch, length), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    mask = torch.ones(batch, length)
    for i in range(steps + 1):
        if i == 1:
            t0 = time.perf_counter()
        out = model(input_ids=ids[i], attention_mask=mask, use_cache=False).logits
        (next_token_ce(out, ids[i], mask) / mask.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * batch * length / (time.perf_counter() - t0)


def damage(b: float, p: float, after: float) -> dict:
    """A domain's perplexities (from the base, pruned and recovered NLLs) and the damage recovered
    R = (NLL_pruned - NLL_recovered) / (NLL_pruned - NLL_base); None where pruning did no damage."""
    return {"ppl_base": math.exp(b), "ppl_pruned": math.exp(p), "ppl_recovered": math.exp(after),
            "R": (p - after) / (p - b) if p > b else None}


def blocks(x: list[float], units: int = 64) -> np.ndarray:
    """Per-window sums summed over `units` contiguous blocks of windows (one window each where there are 64):
    the bootstrap's resampling unit, so that neighbouring windows of one scene are not counted as independent."""
    return np.asarray([c.sum() for c in np.array_split(np.asarray(x, dtype=float), min(units, len(x)))])


def held_out(ref: dict, total: list[float], div: dict[str, list[float]], resamples: int = 2000) -> dict:
    """A domain's `damage` record from per-window sums (`ref`: the reference's `windows`; `total`: the recovered
    model's NLL sums; `div`: its KL to the teacher and entropy), with R's 95% paired bootstrap interval over 64
    contiguous blocks of windows, the KL(teacher || model) per token of the pruned and recovered models on this
    text and the share of it recovery removed (R_KL = 1 - KL_recovered / KL_pruned: distillation's own objective,
    measured held out), and the entropies of base, pruned and recovered."""
    n = sum(ref["count"])
    base, pruned, after = (sum(x) / n for x in (ref["base"], ref["pruned"], total))
    out = damage(base, pruned, after)
    b, p, a = (blocks(x) for x in (ref["base"], ref["pruned"], total))
    idx = np.random.default_rng(0).integers(0, len(b), (resamples, len(b)))           # (resample, block)
    gap = p[idx].sum(1) - b[idx].sum(1)
    r = (p[idx].sum(1) - a[idx].sum(1))[gap > 0] / gap[gap > 0]
    kl_p, kl_r = sum(ref["kl_pruned"]) / n, sum(div["kl"]) / n
    out.update({"R_ci": [float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))] if out["R"] is not None
                else None,
                "kl_pruned": kl_p, "kl_recovered": kl_r, "R_kl": 1 - kl_r / kl_p,
                "entropy": [sum(ref["entropy_base"]) / n, sum(ref["entropy_pruned"]) / n, sum(div["entropy"]) / n]})
    return out


def cells(d: dict) -> tuple[str, str]:
    """A `damage` record's two table cells: the perplexities base / pruned / recovered, and R (with its 95%
    interval where measured)."""
    ci = f" [{d['R_ci'][0]:.2f}, {d['R_ci'][1]:.2f}]" if d.get("R_ci") else ""
    return (f"{d['ppl_base']:.1f} / {d['ppl_pruned']:.1f} / {d['ppl_recovered']:.1f}",
            "n/a" if d["R"] is None else f"{d['R']:.2f}{ci}")
